"""Tool calls, response side: the model's text split into content and OpenAI ``tool_calls``,
streamed or whole (one parser for both, so a stream assembles to the whole answer).

Formats: ``qwen``, each call a JSON object {"name", "arguments"} between ``<tool_call>`` and
``</tool_call>`` (Qwen3's templates, Hermes, and the fallback prompt of tools.py);
``llama3_json``, an answer that is a JSON object {"name", "parameters"} (Llama 3.1's
templates; several may follow one another, separated by ``;``); and the two forced by a
grammar (tools.tool_grammar): ``required``, a JSON array of {"name", "arguments"}, and
``named``, the JSON object of one function's arguments. A call that does not parse stays in
the content as the model wrote it."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from breakgraph.server.tools import CALL_CLOSE, CALL_OPEN, ToolChoice


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self, index: int | None = None) -> dict[str, Any]:
        """The call as a message's ``tool_calls`` entry, or with ``index`` as a stream's
        delta."""
        out: dict[str, Any] = {} if index is None else {"index": index}
        out.update(id=self.id, type="function",
                   function={"name": self.name, "arguments": self.arguments})  # fmt: skip
        return out


def detect_format(chat_template: str | None) -> str:
    """The tool-call format a chat template teaches its model: Llama 3.1's JSON where the
    template speaks of ``<|python_tag|>`` or the ipython role, else Qwen's ``<tool_call>``."""
    template = chat_template or ""
    return "llama3_json" if "<|python_tag|>" in template or "ipython" in template else "qwen"


def parser_for(choice: ToolChoice, chat_template: str | None) -> ToolCallParser | None:
    """The parser of a request's answer, or None where no call can come (tool_choice none)."""
    if choice.mode == "none":
        return None
    if choice.forced:
        return ToolCallParser(choice.mode, choice.name)
    return ToolCallParser(detect_format(chat_template))


def _call(obj: Any, args_key: str = "arguments") -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters")))
    if args is None:
        args = {}
    if not isinstance(args, dict | str):
        return None
    text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return ToolCall(obj["name"], text)


def _json_values(text: str) -> list[Any] | None:
    """The JSON values of ``text`` one after another (whitespace or ``;`` between), or None."""
    decoder, values, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and (text[i].isspace() or text[i] == ";"):
            i += 1
        if i == len(text):
            return values
        try:
            value, i = decoder.raw_decode(text, i)
        except ValueError:
            return None
        values.append(value)


class ToolCallParser:
    """Feed it the answer's text as it grows; it returns the content to show and the calls
    completed. Whitespace that only separates content from a call is dropped; content that
    is only whitespace beside calls is none."""

    def __init__(self, fmt: str, name: str | None = None):
        self.fmt = fmt
        self.name = name  # the named function (fmt "named")
        self.calls: list[ToolCall] = []
        self._buf = ""
        self._inside = False  # qwen: within <tool_call>
        self._held = ""  # trailing whitespace of the content, not shown yet
        self._after_call = False  # the content's next whitespace follows a call: dropped
        self._json: bool | None = None  # llama3_json: the answer is a JSON call (None: unseen)

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buf += text
        if self.fmt == "qwen":
            return self._feed_tagged()
        if self.fmt == "llama3_json":
            if self._json is None and self._buf.strip():
                self._json = self._buf.lstrip().startswith("{")
            if self._json is False:
                text, self._buf = self._buf, ""
                return self._content(text), []
        return "", []  # held to the end: a JSON answer is judged whole

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The rest of the content and calls, once the answer is complete."""
        buf, self._buf = self._buf, ""
        shown, calls = "", []
        if self.fmt == "qwen":
            if self._inside:  # a call the answer never closed
                call = _call(_json_values(buf)[0]) if _single(buf) else None
                if call is None:
                    shown = self._content(CALL_OPEN + buf)
                else:
                    calls, self._held = [call], ""
            else:
                shown = self._content(buf)
        elif buf:
            calls = self._whole(buf)
            if calls is None:
                shown, calls = self._content(buf), []
        self.calls += calls
        if not self.calls:
            shown += self._held
        self._held = ""
        return shown, calls

    def _whole(self, text: str) -> list[ToolCall] | None:
        values = _json_values(text)
        if not values:
            return None
        if self.fmt == "named":
            if len(values) != 1 or not isinstance(values[0], dict):
                return None
            return [ToolCall(self.name, json.dumps(values[0], ensure_ascii=False))]
        if self.fmt == "required":
            if len(values) != 1 or not isinstance(values[0], list):
                return None
            values = values[0]
        calls = [_call(v, "parameters") for v in values]
        return None if not calls or None in calls else calls

    def _feed_tagged(self) -> tuple[str, list[ToolCall]]:
        shown, calls = [], []
        while True:
            if not self._inside:
                i = self._buf.find(CALL_OPEN)
                if i >= 0:
                    shown.append(self._content(self._buf[:i]))
                    self._buf, self._inside = self._buf[i + len(CALL_OPEN) :], True
                    continue
                keep = _partial_suffix(self._buf, CALL_OPEN)
                cut = len(self._buf) - keep
                shown.append(self._content(self._buf[:cut]))
                self._buf = self._buf[cut:]
                return "".join(shown), calls
            j = self._buf.find(CALL_CLOSE)
            if j < 0:
                return "".join(shown), calls
            body, self._buf = self._buf[:j], self._buf[j + len(CALL_CLOSE) :]
            self._inside = False
            call = _call(_json_values(body)[0]) if _single(body) else None
            if call is None:  # not a call after all: the text as written
                shown.append(self._content(CALL_OPEN + body + CALL_CLOSE))
            else:
                calls.append(call)
                self.calls.append(call)
                self._held, self._after_call = "", True  # the whitespace around it

    def _content(self, text: str) -> str:
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        text, self._held = self._held + text, ""
        shown = text.rstrip()
        self._held = text[len(shown) :]
        return shown


def _single(text: str) -> bool:
    values = _json_values(text)
    return values is not None and len(values) == 1


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag`` (a tag maybe cut by the
    stream)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def parse_answer(parser: ToolCallParser, text: str) -> tuple[str | None, list[ToolCall]]:
    """A whole answer -> (content, None when empty beside calls; the calls)."""
    shown, _ = parser.feed(text)
    rest, _ = parser.finish()
    content = shown + rest
    if parser.calls and not content.strip():
        return None, parser.calls
    return content, parser.calls


def chat_message(text: str, parser: ToolCallParser | None) -> dict[str, Any]:
    """A whole answer as the assistant's message: its content and, where it called, its
    ``tool_calls``."""
    if parser is None:
        return {"role": "assistant", "content": text}
    content, calls = parse_answer(parser, text)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [c.openai() for c in calls]
    return message


def finish_reason(reason: str | None, parser: ToolCallParser | None) -> str | None:
    """OpenAI's "tool_calls" for an answer that ended by itself with calls."""
    return "tool_calls" if reason == "stop" and parser is not None and parser.calls else reason
