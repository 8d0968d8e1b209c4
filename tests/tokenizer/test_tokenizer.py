"""Tokenizer built from the embedded SmolLM2 GGUF against transformers' tokenizer of the same file,
chat template rendering, and streaming detokenization."""

import json
import random
import unicodedata

import jinja2
import pytest
from gguf import GGUFReader

from breakgraph.models.gguf_loader import EmbeddedModelMissing, find_embedded_gguf
from breakgraph.server.detokenize import TextStream
from breakgraph.tokenizer import IncrementalDetokenizer, Tokenizer, _byte_level_pre_tokenizer

CHATML_PROMPT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    "<|im_start|>assistant\n"
)
# Texts on which the GPT-2 regex alone and SmolLM2's Digits-then-GPT-2 pre-tokenizer agree.
TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "héllo wörld, naïve café — déjà vu",
    "世界你好，这是一个测试。日本語のテキスト",
    "Привет, мир! مرحبا بالعالم",
    "emoji 🤖👍🏽 family 👨‍👩‍👧 flag 🇫🇷",
    "3.14159 and 42, 2024-01-01, x=1+2, 1,000,000",
    "tabs\t\tand\n\n\nnewlines   \r\n",
    "   leading and trailing   ",
    "I'm sure they'll say it's fine, don't you think? We've seen it.",
    "def f(x):\n    return x ** 2  # square\n",
    CHATML_PROMPT,
    "<|im_start|>user\nHi<|im_end|>\n<|endoftext|>",
]
# Numbers after whitespace runs, and non-ASCII numerals: transformers' GGUF converter keeps only
# the GPT-2 regex here, while SmolLM2's tokenizer.json (and llama.cpp's "smollm") isolate digits.
DIGIT_SENSITIVE_TEXTS = ["a   123 b", "  12", "\n\n7 days", "½ ² Ⅻ ٣ ⅷ", "x\t\t\t2024"]


@pytest.fixture(scope="module")
def gguf_path():
    try:
        return find_embedded_gguf()
    except EmbeddedModelMissing as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def tok(gguf_path):
    return Tokenizer.from_gguf(GGUFReader(str(gguf_path)))


@pytest.fixture(scope="module")
def hf_tok(gguf_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


def _digit_isolated(text):
    """Split text like tokenizers' Digits(individual_digits=True): each numeric char alone."""
    pieces, current = [], ""
    for ch in text:
        if unicodedata.category(ch).startswith("N"):
            pieces += [current, ch] if current else [ch]
            current = ""
        else:
            current += ch
    return pieces + ([current] if current else [])


def test_special_tokens_of_embedded_gguf(tok):
    assert tok.eos_token_ids == {2} and tok.id_to_token(2) == "<|im_end|>"
    assert tok.bos_token_id == 1 and tok.id_to_token(1) == "<|im_start|>"
    assert tok.vocab_size == 49152 and tok.has_chat_template
    assert tok.encode("Hi", add_special_tokens=True) == tok.encode("Hi")  # add_bos_token false


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tok, hf_tok, text):
    assert tok.encode(text) == hf_tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS + DIGIT_SENSITIVE_TEXTS)
def test_encode_isolates_digits_like_smollm2(tok, hf_tok, text):
    # SmolLM2's tokenizer.json runs Digits(individual_digits) before the byte-level GPT-2 split:
    # the same as transformers' tokenizer applied to each digit-isolated piece.
    expected = [i for piece in _digit_isolated(text) for i in hf_tok.encode(piece)]
    assert tok.encode(text) == expected


def test_decode_matches_transformers(tok, hf_tok):
    for text in TEXTS + DIGIT_SENSITIVE_TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids, skip_special_tokens=False) == text
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf_tok.decode(
                ids, skip_special_tokens=skip
            )


def test_chat_template_matches_transformers(tok, hf_tok):
    question = [{"role": "user", "content": "What is the capital of France?"}]
    ours = tok.apply_chat_template(question, add_generation_prompt=True)
    assert ours == hf_tok.apply_chat_template(question, tokenize=False, add_generation_prompt=True)
    assert ours == CHATML_PROMPT  # the template's default system prompt is injected

    dialog = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "Thanks 🙏"},
    ]
    for gen in (True, False):
        assert tok.apply_chat_template(dialog, add_generation_prompt=gen) == (
            hf_tok.apply_chat_template(dialog, tokenize=False, add_generation_prompt=gen)
        )


