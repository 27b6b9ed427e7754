"""The hf tokenizer on the SmolLM2 GGUF (byte-level BPE), against transformers itself."""

import pytest

from pyagent_framework import registries
from pyagent_framework.chat_templates import render_chat_template
from pyagent_framework.interfaces import Tokenizer

TEXTS = [
    "Hello, world!",
    "héllo wörld — naïve café, Straße, Ελληνικά, русский текст",
    "emoji: 🦜🚀👩‍👩‍👧‍👦 and flags 🇫🇷🇯🇵",
    "中文测试：你好，世界。日本語のテキスト、한국어 텍스트",
    "   leading spaces, trailing spaces   ",
    "tabs\tand\n\nnewlines\r\n  mixed   whitespace \u00a0 nbsp\u3000ideographic space",
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    '{"json": [1, 2.5e-3, null, true], "key": "va\\"lue"}',
    "numbers 1234567890 3.14159 -42 0x1F 1e10",
    "<|im_start|>user\nspecial tokens in text<|im_end|>\n",
    "",
    " ",
    "a" * 300,
    "zero\u200bwidth joiner\u200d and combining e\u0301 marks, RTL עברית العربية",
]


@pytest.fixture(scope="module")
def tok(smollm2_path):
    return registries.tokenizers.load("hf").from_pretrained(str(smollm2_path))


@pytest.fixture(scope="module")
def ref(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name, local_files_only=True)


@pytest.fixture(scope="module")
def metadata(smollm2_reader):
    fields = smollm2_reader.fields
    return {k: f.contents() for k, f in fields.items() if k.startswith("tokenizer.") and k != "tokenizer.ggml.merges"}


def test_is_a_tokenizer(tok):
    assert isinstance(tok, Tokenizer)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(tok, ref, text):
    for special in (True, False):
        ids = tok.encode(text, add_special_tokens=special)
        assert ids == ref.encode(text, add_special_tokens=special)
        assert all(isinstance(i, int) for i in ids)
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


@pytest.mark.parametrize("text", [t for t in TEXTS if "<|" not in t])
def test_token_bytes_concatenate_to_the_utf8_text(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8")


def test_token_bytes_split_multibyte_characters(tok):
    ids = tok.encode("🦜", add_special_tokens=False)
    parts = [tok.token_bytes(i) for i in ids]
    assert len(parts) > 1 and b"".join(parts) == "🦜".encode()
    # A token holding an incomplete UTF-8 sequence has raw bytes no str could hold.
    assert any(p.decode("utf-8", errors="replace") != p.decode("utf-8", errors="ignore") for p in parts)


def test_token_bytes_of_every_token_agree_with_transformers_decode(tok, ref):
    special = set(ref.all_special_ids) | set(ref.added_tokens_decoder)
    mismatched = []
    for i in range(tok.vocab_size):
        want = ref.decode([i], skip_special_tokens=False)
        got = tok.token_bytes(i).decode("utf-8", errors="replace")
        if got != want:
            mismatched.append((i, got, want))
    assert not mismatched, mismatched[:10]
    for i in special:
        assert tok.token_bytes(i) == ref.convert_ids_to_tokens(i).encode("utf-8")
    with pytest.raises(ValueError, match="49152"):
        tok.token_bytes(tok.vocab_size)
    with pytest.raises(ValueError):
        tok.token_bytes(-1)


def test_special_ids_match_the_gguf_metadata(tok, ref, metadata):
    assert tok.vocab_size == len(metadata["tokenizer.ggml.tokens"]) == len(ref) == 49152
    assert tok.bos_token_id == metadata["tokenizer.ggml.bos_token_id"] == 1
    assert tok.eos_token_ids == frozenset({metadata["tokenizer.ggml.eos_token_id"]}) == frozenset({2})
    assert tok.bos_token == "<|im_start|>" and tok.eos_token == "<|im_end|>"
    assert tok.token_bytes(2) == b"<|im_end|>"
    assert metadata["tokenizer.ggml.tokens"][2] == "<|im_end|>"


def test_chat_template_is_the_embedded_one_and_renders(tok, metadata):
    assert tok.chat_template == metadata["tokenizer.chat_template"]
    messages = [{"role": "user", "content": "Hi 👋"}]
    rendered = render_chat_template(
        tok.chat_template, messages, add_generation_prompt=True, bos_token=tok.bos_token, eos_token=tok.eos_token
    )
    assert rendered == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi 👋<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok.encode(rendered)
    assert ids.count(1) == 3 and ids.count(2) == 2  # the markers are single special tokens
    assert tok.decode(ids, skip_special_tokens=False) == rendered
