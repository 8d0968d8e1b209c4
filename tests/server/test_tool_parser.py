"""Tool calls read back from a model's own format (Qwen3's ``<tool_call>`` JSON, Llama 3.1's
JSON) and from the forced grammars, whole or streamed in pieces of any size (the same
answer either way), and the conversation handed to a template with or without tools."""

from __future__ import annotations

import json

import pytest

from breakgraph.server.errors import APIError
from breakgraph.server.tool_parser import ToolCallParser, detect_format, parse_answer
from breakgraph.server.tools import (
    check_tool_choice,
    check_tools,
    renders_tools,
    template_messages,
    tool_grammar,
)

QWEN = (
    'I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
)
LLAMA = '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}'


def _streamed(parser: ToolCallParser, text: str, step: int):
    shown, calls = "", []
    for i in range(0, len(text), step):
        s, c = parser.feed(text[i : i + step])
        shown, calls = shown + s, calls + c
    s, c = parser.finish()
    return shown + s, [(x.name, json.loads(x.arguments)) for x in calls + c]


@pytest.mark.parametrize(
    "fmt,text,content,calls",
    [
        ("qwen", QWEN, "I will check.",
         [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]),
        ("qwen", "No calls here.", "No calls here.", []),
        ("qwen", "a <tool_call> not json </tool_call> b", "a <tool_call> not json </tool_call> b",
         []),
        ("qwen", 'x <tool_call>{"name": "f", "arguments": {"a": 1}}', "x", [("f", {"a": 1})]),
        ("llama3_json", LLAMA, None, [("get_weather", {"city": "Paris"}), ("get_time", {})]),
        ("llama3_json", "The answer is 4.", "The answer is 4.", []),
        ("llama3_json", '{"not": "a call"}', '{"not": "a call"}', []),
        ("required", '[{"name": "f", "arguments": {"a": 1}}]', None, [("f", {"a": 1})]),
        ("required", '[{"name": "f", "argu', '[{"name": "f", "argu', []),  # cut by length
    ],
)  # fmt: skip
def test_answers_split_into_content_and_calls_whole_or_streamed(fmt, text, content, calls):
    got_content, got_calls = parse_answer(ToolCallParser(fmt), text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    for step in (1, 2, 5, 11):
        shown, streamed = _streamed(ToolCallParser(fmt), text, step)
        assert shown == (content or "") and streamed == calls


def test_named_function_answer_is_its_arguments():
    content, (call,) = parse_answer(ToolCallParser("named", "get_weather"), '{"city": "Oslo"}')
    assert content is None and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Oslo"}
    assert call.openai(0)["index"] == 0 and call.openai()["function"]["name"] == "get_weather"


def test_format_detected_from_the_template():
    qwen3 = '{%- if tools %}...<tool_call>\\n{"name": <function-name>, ...}</tool_call>{% endif %}'
    llama31 = '{%- if tools is not none %}...<|python_tag|>...{{ "ipython" }}{% endif %}'
    assert detect_format(qwen3) == "qwen" and renders_tools(qwen3)
    assert detect_format(llama31) == "llama3_json" and renders_tools(llama31)
    chatml = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
    assert detect_format(chatml) == "qwen" and not renders_tools(chatml)


TOOL = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}  # fmt: skip


def test_tool_checks_and_forced_grammars():
    tools = check_tools([TOOL])
    assert check_tool_choice(None, tools).mode == "auto"
    assert check_tool_choice(None, []).mode == "none"
    named = check_tool_choice({"type": "function", "function": {"name": "f"}}, tools)
    assert json.loads(tool_grammar(tools, named)["json_schema"]) == TOOL["function"]["parameters"]
    required = json.loads(tool_grammar(tools, check_tool_choice("required", tools), False)
                          ["json_schema"])  # fmt: skip
    assert required["minItems"] == required["maxItems"] == 1
    assert tool_grammar(tools, check_tool_choice("auto", tools)) == {}
    for bad, says in [
        ([{"type": "function", "function": {"name": "f"}}], "parameters is missing"),
        ([TOOL, TOOL], "a second tool named"),
        ([{"type": "retrieval"}], "of type function"),
    ]:
        with pytest.raises(APIError, match=says):
            check_tools(bad)
    with pytest.raises(APIError, match="needs tools"):
        check_tool_choice("required", [])


def test_conversation_with_calls_for_templates_with_and_without_tools():
    call = {"id": "call_1", "type": "function",
            "function": {"name": "f", "arguments": '{"a": 1}'}}  # fmt: skip
    msgs = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "42", "tool_call_id": "call_1"},
    ]
    tools = check_tools([TOOL])
    native = template_messages(msgs, tools, native=True)
    assert native[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1}  # HF's convention
    assert native[2]["role"] == "tool" and len(native) == 3
    plain = template_messages(msgs, tools, native=False)
    assert plain[0]["role"] == "system" and '"name": "f"' in plain[0]["content"]
    assert "<tool_call>" in plain[2]["content"] and "tool_calls" not in plain[2]
    assert plain[3] == {"role": "user", "content": "<tool_response>\n42\n</tool_response>"}
