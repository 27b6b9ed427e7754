"""Engine configuration: one attrs class, shared by ``LLM(**engine_args)`` and the
``pyagent generate|chat|serve`` flags (same names, dashes for underscores).

Values come from keyword arguments, CLI flags, a YAML/JSON file (``--config``) or
``PYAGENT_<FIELD>`` environment variables, structured by cattrs; errors name the field.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import attrs
import cattrs

from pyagent_framework.errors import ConfigError
from pyagent_framework.sizes import parse_size


def _one_of(attribute, value, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{attribute.name} must be one of {', '.join(choices)}, got {value!r}")


def _json_mapping(name: str, value: Any) -> dict[str, Any] | None:
    """A mapping given as a dict or as JSON text (flags, files, environment)."""
    if value is None or isinstance(value, dict):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name} must be a JSON object: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {type(value).__name__}")
    return value


def _lora_modules(value: Any) -> dict[str, str] | None:
    """``{name: path}`` from a mapping, a list of ``NAME=PATH`` strings, JSON text or
    one string of them separated by spaces or commas (an environment variable)."""
    if value is None or value == "" or value == []:
        return None
    if isinstance(value, str):
        text = value.strip()
        value = json.loads(text) if text.startswith(("{", "[")) else re.split(r"[\s,]+", text)
    if isinstance(value, dict):
        pairs = list(value.items())
    elif isinstance(value, (list, tuple)):
        pairs = []
        for item in value:
            if isinstance(item, dict) and "name" in item and "path" in item:
                pairs.append((item["name"], item["path"]))
                continue
            name, sep, path = str(item).partition("=")
            if not sep or not name or not path:
                raise ValueError(f"lora_modules: {item!r} is not NAME=PATH")
            pairs.append((name, path))
    else:
        raise ValueError(f"lora_modules must be NAME=PATH entries, got {type(value).__name__}")
    out: dict[str, str] = {}
    for name, path in pairs:
        if not isinstance(name, str) or not isinstance(path, str) or name in out:
            raise ValueError(f"lora_modules: adapter {name!r} is given twice or is not NAME=PATH")
        out[name] = path
    return out


def _non_negative(attribute, value) -> None:
    if value < 0:
        raise ValueError(f"{attribute.name} must be 0 or more, got {value}")


def _fraction(attribute, value) -> None:
    if not 0 < value <= 1:
        raise ValueError(f"{attribute.name} must be in (0, 1], got {value}")


def _positive(instance, attribute, value) -> None:
    if value is not None and value <= 0:
        raise ValueError(f"{attribute.name} must be positive, got {value}")


@attrs.define(kw_only=True)
class EngineConfig:
    """Everything the engine is built from. Registry choices are names."""

    model: str | None = attrs.field(default=None, metadata={"help": "model: 'smollm2' (default), an HF directory, a .gguf file or a Hugging Face Hub id org/name[@revision][:QUANT] (the local cache first)"})
    gguf_file: str | None = attrs.field(default=None, metadata={"help": "the GGUF file of a Hub repo of several (default: the one its :QUANT tag names)"})
    tokenizer: str | None = attrs.field(default=None, metadata={"help": "tokenizer registry name (e.g. hf, tiktoken) or a tokenizer path for 'hf' (default: the model's own)"})
    weight_format: str | None = attrs.field(default=None, metadata={"help": "weight format name (default: detected)"})
    attention_backend: str = attrs.field(default="auto", metadata={"help": "attention backend name; auto: 'native' when pyagent-native is installed, else 'torch'"})
    quantization: str | None = attrs.field(default=None, metadata={"help": "quantizer name (none, int8, int4, gguf, fp8, ...); default: 'gguf' for a GGUF file (its quantized tensors kept as stored), else 'native' (unquantized, native small-batch kernel) for float32 when pyagent-native is installed, else 'none'"})
    quantization_config: Any = attrs.field(default=None, converter=lambda v: _json_mapping("quantization_config", v), metadata={"help": "the quantizer's options as JSON, e.g. '{\"group_size\": 64}' for int4"})
    device: str = attrs.field(default="auto", metadata={"help": "where the model runs: auto (the first CUDA GPU when torch sees one, else cpu), cpu, cuda, cuda:N"})
    dtype: str = attrs.field(default="float32", metadata={"help": "compute dtype: float32, bfloat16, float16"})
    kv_cache_memory: str | None = attrs.field(default="auto", metadata={"help": "KV cache memory budget, e.g. 2GiB; auto (default): on a GPU what gpu_memory_utilization leaves after the weights and a profiling forward, on a CPU a quarter of the available RAM, at most 4GiB"})
    gpu_memory_utilization: float = attrs.field(default=0.9, validator=lambda _, a, v: _fraction(a, v), metadata={"help": "with kv_cache_memory auto on a GPU: the share of the device's memory this engine may use in all (weights, activations, KV cache)"})
    enforce_eager: bool = attrs.field(default=False, metadata={"help": "on a GPU, run every decode step eagerly: no CUDA graphs (by default pure-decode steps replay from a graph per batch-size bucket)"})
    kv_cache_dtype: str = attrs.field(default="auto", validator=lambda _, a, v: _one_of(a, v, ("auto", "int8", "fp8", "fp8_e4m3")), metadata={"help": "what the KV cache stores: auto (the model's dtype), int8 or fp8 (e4m3; fp8_e4m3 is the same): one byte per number plus a float16 scale per group of 32 numbers of a token and head, about 1/4 of float32's bytes and 1/2 of bfloat16's"})
    num_kv_blocks: int | None = attrs.field(default=None, validator=_positive, metadata={"help": "KV cache size in blocks (overrides --kv-cache-memory)"})
    block_size: int = attrs.field(default=16, validator=_positive, metadata={"help": "tokens per KV block"})
    max_num_seqs: int = attrs.field(default=64, validator=_positive, metadata={"help": "most sequences in one step"})
    max_num_batched_tokens: int = attrs.field(default=2048, validator=_positive, metadata={"help": "token budget of one step (chunked prefill)"})
    max_model_len: int | None = attrs.field(default=None, validator=_positive, metadata={"help": "context window (default: the model's)"})
    chat_template: str | None = attrs.field(default=None, metadata={"help": "chat template: a registry name (chatml, llama3, mistral, qwen, ...) or a .jinja file (default: the tokenizer's)"})
    enable_prefix_caching: bool = attrs.field(default=True, metadata={"help": "reuse the KV blocks of prompt prefixes seen before (on by default)"})
    eviction_policy: str = attrs.field(default="lru", metadata={"help": "which cached KV block to evict first (registry name, e.g. lru)"})
    prefix_cache_hash: str = attrs.field(default="sha256", validator=lambda _, a, v: _one_of(a, v, ("sha256", "xxh3_128")), metadata={"help": "prefix-cache block hash: sha256 (default) or xxh3_128 (faster, needs xxhash)"})
    grammar_backend: str = attrs.field(default="auto", metadata={"help": "structured-output grammar backend: a registry name, or auto (xgrammar, then outlines, then others; the next on an unsupported feature)"})
    grammar_cache_memory: str = attrs.field(default="256MiB", metadata={"help": "memory bound of the compiled-grammar cache (least recently used out), e.g. 64MiB"})
    grammar_compile_timeout: float = attrs.field(default=10.0, validator=_positive, metadata={"help": "seconds a grammar may take to compile before its requests fail"})
    grammar_token_timeout: float = attrs.field(default=0.25, validator=_positive, metadata={"help": "seconds a request's grammar may spend matching one output token (masking and advancing) before the request fails"})
    kv_connector: str | None = attrs.field(default=None, metadata={"help": "KV connector (registry name, e.g. disk, redis): save computed KV blocks to a store and load them on a later prefix hit, in this or another engine"})
    kv_connector_config: Any = attrs.field(default=None, converter=lambda v: _json_mapping("kv_connector_config", v), metadata={"help": "the connector's options as JSON, e.g. '{\"path\": \"/tmp/kv\"}'; the engine itself reads failure_threshold, backoff_seconds, max_pending_saves and model_identity"})
    kv_role: str = attrs.field(default="both", validator=lambda _, a, v: _one_of(a, v, ("producer", "consumer", "both")), metadata={"help": "what this engine does with the KV connector: producer (saves), consumer (loads) or both"})
    speculative_method: str | None = attrs.field(default=None, metadata={"help": "speculative decoding: a proposer name (ngram, suffix, ...); drafts are verified exactly"})
    num_speculative_tokens: int = attrs.field(default=5, validator=_positive, metadata={"help": "most draft tokens per sequence and step"})
    speculative_model: str | None = attrs.field(default=None, metadata={"help": "the draft model for speculative_method draft_model (the default method when this is set)"})
    speculative_config: Any = attrs.field(default=None, converter=lambda v: _json_mapping("speculative_config", v), metadata={"help": "the proposer's options as JSON, e.g. '{\"n_max\": 4}'"})
    seed: int = attrs.field(default=0, metadata={"help": "seed for unseeded sampling"})
    num_threads: int | None = attrs.field(default=None, validator=_positive, metadata={"help": "torch CPU threads (per rank; default with tensor parallelism: the cores shared among the ranks)"})
    tensor_parallel_size: int = attrs.field(default=1, validator=_positive, metadata={"help": "ranks the model is split across (tensor parallelism): worker processes or Ray actors joined by torch.distributed (gloo); CPU only for now"})
    distributed_executor_backend: str = attrs.field(default="mp", validator=lambda _, a, v: _one_of(a, v, ("mp", "ray")), metadata={"help": "where tensor-parallel workers run: mp (local processes, default) or ray (Ray actors in a placement group; pip install 'pyagent-framework[ray]')"})
    data_parallel_size: int = attrs.field(default=1, validator=_positive, metadata={"help": "engine cores (replicas, each with the whole model or its tensor-parallel ranks) behind this front end; each request goes to the replica with the fewest outstanding tokens, or back to the one that cached its prefix"})
    data_parallel_backend: str = attrs.field(default="mp", validator=lambda _, a, v: _one_of(a, v, ("mp", "ray")), metadata={"help": "where data-parallel replicas run: mp (local processes, default) or ray (Ray actors, one placement group each; pip install 'pyagent-framework[ray]')"})
    data_parallel_routing: str = attrs.field(default="cache_aware", validator=lambda _, a, v: _one_of(a, v, ("cache_aware", "least_loaded", "round_robin")), metadata={"help": "how requests are spread over data-parallel replicas: cache_aware (the fewest outstanding tokens, or back to the replica that holds the prompt's prefix while its load is near the least; default), least_loaded or round_robin"})
    data_parallel_max_restarts: int = attrs.field(default=3, validator=lambda _, a, v: _non_negative(a, v), metadata={"help": "how many times a data-parallel replica that died is started again (0: never); the others serve meanwhile"})
    ray_address: str | None = attrs.field(default=None, metadata={"help": "the Ray cluster to join: auto (the one running on this machine) or HOST:PORT; default: RAY_ADDRESS, else a Ray instance started for this engine"})
    ray_placement_timeout: float = attrs.field(default=60.0, validator=_positive, metadata={"help": "seconds to wait for the Ray cluster to reserve a replica's or a worker's CPUs before giving up with what is missing"})
    scheduling_policy: str = attrs.field(default="fcfs", validator=lambda _, a, v: _one_of(a, v, ("fcfs", "priority", "fair")), metadata={"help": "fcfs: waiting requests by priority, then arrival (default); priority: also, a request of higher priority (lower number) takes the place of a running one of lower priority when it could not join otherwise (the running one is recomputed later); fair: waiting requests join by tenant (the OpenAI user field), the least-served tenant first, and no tenant takes more than an even split of a step's budget"})
    pooling: str | None = attrs.field(default=None, validator=lambda _, a, v: v is None or _one_of(a, v, ("cls", "mean", "max", "last")), metadata={"help": "how an embedding model pools its token states: cls, mean, max or last (default: as the model's sentence-transformers files say, else cls)"})
    normalize: bool | None = attrs.field(default=None, metadata={"help": "whether an embedding model's vectors are scaled to unit length (default: as the model's files say, else yes); a request's own normalize wins"})
    enable_lora: bool = attrs.field(default=False, metadata={"help": "serve LoRA adapters (PEFT directories) beside the base model: --lora-modules at start, or loaded later"})
    lora_modules: Any = attrs.field(default=None, converter=lambda v: _lora_modules(v), metadata={"nargs": "+", "help": "LoRA adapters to load at start, as NAME=PATH (several: space-separated); a request picks one by its model name"})
    max_loras: int = attrs.field(default=4, validator=_positive, metadata={"help": "LoRA adapters that can serve in one batch (the model's adapter slots); requests of further adapters wait for a slot"})
    max_lora_rank: int = attrs.field(default=16, validator=_positive, metadata={"help": "the largest LoRA rank an adapter may have (the slots' size)"})
    engine_process: bool = attrs.field(default=True, metadata={"help": "run the engine core (scheduler, KV cache, model) in a process of its own (default); --no-engine-process runs it in this process"})

    def rank_threads(self, cores: int) -> int:
        """Torch threads per rank: ``num_threads`` as set, or ``cores`` shared among
        every rank of every data-parallel replica."""
        return self.num_threads or max(1, cores // (self.data_parallel_size * self.tensor_parallel_size))

    def grammar_cache_bytes(self) -> int:
        try:
            return parse_size(self.grammar_cache_memory)
        except ValueError as exc:
            raise ConfigError(f"grammar_cache_memory: {exc}", field="grammar_cache_memory") from None

    def kv_cache_bytes(self) -> int | None:
        """The fixed budget, or None for ``auto`` (sized from the device: see
        :mod:`pyagent_framework.engine.kv_sizing`)."""
        if self.kv_cache_memory is None or str(self.kv_cache_memory).strip().lower() == "auto":
            return None
        try:
            return parse_size(self.kv_cache_memory)
        except ValueError as exc:
            raise ConfigError(f"kv_cache_memory: {exc}", field="kv_cache_memory") from None


_converter = cattrs.Converter(forbid_extra_keys=True)
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _structure_bool(value: Any, _type: Any) -> bool:
    """Booleans from flags, files and environment variables: a string must say so."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError(f"not a boolean: {value!r} (use true/false, 1/0, yes/no, on/off)")


