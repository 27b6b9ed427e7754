"""The ``hf`` tokenizer: transformers' ``AutoTokenizer`` behind the kernel's interface.

``HFTokenizer.from_pretrained(path)`` takes an HF model directory or a ``.gguf`` file
(transformers converts the tokenizer embedded in the GGUF). Nothing is downloaded:
transformers is always called with ``local_files_only=True``.

Converting a GGUF's tokenizer takes transformers several seconds, so the result is
saved (``tokenizer.json`` and friends, no pickles) under the cache directory, keyed by
a sha256 of the GGUF's tokenizer metadata and the transformers version, and loaded from
there next time. ``PYAGENT_CACHE_DIR`` sets the directory (default
``$XDG_CACHE_HOME/pyagent`` or ``~/.cache/pyagent``); ``PYAGENT_CACHE_DIR=off`` turns
the cache off. A cache that cannot be written or read is skipped, never an error.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pyagent_framework.interfaces import Tokenizer

logger = logging.getLogger(__name__)

# Files of which at least one makes a directory a tokenizer directory.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")
_SP_SPACE = "\u2581"  # "▁", SentencePiece's word-boundary marker


@functools.lru_cache(maxsize=1)
def byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's ``bytes_to_unicode``: the printable character standing for each byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _components(node: Any) -> list[dict]:
    """A tokenizer.json component (decoder, pre_tokenizer, normalizer) flattened."""
    if not isinstance(node, dict):
        return []
    out = [node]
    for key in ("decoders", "pretokenizers", "normalizers"):
        for child in node.get(key) or ():
            out.extend(_components(child))
    return out


def _scheme(backend_json: dict) -> str:
    """How token strings map to bytes: "byte_level", "sentencepiece" or "unknown"."""
    parts = (
        _components(backend_json.get("decoder"))
        + _components(backend_json.get("pre_tokenizer"))
        + _components(backend_json.get("normalizer"))
    )
    types = {p.get("type") for p in parts}
    if "ByteLevel" in types:
        return "byte_level"
    model = backend_json.get("model") or {}
    replaces_space = any(
        p.get("type") == "Replace" and _SP_SPACE in json.dumps(p, ensure_ascii=False) for p in parts
    )
    if types & {"Metaspace", "ByteFallback"} or model.get("byte_fallback") or replaces_space:
        return "sentencepiece"
    return "unknown"


def _sp_piece_bytes(piece: str) -> bytes:
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            pass
    return piece.replace(_SP_SPACE, " ").encode("utf-8")


class HFTokenizer(Tokenizer):
    """A Hugging Face tokenizer (``transformers.AutoTokenizer``)."""

    def __init__(
        self,
        hf_tokenizer: Any,
        *,
        extra_eos_ids: Sequence[int] = (),
        bos_token_id: int | None = None,
        chat_template: str | None = None,
        source: str = "",
    ) -> None:
        self.hf_tokenizer = hf_tokenizer
        self.source = source
        self._extra_eos = tuple(int(i) for i in extra_eos_ids)
        self._bos_override = bos_token_id
        self._chat_template_fallback = chat_template
        self._vocab_size = len(hf_tokenizer)
        self._table: list[bytes] | None = None

    # -- construction ----------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: str, **options) -> "HFTokenizer":
        p = Path(path)
        if not p.exists():
            raise ValueError(f"no tokenizer at {str(path)!r}: the path does not exist")
        options["local_files_only"] = True
        if p.is_file():
            from pyagent_hf._gguf import is_gguf

            if is_gguf(p):
                return cls._from_gguf(p, str(path), options)
            p = p.parent  # a file of a checkpoint directory (model.safetensors): its directory
        if not any((p / name).is_file() for name in TOKENIZER_FILES):
            raise ValueError(
                f"no tokenizer at {str(path)!r}: neither a .gguf file nor a directory holding "
                f"any of {', '.join(TOKENIZER_FILES)}"
            )
        hf = cls._auto(str(p), str(path), options)
        extra: list[int] = []
        gen_config = p / "generation_config.json"
        if gen_config.is_file():
            try:
                eos = json.loads(gen_config.read_text(encoding="utf-8")).get("eos_token_id")
            except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as exc:
                raise ValueError(f"cannot read {str(gen_config)!r}: {exc}") from None
            extra.extend(_ids(eos))
        return cls(hf, extra_eos_ids=extra, source=str(path))

    @classmethod
    def _from_gguf(cls, p: Path, shown: str, options: dict) -> "HFTokenizer":
        from pyagent_hf._gguf import read_header

        fields = read_header(p).fields
        if "tokenizer.ggml.tokens" not in fields:
            raise ValueError(f"no tokenizer at {shown!r}: the GGUF file embeds none")
        hf = _load_gguf_tokenizer(p, fields, shown, options)
        extra = [
            int(fields[key])
            for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
            if key in fields
        ]
        bos = fields.get("tokenizer.ggml.bos_token_id")
        return cls(
            hf,
            extra_eos_ids=extra,
            bos_token_id=None if bos is None else int(bos),
            chat_template=fields.get("tokenizer.chat_template"),
            source=shown,
        )

    @staticmethod
    def _auto(location: str, shown: str, options: dict) -> Any:
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(location, **options)
        except (OSError, ValueError, KeyError, TypeError, ImportError) as exc:
            raise ValueError(f"cannot load a tokenizer from {shown!r}: {exc}") from exc

    # -- properties ------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def bos_token_id(self) -> int | None:
        if self._bos_override is not None:
            return self._bos_override
        return self.hf_tokenizer.bos_token_id

    @property
    def eos_token_ids(self) -> frozenset[int]:
        ids = set(self._extra_eos)
        if self.hf_tokenizer.eos_token_id is not None:
            ids.add(int(self.hf_tokenizer.eos_token_id))
        return frozenset(ids)

    @property
    def special_token_ids(self) -> frozenset[int]:
        """The tokenizer's special tokens plus its added tokens marked special."""
        hf = self.hf_tokenizer
        ids = {int(i) for i in getattr(hf, "all_special_ids", ())}
        ids.update(int(i) for i, t in getattr(hf, "added_tokens_decoder", {}).items() if getattr(t, "special", False))
        if self.bos_token_id is not None:
            ids.add(int(self.bos_token_id))
        return frozenset(ids | self.eos_token_ids)

    @property
    def bos_token(self) -> str | None:
        return self.hf_tokenizer.bos_token

    @property
    def eos_token(self) -> str | None:
        return self.hf_tokenizer.eos_token

    @property
    def chat_template(self) -> str | None:
        template = getattr(self.hf_tokenizer, "chat_template", None)
        if isinstance(template, dict):  # named templates: the default one
            template = template.get("default") or next(iter(template.values()), None)
        return template or self._chat_template_fallback or None

    # -- text <-> ids ----------------------------------------------------------------------

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf_tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def encode_pair(self, first: str, second: str, *, max_length: int | None = None) -> tuple[list[int], list[int]]:
        """As the tokenizer pairs texts for a cross-encoder (``tokenizer(first, second)``),
        ``longest_first`` truncation to ``max_length``."""
        cut = {"truncation": "longest_first", "max_length": max_length} if max_length is not None else {}
        encoded = self.hf_tokenizer(first, second, return_token_type_ids=True, **cut)
        ids = list(encoded["input_ids"])
        types = encoded.get("token_type_ids")
        return ids, list(types) if types is not None else [0] * len(ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """As transformers decodes: ids the vocabulary lacks are dropped."""
        return self.hf_tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        token_id = int(token_id)
        if not 0 <= token_id < self._vocab_size:
            raise ValueError(f"token id {token_id} is outside the vocabulary (size {self._vocab_size})")
        if self._table is None:
            self._table = self._build_table()
        return self._table[token_id]

    def _build_table(self) -> list[bytes]:
        hf = self.hf_tokenizer
        n = self._vocab_size
        backend = getattr(hf, "backend_tokenizer", None)
        scheme = _scheme(json.loads(backend.to_str())) if backend is not None else "unknown"
        pieces = hf.convert_ids_to_tokens(list(range(n)))
        added = {int(i): t.content for i, t in getattr(hf, "added_tokens_decoder", {}).items()}
        decoder = byte_decoder()
        table: list[bytes] = []
        for i, piece in enumerate(pieces):
            if i in added:
                table.append(added[i].encode("utf-8"))
            elif piece is None:
                table.append(b"")  # a hole in the vocabulary
            elif scheme == "byte_level":
                try:
                    table.append(bytes(decoder[c] for c in piece))
                except KeyError:
                    table.append(piece.encode("utf-8"))
            elif scheme == "sentencepiece":
                table.append(_sp_piece_bytes(piece))
            else:
                table.append(hf.decode([i], skip_special_tokens=False).encode("utf-8"))
        return table

    def __repr__(self) -> str:
        return f"HFTokenizer({self.source!r}, vocab_size={self._vocab_size})"


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


# --------------------------------------------------------------------------- GGUF cache


def cache_dir() -> Path | None:
    """Where converted tokenizers are kept (``None``: caching is off)."""
    configured = os.environ.get("PYAGENT_CACHE_DIR")
    if configured is not None:
        return None if configured.strip().lower() in ("", "0", "off", "none") else Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pyagent"


def gguf_tokenizer_key(fields: dict) -> str:
    """sha256 of what the conversion depends on: the GGUF's tokenizer metadata, its
    architecture and the transformers version doing the conversion."""
    import transformers

    relevant = {k: v for k, v in fields.items() if k.startswith("tokenizer.") or k == "general.architecture"}
    digest = hashlib.sha256()
    digest.update(f"transformers {transformers.__version__}\n".encode())
    digest.update(json.dumps(relevant, sort_keys=True, ensure_ascii=False, default=str).encode("utf-8"))
    return digest.hexdigest()


def _load_gguf_tokenizer(p: Path, fields: dict, shown: str, options: dict) -> Any:
    root = cache_dir()
    cached = None if root is None else root / "gguf-tokenizers" / gguf_tokenizer_key(fields)
    if cached is not None and (cached / "tokenizer.json").is_file():
        try:
            return HFTokenizer._auto(str(cached), shown, options)
        except ValueError as exc:
            logger.warning("ignoring the cached tokenizer at %s: %s", cached, exc)
    hf = HFTokenizer._auto(str(p.parent), shown, {**options, "gguf_file": p.name})
    if cached is not None:
        _store(hf, cached)
    return hf


def _store(hf: Any, target: Path) -> None:
    """Save into a fresh directory beside ``target``, then rename it into place, so a
    reader never sees half a cache entry (best effort: failures are logged)."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=target.parent))
        try:
            hf.save_pretrained(str(staging))
            os.replace(staging, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    except OSError as exc:
        logger.info("not caching the converted tokenizer at %s: %s", target, exc)
