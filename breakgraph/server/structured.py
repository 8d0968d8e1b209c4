"""Structured output in the API process: OpenAI's ``response_format`` and SGLang's
``json_schema`` / ``regex`` / ``ebnf`` sampling parameters as the engine's grammar fields
(common/sampling_params.py). What can be checked without compiling is checked here (a schema
must be JSON); the engine compiles the grammar and refuses one that does not compile."""

from __future__ import annotations

import json
from typing import Any

from breakgraph.server.errors import APIError

# json_object: any JSON object (xgrammar's strict mode still lets an object with no listed
# properties take any)
JSON_OBJECT_SCHEMA = '{"type": "object"}'


def schema_text(schema: Any, where: str) -> str:
    """A JSON schema given as an object (or as JSON text) -> its JSON text; a 400 naming
    ``where`` if it is neither an object, a boolean nor JSON text of one."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise APIError(f"{where} is not valid JSON: {e}", param=where) from None
    if not isinstance(schema, dict | bool):
        raise APIError(f"{where} must be a JSON schema (an object), got {type(schema).__name__}",
                       param=where)  # fmt: skip
    return json.dumps(schema, ensure_ascii=False)


def sampling_grammar(d: dict[str, Any]) -> None:
    """SGLang's sampling_params: a json_schema given as an object becomes its JSON text, and
    JSON text that does not parse is a 400 here (in place)."""
    if d.get("json_schema") is not None:
        d["json_schema"] = schema_text(d["json_schema"], "json_schema")


def response_format_params(response_format: dict[str, Any] | None) -> dict[str, str]:
    """OpenAI's response_format as sampling parameters: {} for text, a json_schema for
    json_object and json_schema (``strict`` or not, the schema is enforced)."""
    if response_format is None:
        return {}
    if not isinstance(response_format, dict):
        raise APIError("response_format must be an object", param="response_format")
    kind = response_format.get("type", "text")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_schema": JSON_OBJECT_SCHEMA}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise APIError("response_format.json_schema must be an object with a schema",
                           param="response_format")  # fmt: skip
        schema = spec.get("schema", spec.get("schema_"))
        if schema is None:
            raise APIError("response_format.json_schema.schema is missing",
                           param="response_format")  # fmt: skip
        return {"json_schema": schema_text(schema, "response_format.json_schema.schema")}
    raise APIError(
        f"response_format.type must be text, json_object or json_schema, got {kind!r}",
        param="response_format",
    )