def test_chat_template_environment_matches_hf():
    template = (
        "{{ bos_token }}{% for m in messages %}{% if m.role == 'tool' %}"
        "{{ raise_exception('no tools') }}{% endif %}{{ m | tojson }}{% endfor %}{{ eos_token }}"
    )
    tok = Tokenizer(
        _tiny_backend(),
        bos_token_id=0,
        eos_token_ids=[1],
        chat_template=template,
        special_tokens={"bos_token": "<s>", "eos_token": "</s>"},
    )
    out = tok.apply_chat_template([{"role": "user", "content": "é"}])
    assert out == '<s>{"role": "user", "content": "é"}</s>'
    with pytest.raises(jinja2.exceptions.TemplateError, match="no tools"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def _tiny_backend():
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    return HFTokenizer(models.WordLevel({"<s>": 0, "</s>": 1, "[UNK]": 2}, unk_token="[UNK]"))


def test_from_pretrained_matches_transformers(tok, hf_tok, tmp_path):
    hf_tok.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    ours = Tokenizer.from_pretrained(tmp_path)
    for text in TEXTS + DIGIT_SENSITIVE_TEXTS:  # same tokenizer.json as transformers uses
        assert ours.encode(text) == hf_tok.encode(text, add_special_tokens=False)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    assert ours.apply_chat_template(question) == tok.apply_chat_template(question)
    assert ours.eos_token_ids == {0, 2} and ours.bos_token_id == 1


def test_incremental_detokenizer_one_id_at_a_time(tok):
    text = "Añø 世界 🤖👍🏽👨‍👩‍👧 ok<|im_end|> done ½"
    ids = tok.encode(text)
    for skip in (True, False):
        detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
        deltas = [detok.feed([i]) for i in ids]
        assert all("\ufffd" not in d for d in deltas)  # never half a character
        assert "".join(deltas) + detok.flush() == tok.decode(ids, skip_special_tokens=skip)
    # A 4-byte emoji spans several byte-level tokens: nothing is emitted until it completes.
    emoji_ids = tok.encode("🤖")
    assert len(emoji_ids) > 1
    detok = IncrementalDetokenizer(tok)
    assert [detok.feed([i]) for i in emoji_ids] == [""] * (len(emoji_ids) - 1) + ["🤖"]


def test_incremental_detokenizer_flushes_a_dangling_byte(tok):
    ids = tok.encode("ok 🤖")[:-1]  # cut inside the emoji
    detok = IncrementalDetokenizer(tok)
    streamed = "".join(detok.feed([i]) for i in ids)
    assert streamed == "ok"
    assert streamed + detok.flush() == tok.decode(ids)


def _shown_by_whole_text_search(detok_text: str, stream: TextStream, shown: str) -> str:
    """What TextStream.feed showed before: every stop string searched for in the whole text
    (the stream's own hold-back of a stop string's prefix, which did not change)."""
    text = detok_text
    for s in stream.stop:
        if s in text:
            text = text[: text.index(s)]
    text = text[: len(text) - stream._held_back(text)]
    return text if text.startswith(shown) else shown


@pytest.mark.parametrize("seed", range(6))
def test_text_stream_shows_what_a_whole_text_search_shows(tok, seed):
    """A stream searches only the newly decoded text for stop strings; what it shows after
    every chunk of ids equals a search of the whole text: stop strings late in a long
    output, spanning chunks, overlapping, with their prefixes (held back) earlier on."""
    rng = random.Random(seed)
    words = ["the", " fox", " over", " lazy", " dog", " é", "🤖", "\n", ":", " User"]
    stop = rng.sample(["\n\nUser:", "fox fox jumps", "🤖 é!", " dog dog dog", "jumps"], 3)
    pieces = [rng.choice(words) for _ in range(600)]
    for s in stop:  # a prefix of each, then (for two of them) the whole string, later on
        pieces.insert(rng.randrange(len(pieces)), s[: rng.randrange(1, len(s))])
    for s in stop[:2]:
        pieces.insert(rng.randrange(len(pieces) // 2, len(pieces)), s)
    ids = tok.encode("".join(pieces))
    stream, shown, detok, i = TextStream(tok, stop), "", IncrementalDetokenizer(tok), 0
    while i < len(ids):
        chunk = ids[i : i + rng.choice([1, 1, 2, 5])]
        i += len(chunk)
        detok.feed(chunk)
        shown = _shown_by_whole_text_search(detok.text, stream, shown)
        assert stream.feed(chunk) == shown
    assert len(shown) < len(detok.text)  # a stop string cut it


def test_llama3_pre_tokenizer_groups_digits_by_three():
    pre, ignore_merges = _byte_level_pre_tokenizer("llama-bpe")
    pieces = [p for p, _ in pre.pre_tokenize_str("abc 12345 it's")]
    assert pieces == ["abc", "Ġ", "123", "45", "Ġit", "'s"] and ignore_merges
