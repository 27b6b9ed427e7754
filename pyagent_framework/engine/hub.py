"""Hugging Face Hub ids as models: ``org/name``, ``org/name@revision`` and, for a repo
of GGUF files, ``org/name:Q4_K_M`` (the file whose name carries that quantization, as
llama.cpp's ``-hf`` picks it) or ``--gguf-file NAME``.

The local cache comes first: a snapshot already there is used without asking the
network. ``HF_HUB_OFFLINE=1`` keeps it so; otherwise what the cache lacks is
downloaded (``huggingface_hub``'s progress bars show it). The cache is the one
``huggingface_hub`` uses (``HF_HUB_CACHE``, else ``HF_HOME``/hub, else
``~/.cache/huggingface/hub``), read when a model is resolved.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from pyagent_framework.engine.errors import ConfigError

# org/name, then @revision and/or :QUANT; names as the Hub allows them.
_HUB_ID = re.compile(r"(?P<repo>[\w.-]+/[\w.-]+)(?:@(?P<revision>[\w./-]+?))?(?::(?P<quant>[\w.-]+))?")
# The files a non-GGUF model needs (weights, config, tokenizer, chat template).
_MODEL_FILES = ["*.json", "*.safetensors", "tokenizer.model", "*.tiktoken", "*.jinja", "*.txt"]


def is_hub_id(name: str) -> bool:
    """Whether ``name`` reads as a Hub id (and is not a path that exists)."""
    return _HUB_ID.fullmatch(name) is not None and not Path(name).expanduser().exists()


def cache_dir() -> str:
    """The Hub cache directory, as ``huggingface_hub`` would choose it now."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return str(Path(home, "hub").expanduser())


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def resolve(name: str, gguf_file: str | None = None) -> str:
    """The local path of Hub model ``name``: its snapshot directory, or the GGUF file
    the quantization tag or ``gguf_file`` picks. A ``ConfigError`` naming the id, the
    cache and what to do when it cannot be had."""
    match = _HUB_ID.fullmatch(name)
    if match is None:
        raise ConfigError(f"model {name!r} is not a Hub id (org/name[@revision][:QUANT])", field="model")
    repo, revision, quant = match["repo"], match["revision"], match["quant"]
    try:
        import huggingface_hub
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:
        raise ConfigError(f"model {name!r}: a Hub id needs the huggingface_hub package (pip install huggingface_hub)", field="model") from None
    cache = cache_dir()
    where = f"{repo}" + (f"@{revision}" if revision else "")
    try:
        # The cache first: a snapshot that has the files is used as it is.
        snapshot = Path(huggingface_hub.snapshot_download(repo, revision=revision, cache_dir=cache, local_files_only=True))
    except LocalEntryNotFoundError:
        if offline():
            raise ConfigError(
                f"model {where!r} is not in the Hugging Face cache at {cache} and HF_HUB_OFFLINE is set: "
                f"download it where there is a network (huggingface-cli download {repo}), or name a local path",
                field="model",
            ) from None
        snapshot = None
    if snapshot is not None:
        ggufs = sorted(p.name for p in snapshot.glob("*.gguf"))
        if ggufs or quant or gguf_file:
            return str(snapshot / _pick_gguf(where, ggufs, quant, gguf_file))
        return str(snapshot)
    return _download(huggingface_hub, repo, revision, quant, gguf_file, cache, where)


def _pick_gguf(where: str, files: list[str], quant: str | None, gguf_file: str | None) -> str:
    """The GGUF file of ``files`` that ``gguf_file`` names or whose name carries ``quant``."""
    if gguf_file:
        if gguf_file in files:
            return gguf_file
        raise ConfigError(f"model {where!r} has no GGUF file {gguf_file!r} (it has: {', '.join(files) or 'none'})", field="gguf_file")
    if quant:
        tag = re.compile(rf"(?<![A-Za-z0-9]){re.escape(quant)}(?![A-Za-z0-9])", re.IGNORECASE)
        chosen = [f for f in files if tag.search(f.removesuffix(".gguf"))]
        if len(chosen) == 1:
            return chosen[0]
        found = "several: " + ", ".join(chosen) if chosen else "none"
        raise ConfigError(f"model {where!r}: GGUF files named for {quant!r}: {found} (all: {', '.join(files) or 'none'})", field="model")
    if len(files) == 1:
        return files[0]
    raise ConfigError(
        f"model {where!r} holds {len(files)} GGUF files ({', '.join(files)}): pick one with :QUANT "
        f"(e.g. {where}:Q4_K_M) or --gguf-file",
        field="model",
    )


def _download(hub, repo: str, revision: str | None, quant: str | None, gguf_file: str | None, cache: str, where: str) -> str:
    """Fetch what the cache lacks: the one GGUF file a GGUF repo's choice names, or the
    files a model directory needs."""
    try:
        files = hub.list_repo_files(repo, revision=revision)
        ggufs = sorted(f for f in files if f.endswith(".gguf") and "/" not in f)
        if ggufs or quant or gguf_file:
            chosen = _pick_gguf(where, ggufs, quant, gguf_file)
            return hub.hf_hub_download(repo, chosen, revision=revision, cache_dir=cache)
        return hub.snapshot_download(repo, revision=revision, cache_dir=cache, allow_patterns=_MODEL_FILES)
    except ConfigError:
        raise
    except Exception as exc:  # not found, gated, no network: the Hub's own words
        raise ConfigError(
            f"model {where!r} could not be had from the Hugging Face Hub ({type(exc).__name__}: {exc}); "
            f"the cache at {cache} has no copy of it. Check the id, log in for a gated model "
            f"(huggingface-cli login), or name a local path",
            field="model",
        ) from None
