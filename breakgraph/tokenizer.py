"""Tokenizer: HF `tokenizers` wrapper built from an HF model dir or GGUF metadata, chat template
rendering like HF's `apply_chat_template`, and incremental detokenization for streaming."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as _HFTokenizer

logger = logging.getLogger(__name__)

# GGUF token types (gguf.TokenType); tokenizer.py must not depend on the gguf package.
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

# Pre-tokenizer regexes from llama.cpp's llama-vocab.cpp, keyed by `tokenizer.ggml.pre`.
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2_PRES = {"default", "gpt2", "gpt-2", "phi-2", "jina-es", "jina-de"}
# GPT-2 regex with every numeric char isolated first (`\p{N}` then the GPT-2 regex in llama.cpp).
_DIGITS_PRES = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"}
_LLAMA3_PRES = {"llama3", "llama-bpe", "llama-v3", "falcon3", "pixtral", "dbrx", "smaug-bpe"}
_QWEN2_PRES = {"qwen2", "deepseek-r1-qwen", "stablelm2", "megrez", "hunyuan"}
_SPLIT_REGEX = {
    **dict.fromkeys(_LLAMA3_PRES, _LLAMA3_REGEX),
    **dict.fromkeys(_QWEN2_PRES, _QWEN2_REGEX),
}


def gguf_field_value(field: Any) -> Any:
    """Value of a gguf ReaderField (duck-typed: parts/data/types), or `field` itself if plain."""
    if not (hasattr(field, "parts") and hasattr(field, "data") and hasattr(field, "types")):
        return field
    types = [int(t) for t in field.types]
    float32_type, string_type, array_type = 6, 8, 9  # gguf.GGUFValueType
    if types[0] == array_type:
        if types[-1] == string_type:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        return [field.parts[i][0].item() for i in field.data]
    if types[0] == string_type:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    value = field.parts[field.data[0]][0]
    if types[0] == float32_type:
        # numpy prints a float32 in its shortest round-trip form: 1e-05, not 9.999999747378752e-06.
        return float(str(value))
    return value.item()


def _byte_level_pre_tokenizer(pre: str) -> tuple[pre_tokenizers.PreTokenizer, bool]:
    """Pre-tokenizer matching llama.cpp's `tokenizer.ggml.pre`, and whether BPE ignores merges."""
    if pre in _DIGITS_PRES:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        ), False
    if pre in _SPLIT_REGEX:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLIT_REGEX[pre]), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        ), pre in _LLAMA3_PRES
    if pre not in _GPT2_PRES:
        logger.warning("unknown tokenizer.ggml.pre %r: using the GPT-2 byte-level regex", pre)
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), False


def _template_processor(
    bos: str | None, eos: str | None, vocab: Mapping[str, int]
) -> processors.PostProcessor:
    """Post-processor adding BOS/EOS like llama.cpp's add_bos_token/add_eos_token."""
    pre = [bos] if bos else []
    post = [eos] if eos else []
    single = " ".join([*pre, "$A", *post])
    pair = " ".join(
        [*pre, "$A", *post, *[f"{t}:1" for t in pre], "$B:1", *[f"{t}:1" for t in post]]
    )
    specials = [(t, vocab[t]) for t in dict.fromkeys(pre + post)]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


