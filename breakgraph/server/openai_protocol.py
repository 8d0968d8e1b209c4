"""OpenAI request bodies (completions, chat) and their translation into breakgraph requests.

Unknown fields are ignored, as in SGLang; fields breakgraph cannot honour are refused when
set to anything but their neutral value. SGLang's extra sampling fields (top_k, min_p,
min_tokens, ignore_eos, stop_token_ids, skip_special_tokens, no_stop_trim,
repetition_penalty) are accepted. An error names the field as the request sent it.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from breakgraph.common.messages import ModelInfo
from breakgraph.common.sampling_params import MAX_TOP_LOGPROBS, SamplingParams
from breakgraph.server import tools as tool_calls
from breakgraph.server.errors import APIError
from breakgraph.server.protocol import (
    MAX_CHOICES,
    TOKENIZED,
    check_fits,
    check_input_ids,
    encode_text,
    sampling_from_dict,
)
from breakgraph.server.structured import response_format_params
from breakgraph.tokenizer import Tokenizer

# a JSON number (an int too), never a numeric string: the same rule as /generate
Number = Annotated[float, Field(strict=True)]
_SGLANG_NAMES = re.compile(r"\b(max_new_tokens|min_new_tokens)\b")


class StreamOptions(BaseModel):
    include_usage: StrictBool = False
    # vLLM's: with include_usage, every /v1/completions chunk carries its choice's usage so far
    continuous_usage_stats: StrictBool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None  # None: the served model (as vLLM's)
    temperature: Number | None = None
    top_p: Number | None = None
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: StrictInt | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    logit_bias: dict[str, Number] | None = None
    # SGLang extras
    top_k: StrictInt | None = None
    min_p: Number | None = None
    ignore_eos: StrictBool = False
    stop_token_ids: list[StrictInt] | None = None
    skip_special_tokens: StrictBool = True
    no_stop_trim: StrictBool = False
    repetition_penalty: Number | None = None
    min_tokens: StrictInt | None = None  # SGLang's and vLLM's name for min_new_tokens
    response_format: dict[str, Any] | None = None  # text, json_object, json_schema

    def check_common(self) -> None:
        if not 1 <= self.n <= MAX_CHOICES:
            raise APIError(f"n must be in [1, {MAX_CHOICES}], got {self.n}", param="n")

    def sampling_dict(self, max_new_tokens: int) -> dict[str, Any]:
        """The request's sampling fields in SGLang's sampling_params shape."""
        return {
            "max_new_tokens": max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "seed": self.seed,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
            "no_stop_trim": self.no_stop_trim,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "logit_bias": self.logit_bias or None,
            "min_new_tokens": self.min_tokens,
            **self.grammar_params(),
        }

    def grammar_params(self) -> dict[str, str]:
        """The grammar the output is held to (structured.py), as sampling parameters."""
        return response_format_params(self.response_format)

    def max_tokens_field(self) -> str:
        return "max_tokens"

    def in_request_terms(self, e: APIError) -> APIError:
        """``e`` with SGLang's sampling names as this request sent them (``max_tokens``, not
        ``max_new_tokens``): the errors of the shared validation name the OpenAI fields."""
        names = {"max_new_tokens": self.max_tokens_field(), "min_new_tokens": "min_tokens"}

        def rename(text: str) -> str:
            return _SGLANG_NAMES.sub(lambda m: names[m.group(0)], text)

        param = None if e.param is None else rename(e.param)
        return APIError(rename(e.message), status=e.status, param=param)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats


class CompletionRequest(_SamplingFields):
    prompt: Any
    max_tokens: StrictInt | None = 16
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    best_of: StrictInt | None = None
    suffix: str | None = None
    # vLLM's: each choice (each chunk of a stream) carries its output's token ids, and its
    # prompt's once; the one view of the output a server without a tokenizer can stream
    return_token_ids: StrictBool = False

    def max_new_tokens(self) -> int | None:
        return self.max_tokens

    def check(self) -> None:
        self.check_common()
        if self.best_of not in (None, 1, self.n):
            raise APIError("best_of is not supported", param="best_of")
        if self.suffix:
            raise APIError("suffix is not supported", param="suffix")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise APIError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}]", param="logprobs")

    @property
    def prompt_logprobs(self) -> bool:
        """echo with logprobs: the prompt's tokens and logprobs come first."""
        return self.echo and self.logprobs is not None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's result: the call it answers

    def template_dict(self) -> dict[str, Any]:
        """The message as a chat template reads it (HF's shape)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        for key in ("name", "tool_calls", "tool_call_id"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise APIError(f"message content of type {part.type!r} is not supported")
            parts.append(part.text)
        return "".join(parts)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool = True
    chat_template_kwargs: dict[str, Any] | None = None

    def max_new_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def max_tokens_field(self) -> str:
        return "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"

    def check(self) -> None:
        self.check_common()
        if not self.messages:
            raise APIError("messages is empty", param="messages")
        self.tool_choice_checked()
        if self.top_logprobs is not None:
            if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
                raise APIError(
                    f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]", param="top_logprobs"
                )
            if self.top_logprobs and not self.logprobs:
                raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")

    def tool_choice_checked(self) -> tuple[list[dict[str, Any]], tool_calls.ToolChoice]:
        """The tools (checked) and what tool_choice asks of them (server/tools.py)."""
        tools = tool_calls.check_tools(self.tools)
        return tools, tool_calls.check_tool_choice(self.tool_choice, tools)

    def grammar_params(self) -> dict[str, str]:
        """tool_choice required or a named function: the tool-call grammar; else the
        response_format's."""
        tools, choice = self.tool_choice_checked()
        if not choice.forced:
            return response_format_params(self.response_format)
        if response_format_params(self.response_format):
            raise APIError(f"response_format cannot be combined with tool_choice {choice.mode}",
                           param="response_format")  # fmt: skip
        return tool_calls.tool_grammar(tools, choice, self.parallel_tool_calls)


