"""Building the engine's parts from its configuration; each failure is a ConfigError
that names the field. Checked in an order that fails fast: names before weights."""

from __future__ import annotations

import hashlib
import json
import logging
import math
from pathlib import Path
from typing import Any

import torch

from pyagent_framework import kv_cache_format as kv_format
from pyagent_framework import registries
from pyagent_framework.engine import kv_sizing, loader
from pyagent_framework.engine.config import EngineConfig
from pyagent_framework.engine.errors import ConfigError, InvalidRequestError
from pyagent_framework.engine.faults import describe_failure, is_builtin
from pyagent_framework.engine.kv_transfer import KVTransfer
from pyagent_framework.engine.speculative import SpeculativeDecoder

# kv_connector_config keys the engine reads itself (the rest go to the connector).
KV_TRANSFER_OPTIONS = ("failure_threshold", "backoff_seconds", "max_pending_saves", "model_identity")

logger = logging.getLogger("pyagent_framework.engine")


def load_tokenizer(config: EngineConfig, model_path: str) -> tuple[Any, str]:
    """The tokenizer and its registry name (errors that name it use the name)."""
    name, path = "hf", model_path
    if config.tokenizer:
        if config.tokenizer in registries.tokenizers:
            name = config.tokenizer
        else:
            name, path = "hf", config.tokenizer
    cls = loader.load_entry(registries.tokenizers, name, "tokenizer")
    try:
        return cls.from_pretrained(path), name
    except (OSError, ValueError) as exc:
        raise ConfigError(f"tokenizer: cannot load {name!r} from {path}: {exc}", field="tokenizer") from exc


def max_model_len(config: EngineConfig, model_config: dict) -> int:
    native = model_config.get("max_position_embeddings")
    if config.max_model_len is None:
        if not native:
            raise ConfigError("the model config has no max_position_embeddings; set max_model_len", field="max_model_len")
        return int(native)
    return config.max_model_len


def chat_template(config: EngineConfig, tokenizer: Any) -> str | None:
    name = config.chat_template
    if not name:
        return tokenizer.chat_template
    if name not in registries.chat_templates and name.endswith(".jinja") and Path(name).is_file():
        return Path(name).read_text(encoding="utf-8")
    return loader.load_entry(registries.chat_templates, name, "chat_template").source


def check_grammar_backend(name: str) -> str:
    """``auto`` (try each installed backend in turn) or a registered name."""
    if name != "auto":
        loader.load_entry(registries.grammar_backends, name, "grammar_backend")
    return name


def kv_connector_class(config: EngineConfig):
    """The connector's class, checked before the weights load."""
    if config.kv_connector is None:
        if config.kv_connector_config:
            raise ConfigError("kv_connector_config is set but no kv_connector is", field="kv_connector_config")
        return None
    if not config.enable_prefix_caching:
        raise ConfigError(
            "kv_connector: a KV connector finds blocks by their prefix-cache hashes; enable prefix caching",
            field="kv_connector",
        )
    return loader.load_entry(registries.kv_connectors, config.kv_connector, "kv_connector")


def eviction_policy(config: EngineConfig, policy_cls: Any, num_blocks: int) -> tuple[Any, str]:
    """The prefix cache's policy, ``policy_cls(num_blocks)``, and the name it runs
    under. A plugin's policy that fails to build is an engine-wide fault: logged by
    name, and the built-in ``lru`` serves instead, as when it fails later on."""
    name = config.eviction_policy
    try:
        return policy_cls(num_blocks), name
    except Exception as exc:
        if is_builtin("eviction_policy", name):
            raise
        logger.error("%s; prefix caching runs with the built-in 'lru'",
                     describe_failure("eviction_policy", name, "__init__", exc))
        return registries.eviction_policies.load("lru")(num_blocks), "lru"