class _GenerationTag(Extension):
    """Accept HF's `{% generation %}...{% endgeneration %}` tag, rendering its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render", [])
        return nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in the same sandboxed environment HF transformers uses."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, "jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _token_content(token: Any) -> str | None:
    """A special token from tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(token, dict):
        return token.get("content")
    return token


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the special ids and chat template a server needs."""

    def __init__(
        self,
        backend: _HFTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: Iterable[int],
        chat_template: str | None = None,
        special_tokens: Mapping[str, str] | None = None,
    ):
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids: set[int] = set(eos_token_ids)
        self.chat_template = chat_template
        # bos_token/eos_token/... strings handed to the chat template, as HF does.
        self.special_tokens = dict(special_tokens or {})
        self._template = _compile_chat_template(chat_template) if chat_template else None

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render `messages` into a prompt string, like HF's apply_chat_template(tokenize=False)."""
        if self._template is None:
            raise ValueError("this tokenizer has no chat template")
        context = {**self.special_tokens, **kwargs}
        return self._template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **context
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> Tokenizer:
        """Load from an HF model dir: tokenizer.json, tokenizer_config.json, generation_config.json."""
        model_dir = Path(model_dir)
        backend = _HFTokenizer.from_file(str(model_dir / "tokenizer.json"))
        tok_config = _read_json(model_dir / "tokenizer_config.json")
        specials = {
            name: content
            for name in ("bos_token", "eos_token", "unk_token", "pad_token")
            if (content := _token_content(tok_config.get(name))) is not None
        }
        ids = {name: backend.token_to_id(content) for name, content in specials.items()}

        eos_ids: set[int] = set()
        for config_name in ("generation_config.json", "config.json"):
            eos = _read_json(model_dir / config_name).get("eos_token_id")
            if eos is not None:
                eos_ids.update(eos if isinstance(eos, list) else [eos])
                break
        if ids.get("eos_token") is not None:
            eos_ids.add(ids["eos_token"])

        return cls(
            backend,
            bos_token_id=ids.get("bos_token"),
            eos_token_ids=eos_ids,
            chat_template=_read_chat_template(model_dir, tok_config),
            special_tokens=specials,
        )

    @classmethod
    def from_gguf(cls, reader_or_fields: Any) -> Tokenizer:
        """Build a byte-level BPE tokenizer from GGUF metadata (a GGUFReader or its fields dict)."""
        fields = getattr(reader_or_fields, "fields", reader_or_fields)

        def get(key: str, default: Any = None) -> Any:
            return gguf_field_value(fields[key]) if key in fields else default

        kind = get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise NotImplementedError(
                f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2')"
            )
        tokens: list[str] = get("tokenizer.ggml.tokens")
        token_types: list[int] = get("tokenizer.ggml.token_type", [1] * len(tokens))
        merges = [tuple(m.split(" ", 1)) for m in get("tokenizer.ggml.merges", [])]
        pre = get("tokenizer.ggml.pre", "default")

        vocab = {tok: i for i, tok in enumerate(tokens)}
        pre_tokenizer, ignore_merges = _byte_level_pre_tokenizer(pre)
        backend = _HFTokenizer(
            models.BPE(
                vocab, merges, fuse_unk=False, byte_fallback=False, ignore_merges=ignore_merges
            )
        )
        backend.pre_tokenizer = pre_tokenizer
        backend.decoder = decoders.ByteLevel()
        backend.add_special_tokens(
            [
                AddedToken(tokens[i], special=True, normalized=False)
                for i, t in enumerate(token_types)
                if t == _TOKEN_CONTROL
            ]
        )
        backend.add_tokens(
            [
                AddedToken(tokens[i], special=False, normalized=False)
                for i, t in enumerate(token_types)
                if t == _TOKEN_USER_DEFINED
            ]
        )

        bos_id = get("tokenizer.ggml.bos_token_id")
        eos_id = get("tokenizer.ggml.eos_token_id")
        bos = tokens[bos_id] if bos_id is not None else None
        eos = tokens[eos_id] if eos_id is not None else None
        add_bos = bool(get("tokenizer.ggml.add_bos_token", False)) and bos is not None
        add_eos = bool(get("tokenizer.ggml.add_eos_token", False)) and eos is not None
        if add_bos or add_eos:
            backend.post_processor = _template_processor(
                bos if add_bos else None, eos if add_eos else None, vocab
            )

        # End-of-generation ids: EOS plus the end-of-turn/end-of-message ids where present.
        eos_ids = {
            i
            for key in ("eos_token_id", "eot_token_id", "eom_token_id")
            if (i := get(f"tokenizer.ggml.{key}")) is not None
        }
        specials = {"bos_token": bos, "eos_token": eos}
        for name in ("unknown", "padding"):
            if (i := get(f"tokenizer.ggml.{name}_token_id")) is not None:
                specials["unk_token" if name == "unknown" else "pad_token"] = tokens[i]
        return cls(
            backend,
            bos_token_id=bos_id,
            eos_token_ids=eos_ids,
            chat_template=get("tokenizer.chat_template"),
            special_tokens={k: v for k, v in specials.items() if v is not None},
        )


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _read_chat_template(model_dir: Path, tok_config: dict) -> str | None:
    """chat_template.jinja if present (newer HF layout), else tokenizer_config's chat_template."""
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default")
    return template


class IncrementalDetokenizer:
    """Turns a stream of ids into text deltas, holding back incomplete UTF-8 characters.

    `feed` returns the text the new ids completed; after `flush`, the concatenated deltas equal
    `tokenizer.decode(all_ids)`.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""
        # ids[prefix_offset:read_offset] were already emitted; they are re-decoded with the new
        # ids so that merges across the boundary (and decoders' leading-space rules) stay right.
        self._prefix_offset = 0
        self._read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def feed(self, new_ids: Iterable[int]) -> str:
        """Append ids; return the newly completed text ('' while a character is incomplete)."""
        self.ids.extend(new_ids)
        prefix_text = self._decode(self.ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self.ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """Emit whatever was held back (e.g. a stream ending in invalid UTF-8); call at the end."""
        full = self._decode(self.ids)
        if not full.startswith(self.text):
            logger.warning("incremental detokenization diverged from a full decode")
            return ""
        delta = full[len(self.text) :]
        self.text = full
        self._prefix_offset = self._read_offset = len(self.ids)
        return delta