def completion_prompts(
    prompt: Any, tokenizer: Tokenizer | None, info: ModelInfo
) -> list[list[int]]:
    """OpenAI's prompt: a string, a list of strings, token ids, or a list of token id lists."""
    if isinstance(prompt, str):
        return [
            check_input_ids(encode_text(tokenizer, prompt, info.context_length), info, TOKENIZED)
        ]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return [
                check_input_ids(encode_text(tokenizer, p, info.context_length), info, TOKENIZED)
                for p in prompt
            ]
        if all(isinstance(p, list) for p in prompt):
            return [check_input_ids(p, info, f"prompt[{i}]") for i, p in enumerate(prompt)]
        return [check_input_ids(prompt, info, "prompt")]
    if prompt == [] or prompt == "":
        raise APIError("the prompt is empty", param="prompt")
    raise APIError(
        "prompt must be a string, a list of strings, a list of token ids or a list of those",
        param="prompt",
    )


def chat_prompt(req: ChatCompletionRequest, tokenizer: Tokenizer | None, info: ModelInfo):
    if tokenizer is None or not tokenizer.has_chat_template:
        raise APIError("this model has no tokenizer with a chat template: use /v1/completions")
    tools, choice = req.tool_choice_checked()
    offered = tools if choice.mode != "none" else []
    native = tool_calls.renders_tools(tokenizer.chat_template)
    messages = tool_calls.template_messages([m.template_dict() for m in req.messages], offered,
                                            native)  # fmt: skip
    kwargs = dict(req.chat_template_kwargs or {})
    if offered and native:
        kwargs.setdefault("tools", offered)
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
    except Exception as e:  # a template may reject a conversation (e.g. roles out of order)
        raise APIError(f"cannot apply the chat template: {e}") from None
    return check_input_ids(encode_text(tokenizer, text, info.context_length), info, TOKENIZED)


def build_sampling(
    req: _SamplingFields, max_tokens: int | None, prompt_lens: list[int], info: ModelInfo
) -> tuple[SamplingParams, dict[str, bool]]:
    """Sampling for every prompt; no max_tokens means up to the context length (as SGLang), or
    the KV pool if smaller."""
    default = min(info.context_length, info.kv_capacity_tokens) - max(prompt_lens)
    sampling, api_opts = sampling_from_dict(
        req.sampling_dict(max_tokens if max_tokens is not None else max(default, 1))
    )
    return sampling, api_opts


def check_all_fit(prompts: list[list[int]], sampling: SamplingParams, info: ModelInfo) -> None:
    for ids in prompts:
        check_fits(ids, sampling, info)
