"""Tool calls, request side: OpenAI's ``tools`` and ``tool_choice`` checked, the grammar that
holds ``required`` and a named function to the tools' JSON schemas, and the conversation with
its tool calls and tool results handed to the chat template.

A template that renders tools (Qwen3's, Llama 3.1's) gets them as HF's ``tools`` argument and
the model answers in its own format (tool_parser.py reads it back). A template that does not
(SmolLM2's ChatML) gets them in a system message that asks for Qwen's ``<tool_call>`` format,
and earlier calls and results are written into the conversation in that format."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from breakgraph.server.errors import APIError
from breakgraph.server.structured import schema_text

Mode = Literal["none", "auto", "required", "named"]
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolChoice:
    mode: Mode
    name: str | None = None  # the named function

    @property
    def forced(self) -> bool:
        """The output is held to a grammar of tool calls (required, a named function)."""
        return self.mode in ("required", "named")


def check_tools(tools: list[Any] | None) -> list[dict[str, Any]]:
    """Each tool as {"type": "function", "function": {name, description, parameters}}; a 400
    naming the first tool that is not a function with a name and a JSON schema."""
    checked, names = [], set()
    for i, tool in enumerate(tools or []):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise APIError(f"{where} must be an object of type function", param="tools")
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise APIError(f"{where}.function must be an object with a name", param="tools")
        if fn.get("parameters") is None:
            raise APIError(
                f"{where}.function.parameters is missing: a tool needs the JSON schema of its "
                "arguments",
                param="tools",
            )
        params = json.loads(schema_text(fn["parameters"], f"{where}.function.parameters"))
        if fn["name"] in names:
            raise APIError(f"{where}: a second tool named {fn['name']!r}", param="tools")
        names.add(fn["name"])
        checked.append({"type": "function", "function": {**fn, "parameters": params}})
    return checked


def check_tool_choice(choice: Any, tools: list[dict[str, Any]]) -> ToolChoice:
    """OpenAI's tool_choice: none, auto (the default with tools), required, or a named
    function ({"type": "function", "function": {"name": ...}})."""
    if choice is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise APIError(
                f"tool_choice must be none, auto, required or a function, got {choice!r}",
                param="tool_choice",
            )
        mode: Mode = choice  # type: ignore[assignment]
        if mode == "required" and not tools:
            raise APIError("tool_choice required needs tools", param="tool_choice")
        return ToolChoice(mode if tools else "none")
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(name, str):
        raise APIError(
            'tool_choice must name a function: {"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    if name not in {t["function"]["name"] for t in tools}:
        raise APIError(f"tool_choice names {name!r}, which is not among the tools",
                       param="tool_choice")  # fmt: skip
    return ToolChoice("named", name)


def tool_grammar(
    tools: list[dict[str, Any]], choice: ToolChoice, parallel: bool = True
) -> dict[str, str]:
    """The sampling parameters that force tool calls: for ``required`` a JSON array of
    {"name", "arguments"} objects (one of the tools each, at least one, at most one unless
    ``parallel``); for a named function the JSON object of its arguments; else nothing."""
    if choice.mode == "named":
        (fn,) = [t["function"] for t in tools if t["function"]["name"] == choice.name]
        return {"json_schema": json.dumps(fn["parameters"], ensure_ascii=False)}
    if choice.mode != "required":
        return {}
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t["function"]["name"]]},
                "arguments": t["function"]["parameters"],
            },
            "required": ["name", "arguments"],
        }
        for t in tools
    ]
    array: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if not parallel:
        array["maxItems"] = 1
    return {"json_schema": json.dumps(array, ensure_ascii=False)}


def renders_tools(chat_template: str | None) -> bool:
    """Whether the template itself writes the tools into the prompt (HF's ``tools``)."""
    return bool(chat_template) and "tools" in chat_template


def template_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]], native: bool
) -> list[dict[str, Any]]:
    """The conversation as the template reads it. Each earlier call's arguments become an
    object (HF's convention: templates write them with ``tojson``). ``native`` False: the
    tools go into the system message, calls into the assistant's text and results into user
    turns, in Qwen's tool-call format."""
    out = []
    for m in messages:
        m = dict(m)
        calls = m.get("tool_calls")
        if calls:
            m["tool_calls"] = [_call_for_template(c) for c in calls]
            if not native:
                text = "\n".join(
                    f"{CALL_OPEN}\n{json.dumps(_name_args(c), ensure_ascii=False)}\n{CALL_CLOSE}"
                    for c in m.pop("tool_calls")
                )
                m["content"] = f"{m.get('content') or ''}\n{text}".lstrip("\n")
        if not native and m["role"] == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
        out.append(m)
    if tools and not native:
        prompt = _tools_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _call_for_template(call: dict[str, Any]) -> dict[str, Any]:
    fn = dict(call.get("function") or {})
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            fn["arguments"] = json.loads(args) if args.strip() else {}
        except ValueError:
            pass  # kept as the text it is
    return {**call, "function": fn}


def _name_args(call: dict[str, Any]) -> dict[str, Any]:
    fn = call["function"]
    return {"name": fn.get("name"), "arguments": fn.get("arguments")}


def _tools_prompt(tools: list[dict[str, Any]]) -> str:
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "You may call one or more functions to help with the user's request. The functions, "
        f"as JSON schemas:\n<tools>\n{listed}\n</tools>\n"
        "To call a function, answer with one JSON object per call inside tags:\n"
        f'{CALL_OPEN}\n{{"name": <function name>, "arguments": <its arguments as a JSON '
        f"object>}}\n{CALL_CLOSE}"
    )
