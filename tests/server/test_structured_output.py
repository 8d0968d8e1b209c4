"""Structured output and tool calls through a live server on the embedded SmolLM2 (real
weights, CPU): twenty JSON schemas answered at once, each answer parsing and validating;
regex and EBNF through /generate; json_object through /v1/completions; the openai client's
``parse`` with a pydantic model and its tool-call loop; ``tool_choice`` required and named
giving valid ``tool_calls``, streamed and not; bad grammars and tools answered 400 in one
line."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")
openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")

from breakgraph.bench.grammar_schemas import SCHEMAS  # noqa: E402
from tests.support import embedded  # noqa: E402
from tests.support.server import assert_refused_holding_nothing, post  # noqa: E402

server, client, model_name = embedded.server, embedded.client, embedded.model_name

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
            "required": ["zone"],
        },
    },
}
TOOLS = [WEATHER, CLOCK]
SCHEMA_OF = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def _chat(client, model_name, content: str, **kw):
    return client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": content}],
        temperature=0,
        **kw,
    )


def test_twenty_schemas_at_once_parse_and_validate(client, model_name):
    def ask(item):
        description, schema = item
        fmt = {"type": "json_schema",
               "json_schema": {"name": "answer", "schema": schema, "strict": True}}  # fmt: skip
        return _chat(client, model_name, f"Answer in JSON: {description}.", max_tokens=64,
                     response_format=fmt)  # fmt: skip

    with ThreadPoolExecutor(len(SCHEMAS)) as pool:
        replies = list(pool.map(ask, SCHEMAS))
    for (description, schema), reply in zip(SCHEMAS, replies, strict=True):
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", (description, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_generate_regex_ebnf_and_schema_object(server):
    body = {
        "text": ["A US phone number: ", "Is water wet? ", "A person: "],
        "sampling_params": [
            {"max_new_tokens": 16, "temperature": 0, "regex": r"\(\d{3}\) \d{3}-\d{4}"},
            {"max_new_tokens": 8, "temperature": 0, "ebnf": 'root ::= "yes" | "no"'},
            # SGLang takes the schema as JSON text; an object is taken too
            {"max_new_tokens": 32, "temperature": 0, "json_schema": SCHEMAS[0][1]},
        ],
    }
    r = post(server, "/generate", body, timeout=600)  # a loaded CPU takes its time
    assert r.status_code == 200, r.text
    phone, yes_no, person = r.json()
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", phone["text"]), phone["text"]
    assert yes_no["text"] in ("yes", "no")
    jsonschema.validate(json.loads(person["text"]), SCHEMAS[0][1])
    for out in (phone, yes_no, person):
        assert out["meta_info"]["finish_reason"]["type"] == "stop"


def test_completions_json_object(client, model_name):
    reply = client.completions.create(
        model=model_name, prompt="A JSON object describing a cat: ", max_tokens=48,
        temperature=0, extra_body={"response_format": {"type": "json_object"}},
    )  # fmt: skip
    choice = reply.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.text), dict)
    else:  # no bound in the schema: a long answer is cut, but it is a JSON object so far
        assert choice.text.startswith("{")


def test_streamed_schema_answer_equals_whole(client, model_name):
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMAS[12][1]}}
    whole = _chat(client, model_name, "A pet as JSON.", max_tokens=48, response_format=fmt)
    stream = _chat(client, model_name, "A pet as JSON.", max_tokens=48, response_format=fmt,
                   stream=True)  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == whole.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMAS[12][1])


class Movie(pydantic.BaseModel):
    title: str = pydantic.Field(max_length=16)
    year: int = pydantic.Field(ge=1900, le=2030)
    genre: str = pydantic.Field(pattern="^(drama|comedy|horror)$")


def test_openai_parse_with_a_pydantic_model(client, model_name):
    reply = client.chat.completions.parse(
        model=model_name,
        messages=[{"role": "user", "content": "Name a movie, as JSON."}],
        response_format=Movie,
        max_tokens=64,
        temperature=0,
    )
    movie = reply.choices[0].message.parsed
    assert isinstance(movie, Movie) and 1900 <= movie.year <= 2030


def _assembled(stream) -> tuple[str, list[tuple[str, str]], str]:
    """A streamed chat answer put together as the openai client does: content, calls, finish."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for tc in choice.delta.tool_calls or []:
            name, args = calls.get(tc.index, ("", ""))
            calls[tc.index] = (
                name + (tc.function.name or ""),
                args + (tc.function.arguments or ""),
            )
        finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def test_tool_choice_required_gives_valid_calls_streamed_or_not(client, model_name):
    ask = "What is the weather in Paris?"
    # one call (a small model asked for a list of calls may not stop listing them)
    kw = dict(tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=64)
    whole = _chat(client, model_name, ask, **kw).choices[0]
    assert whole.finish_reason == "tool_calls", whole.message
    calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert calls and whole.message.content is None
    for c in whole.message.tool_calls:
        assert c.id.startswith("call_") and c.type == "function"
        jsonschema.validate(json.loads(c.function.arguments), SCHEMA_OF[c.function.name])
    content, streamed, finish = _assembled(_chat(client, model_name, ask, stream=True, **kw))
    assert (content, streamed, finish) == ("", calls, "tool_calls")


def test_named_tool_choice_and_the_tool_call_loop(client, model_name):
    """The openai client's loop: a forced call (parsed into the tool's pydantic model), its
    result sent back as a tool message with the assistant's call, then a plain answer."""

    class GetWeather(pydantic.BaseModel):
        city: str = pydantic.Field(max_length=12)
        unit: str = pydantic.Field(pattern="^(celsius|fahrenheit)$")

    tool = openai.pydantic_function_tool(GetWeather, name="get_weather")
    messages = [{"role": "user", "content": "How warm is it in Rome?"}]
    first = client.chat.completions.parse(
        model=model_name, messages=messages, tools=[tool], max_tokens=48, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    ).choices[0]  # fmt: skip
    (call,) = first.message.tool_calls
    assert call.function.name == "get_weather"
    assert isinstance(call.function.parsed_arguments, GetWeather)
    messages += [
        first.message.model_dump(exclude_none=True, exclude={"parsed"}),
        {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 21}'},
    ]
    second = client.chat.completions.create(
        model=model_name, messages=messages, tools=[tool], tool_choice="none", max_tokens=16,
        temperature=0,
    ).choices[0]  # fmt: skip
    assert second.message.tool_calls is None and second.message.content


@pytest.mark.parametrize(
    "route,body,says",
    [
        ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "objekt"}}}}, "json_schema failed to compile"),
        ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": "{not json"}}}, "is not valid JSON"),
        ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format.type"),
        ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]},
         "tools[0].function.parameters is missing"),
        ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": {"type": "function",
         "function": {"name": "nope"}}}, "not among the tools"),
        ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f",
         "parameters": {"type": "object", "properties": {"a": {"type": "strang"}}}}}],
         "tool_choice": "required"}, "json_schema failed to compile"),
        ("/generate", {"sampling_params": {"regex": "(a|b"}}, "regex failed to compile"),
        ("/generate", {"sampling_params": {"ebnf": "root ::= missing"}}, "ebnf failed to compile"),
        ("/generate", {"sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}},
         "at most one of json_schema, regex and ebnf"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("stream", [False, True])
def test_bad_grammar_or_tool_is_a_400_in_one_line(server, model_name, route, body, says, stream):
    if route == "/generate":
        body = {"text": "hi", **body, "stream": stream}
    else:
        body = {"model": model_name, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4, "stream": stream, **body}  # fmt: skip
    r = post(server, route, body)
    assert_refused_holding_nothing(server, r, says)