def make_lora(config: EngineConfig, model: torch.nn.Module, device: Any, ops: Any):
    """The LoRA slots of ``model`` and the adapters of ``lora_modules`` (None: LoRA
    off); ``ops`` (the attention backend's layer ops) computes the adapters' part."""
    if not (config.enable_lora or config.lora_modules):
        return None
    if config.tensor_parallel_size > 1:
        raise ConfigError("LoRA adapters are not served with tensor parallelism yet: use tensor_parallel_size 1 "
                          "(data parallelism serves them)", field="enable_lora")
    from pyagent_framework.engine.lora import LoRAManager

    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    manager = LoRAManager(model, max_loras=config.max_loras, max_lora_rank=config.max_lora_rank, dtype=dtype, device=device,
                          ops=ops)
    for name, path in (config.lora_modules or {}).items():
        try:
            manager.add(name, path)
        except InvalidRequestError as exc:
            raise ConfigError(str(exc), field="lora_modules") from None
    return manager


def make_speculator(config: EngineConfig) -> SpeculativeDecoder | None:
    """The proposer named by ``speculative_method``, built from ``speculative_config``."""
    method = config.speculative_method
    if method is None and config.speculative_model is not None:
        method = "draft_model"
    if method is None:
        if config.speculative_config:
            raise ConfigError("speculative_config is set but no speculative_method is", field="speculative_config")
        return None
    cls = loader.load_entry(registries.proposers, method, "speculative_method")
    options = dict(config.speculative_config or {})
    if config.speculative_model is not None:
        options.setdefault("model", config.speculative_model)
    try:
        proposer = cls(options)
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"speculative_config: proposer {method!r} rejects {options}: {exc}",
            field="speculative_config",
        ) from None
    try:
        return SpeculativeDecoder(proposer, config.num_speculative_tokens, seed=config.seed, name=method)
    except ValueError as exc:
        raise ConfigError(str(exc), field="num_speculative_tokens") from None


def model_identity(config: EngineConfig, model_path: str, model_config: dict, quantization: str | None) -> bytes:
    """32 bytes naming the weights as this engine computes with them (dtype and
    quantization included; ``loader.model_identity``), or the digest of the
    ``model_identity`` a user names in ``kv_connector_config``. The attention
    backend is left out: backends agree to float rounding."""
    named = (config.kv_connector_config or {}).get("model_identity")
    if named is not None:
        return hashlib.sha256(b"pyagent-framework named model\0" + str(named).encode()).digest()
    options = json.dumps(config.quantization_config or {}, sort_keys=True, default=str)
    variant = f"dtype={config.dtype} quantization={quantization} options={options}"
    if config.kv_cache_dtype != "auto":  # blocks of codes are not blocks of floats
        variant += f" kv_cache_dtype={kv_format.cache_dtype(config.kv_cache_dtype, torch.float32)}"
    return loader.model_identity(model_path, model_config, variant)


def make_kv_transfer(config: EngineConfig, connector_cls, kv_cache: torch.Tensor, identity: bytes | None) -> KVTransfer | None:
    """The connector built from ``kv_connector_config`` (less the keys the engine
    reads itself) inside a :class:`KVTransfer`; a rejected option is a ConfigError."""
    if connector_cls is None:
        return None
    if kv_cache.numel() == 0:
        raise ConfigError("kv_connector: this model keeps no keys or values (it has no attention layers), so there are "
                          "no blocks for a connector to move; drop kv_connector", field="kv_connector")
    options = dict(config.kv_connector_config or {})
    engine_options = {key: options.pop(key) for key in KV_TRANSFER_OPTIONS if key in options}
    engine_options.pop("model_identity", None)  # read by model_identity
    try:
        connector = connector_cls(options)
    except (TypeError, ValueError, OSError) as exc:
        raise ConfigError(
            f"kv_connector_config: connector {config.kv_connector!r} rejects {options}: {exc}",
            field="kv_connector_config",
        ) from None
    try:
        return KVTransfer(connector, kv_cache, model_identity=identity, role=config.kv_role, name=config.kv_connector,
                          **engine_options)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"kv_connector_config: {exc}", field="kv_connector_config") from None