_converter.register_structure_hook(bool, _structure_bool)


def field_names(cls: type = EngineConfig) -> list[str]:
    return [f.name for f in attrs.fields(cls)]


def make_config(values: dict[str, Any] | None = None, *, config_file: str | None = None, env: bool = True) -> EngineConfig:
    """Build an engine config from (lowest to highest priority) environment variables,
    a YAML/JSON file and explicit values. Errors name the field."""
    return build_config(EngineConfig, values, config_file=config_file, env=env)


def build_config(
    cls: type,
    values: dict[str, Any] | None = None,
    *,
    config_file: str | None = None,
    env: bool = True,
    shared_with: tuple[type, ...] = (),
) -> Any:
    """Structure the attrs class ``cls`` from ``PYAGENT_<FIELD>`` environment
    variables, then a YAML/JSON file, then explicit values (highest priority).

    A file may also hold the options of the classes in ``shared_with`` (one file
    configures both the engine and the server); any other key is an error that
    suggests the nearest option name.
    """
    names = field_names(cls)
    merged: dict[str, Any] = {}
    if env:
        for name in names:
            raw = os.environ.get(f"PYAGENT_{name.upper()}")
            if raw is not None:
                merged[name] = raw
    if config_file:
        others = {name for other in shared_with for name in field_names(other)}
        from_file = _read_config_file(config_file)
        _check_known(set(from_file) - others, names, suggest=[*names, *sorted(others)])
        merged.update({k: v for k, v in from_file.items() if k in names})
    merged.update({k: v for k, v in (values or {}).items() if v is not None})
    _check_known(set(merged), names)
    try:
        return _converter.structure(merged, cls)
    except Exception as exc:  # cattrs ClassValidationError / attrs validators
        raise ConfigError(_describe(exc, names), field=_first_field(exc, names)) from None


