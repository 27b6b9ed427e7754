"""The cache of tokenizers converted from GGUF files: a cached load is the same
tokenizer as a fresh conversion, skips the conversion, survives a damaged entry, and
can be turned off."""

from __future__ import annotations

import logging

import pytest

from pyagent_hf import tokenizer as hf_tokenizer
from pyagent_hf._gguf import read_header
from pyagent_hf.tokenizer import HFTokenizer, cache_dir, gguf_tokenizer_key

from .test_tokenizer_gguf import TEXTS


def _entries(root):
    return sorted(p.name for p in (root / "gguf-tokenizers").iterdir()) if (root / "gguf-tokenizers").exists() else []


def _same_tokenizer(a: HFTokenizer, b: HFTokenizer) -> None:
    assert a.vocab_size == b.vocab_size
    assert (a.bos_token_id, a.eos_token_ids, a.chat_template) == (b.bos_token_id, b.eos_token_ids, b.chat_template)
    for text in TEXTS:
        ids = a.encode(text)
        assert b.encode(text) == ids
        assert b.decode(ids) == a.decode(ids)
    for token_id in range(0, a.vocab_size, 97):
        assert b.token_bytes(token_id) == a.token_bytes(token_id)


def test_second_load_comes_from_the_cache(smollm2_path, tmp_path, monkeypatch):
    monkeypatch.setenv("PYAGENT_CACHE_DIR", str(tmp_path))
    first = HFTokenizer.from_pretrained(str(smollm2_path))
    key = gguf_tokenizer_key(read_header(smollm2_path).fields)
    assert _entries(tmp_path) == [key]
    assert (tmp_path / "gguf-tokenizers" / key / "tokenizer.json").is_file()

    # A second load must not convert again: any call that passes gguf_file fails.
    original = HFTokenizer._auto

    def no_conversion(location, shown, options):
        assert "gguf_file" not in options, "converted again instead of reading the cache"
        return original(location, shown, options)

    monkeypatch.setattr(HFTokenizer, "_auto", staticmethod(no_conversion))
    second = HFTokenizer.from_pretrained(str(smollm2_path))
    _same_tokenizer(first, second)


def test_damaged_entry_is_rebuilt(smollm2_path, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("PYAGENT_CACHE_DIR", str(tmp_path))
    key = gguf_tokenizer_key(read_header(smollm2_path).fields)
    entry = tmp_path / "gguf-tokenizers" / key
    entry.mkdir(parents=True)
    (entry / "tokenizer.json").write_text("{ not json")
    with caplog.at_level(logging.WARNING, logger=hf_tokenizer.__name__):
        tok = HFTokenizer.from_pretrained(str(smollm2_path))
    assert "ignoring the cached tokenizer" in caplog.text
    assert tok.encode("Hello, world!") == [19556, 28, 905, 17]


def test_cache_off_writes_nothing(smollm2_path, tmp_path, monkeypatch):
    monkeypatch.setenv("PYAGENT_CACHE_DIR", "off")
    assert cache_dir() is None
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    calls = []

    class Fake:
        def __len__(self):
            return 3

    monkeypatch.setattr(HFTokenizer, "_auto", staticmethod(lambda location, shown, options: calls.append(options) or Fake()))
    HFTokenizer.from_pretrained(str(smollm2_path))
    assert calls and calls[0]["gguf_file"] == smollm2_path.name
    assert not any(tmp_path.rglob("*"))


def test_unwritable_cache_is_skipped(smollm2_path, tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache directory would go")
    monkeypatch.setenv("PYAGENT_CACHE_DIR", str(blocker))

    class Fake:
        def __len__(self):
            return 3

        def save_pretrained(self, directory):
            raise AssertionError("must not be reached: the staging directory cannot be made")

    monkeypatch.setattr(HFTokenizer, "_auto", staticmethod(lambda location, shown, options: Fake()))
    HFTokenizer.from_pretrained(str(smollm2_path))  # no error


def test_key_follows_the_tokenizer_metadata():
    fields = {"general.architecture": "llama", "tokenizer.ggml.tokens": ["a", "b"], "general.name": "x"}
    key = gguf_tokenizer_key(fields)
    assert gguf_tokenizer_key({**fields, "general.name": "renamed"}) == key  # not tokenizer metadata
    assert gguf_tokenizer_key({**fields, "tokenizer.ggml.tokens": ["a", "c"]}) != key
    assert gguf_tokenizer_key({**fields, "general.architecture": "qwen2"}) != key
    assert len(key) == 64 and int(key, 16) >= 0