def check_tensor_parallel(config: EngineConfig, device: Any) -> None:
    """What tensor parallelism does not run with yet, refused before any weight loads."""
    size = config.tensor_parallel_size
    if torch.device(device).type != "cpu":
        raise ConfigError(
            f"tensor_parallel_size {size} runs on the CPU only for now (device {device}); use device cpu or "
            "tensor_parallel_size 1",
            field="tensor_parallel_size",
        )
    if config.kv_connector is not None:
        raise ConfigError(
            f"kv_connector {config.kv_connector!r} moves rank 0's KV blocks only; it does not run with "
            f"tensor_parallel_size {size} yet",
            field="kv_connector",
        )
    if config.distributed_executor_backend == "ray":
        from pyagent_framework.engine.ray_executor import import_ray

        import_ray("distributed_executor_backend")


def kv_cache_dtype(config: EngineConfig, backend_cls: Any, backend_name: str) -> torch.dtype:
    """The dtype the KV cache stores (``kv_cache_dtype``), refused when the attention
    backend does not declare that it reads it (its ``kv_cache_dtypes``)."""
    model_dtype = loader.torch_dtype(config.dtype)
    dtype = kv_format.cache_dtype(config.kv_cache_dtype, model_dtype)
    if kv_format.is_quantized(dtype):
        name = "fp8" if dtype == torch.float8_e4m3fn else "int8"
        supported = tuple(getattr(backend_cls, "kv_cache_dtypes", ()) or ())
        if name not in supported:
            raise ConfigError(
                f"kv_cache_dtype {config.kv_cache_dtype!r}: attention backend {backend_name!r} does not read a "
                f"{name} KV cache (it reads: {', '.join(supported) or 'the model dtype only'}); use kv_cache_dtype "
                "auto or another attention backend",
                field="kv_cache_dtype",
            )
    return dtype


def allocate_kv_cache(config: EngineConfig, model: Any, context_len: int, device: Any, *,
                      dtype: torch.dtype | None = None, profile: Any = None) -> tuple[torch.Tensor, int]:
    """The zero-filled KV cache of every layer and its number of blocks: ``num_kv_blocks``,
    else ``kv_cache_memory`` (``auto``: from the device, ``profile`` giving a GPU's
    activation peak; see :mod:`~pyagent_framework.engine.kv_sizing`)."""
    dtype = dtype if dtype is not None else kv_format.cache_dtype(config.kv_cache_dtype, loader.torch_dtype(config.dtype))
    layers, two, _, block_size, kv_heads, head_dim = model.kv_cache_shape(1, config.block_size)
    row = kv_format.row_width(head_dim, dtype)
    shape = lambda blocks: (layers, two, blocks, block_size, kv_heads, row)  # noqa: E731
    bytes_per_block = math.prod(shape(1)) * torch.empty((), dtype=dtype).element_size()
    how = None
    if config.num_kv_blocks is not None:
        num_blocks = config.num_kv_blocks
    elif bytes_per_block == 0:  # a model without attention layers: blocks only count tokens
        num_blocks = config.max_num_seqs * -(-context_len // config.block_size)
        how = "the model keeps no keys or values: enough blocks for max_num_seqs sequences"
    else:
        budget = config.kv_cache_bytes()
        if budget is None:
            budget, how = kv_sizing.auto_budget(device, gpu_memory_utilization=config.gpu_memory_utilization,
                                                profile=profile)
        num_blocks = budget // bytes_per_block
    capacity = num_blocks * config.block_size
    if capacity < context_len:
        raise ConfigError(
            f"the KV cache holds {capacity} tokens ({num_blocks} blocks of {config.block_size}), fewer than "
            f"max_model_len={context_len}: raise kv_cache_memory/num_kv_blocks"
            f"{' (auto: ' + how + ')' if how else ''} or lower max_model_len",
            field="kv_cache_memory",
        )
    cache = kv_sizing.allocate_zeros(shape(num_blocks), dtype, device)
    logger.info("KV cache: %d blocks of %d tokens = %d tokens, %s, %.1f MiB%s", num_blocks, config.block_size, capacity,
                config.kv_cache_dtype if config.kv_cache_dtype != "auto" else str(dtype).removeprefix("torch."),
                cache.nbytes / 2**20, f" (auto: {how})" if how else "")
    return cache, num_blocks
