"""Twenty JSON schemas of the shapes applications ask for (nested objects, enums, arrays,
bounded numbers, optional fields, unions), each with a prompt; strings and arrays are bounded
so a small model's answer ends within a few dozen tokens. The structured-output tests hold the
embedded model to them; ``bench grammar`` times their compiles."""

from __future__ import annotations

NAME = {"type": "string", "minLength": 1, "maxLength": 12}

SCHEMAS: list[tuple[str, dict]] = [
    ("a person", {"type": "object", "properties": {"name": NAME, "age": {"type": "integer",
     "minimum": 0, "maximum": 120}}, "required": ["name", "age"]}),
    ("a city and its country", {"type": "object", "properties": {"city": NAME,
     "country": NAME}, "required": ["city", "country"]}),
    ("a traffic light colour", {"type": "object", "properties": {"color": {"enum": ["red",
     "amber", "green"]}}, "required": ["color"]}),
    ("three small primes", {"type": "array", "items": {"type": "integer", "minimum": 2,
     "maximum": 50}, "minItems": 3, "maxItems": 3}),
    ("a yes/no answer", {"type": "boolean"}),
    ("a temperature reading", {"type": "object", "properties": {"celsius": {"type": "number",
     "minimum": -50, "maximum": 60}, "unit": {"const": "C"}}, "required": ["celsius", "unit"]}),
    ("a book", {"type": "object", "properties": {"title": NAME, "author": {"type": "object",
     "properties": {"first": NAME, "last": NAME}, "required": ["first", "last"]}},
     "required": ["title", "author"]}),
    ("a shopping list", {"type": "object", "properties": {"items": {"type": "array",
     "items": NAME, "minItems": 1, "maxItems": 3}}, "required": ["items"]}),
    ("a rating", {"type": "object", "properties": {"stars": {"type": "integer", "minimum": 1,
     "maximum": 5}, "comment": {"type": "string", "maxLength": 16}},
     "required": ["stars", "comment"]}),
    ("a point", {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9,
     "maximum": 9}, "y": {"type": "integer", "minimum": -9, "maximum": 9}},
     "required": ["x", "y"]}),
    ("a weekday", {"enum": ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday"]}),
    ("an order", {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1,
     "maximum": 999}, "status": {"enum": ["open", "paid", "shipped"]}, "lines": {"type":
     "array", "items": {"type": "object", "properties": {"sku": {"type": "string", "maxLength": 6},
     "qty": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["sku", "qty"]},
     "minItems": 1, "maxItems": 1}}, "required": ["id", "status", "lines"]}),
    ("a pet", {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]},
     "name": NAME, "vaccinated": {"type": "boolean"}},
     "required": ["kind", "name", "vaccinated"]}),
    ("a version", {"type": "object", "properties": {"major": {"type": "integer", "minimum": 0,
     "maximum": 9}, "minor": {"type": "integer", "minimum": 0, "maximum": 9}},
     "required": ["major", "minor"]}),
    ("a colour as RGB", {"type": "array", "prefixItems": [{"type": "integer", "minimum": 0,
     "maximum": 255}] * 3, "items": False, "minItems": 3}),
    ("a nullable nickname", {"type": "object", "properties": {"nickname": {"anyOf": [NAME,
     {"type": "null"}]}}, "required": ["nickname"]}),
    ("a key and a value", {"type": "object", "properties": {"key": NAME, "value": {"type":
     ["integer", "string"], "maxLength": 8, "minimum": 0, "maximum": 99}},
     "required": ["key", "value"]}),
    ("a tiny matrix", {"type": "array", "items": {"type": "array", "items": {"type": "integer",
     "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 2}, "minItems": 2,
     "maxItems": 2}),
    ("a task", {"type": "object", "properties": {"title": NAME, "done": {"type": "boolean"},
     "priority": {"enum": [1, 2, 3]}, "meta": {"type": "object", "properties": {"owner": NAME},
     "required": ["owner"]}}, "required": ["title", "done", "priority", "meta"]}),
    ("a price", {"type": "object", "properties": {"amount": {"type": "number", "minimum": 0,
     "maximum": 1000}, "currency": {"enum": ["EUR", "USD"]}},
     "required": ["amount", "currency"]}),
]  # fmt: skip