def _check_known(keys: set[str], names: list[str], suggest: list[str] | None = None) -> None:
    unknown = sorted(keys - set(names))
    if not unknown:
        return
    import difflib

    hints = []
    for key in unknown:
        close = difflib.get_close_matches(key, suggest or names, n=1)
        hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    raise ConfigError(f"unknown option(s): {', '.join(hints)}", field=unknown[0])


def _read_config_file(path: str) -> dict[str, Any]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}", field="config") from None
    try:
        if path.endswith((".yaml", ".yml")):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as exc:  # json.JSONDecodeError, yaml.YAMLError
        raise ConfigError(f"config file {path} does not parse: {exc}", field="config") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of option names to values", field="config")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def _leaf_errors(exc: BaseException, names: list[str]) -> list[tuple[str | None, BaseException]]:
    if isinstance(exc, BaseExceptionGroup):
        out = []
        for sub in exc.exceptions:
            out.extend(_leaf_errors(sub, names))
        return out
    field = None
    for note in getattr(exc, "__notes__", []) or []:
        match = re.search(r"attribute '?(\w+)'?|field '?(\w+)'?", str(note))
        if match:
            field = match.group(1) or match.group(2)
    if field is None:  # our validators start their message with the field's name
        match = re.match(r"(\w+) must\b", str(exc))
        if match and match.group(1) in names:
            field = match.group(1)
    return [(field, exc)]


def _describe(exc: BaseException, names: list[str]) -> str:
    parts = []
    for field, leaf in _leaf_errors(exc, names):
        parts.append(f"{field}: {leaf}" if field and field not in str(leaf) else str(leaf))
    return "invalid option: " + "; ".join(parts)


def _first_field(exc: BaseException, names: list[str]) -> str | None:
    for field, _ in _leaf_errors(exc, names):
        if field:
            return field
    return None
