"""The engine core of an encoder (an :class:`~pyagent_framework.interfaces.EncoderArchitecture`):
embeddings, one pooled vector per prompt, and nothing generated.

It speaks the same messages as :class:`~pyagent_framework.engine.core.EngineCore`
and runs in the same places (this process, a process of its own, a data-parallel
replica). Its sequences go through the same :class:`~.scheduler.Scheduler`, with
``whole_prompts`` (an encoder's sequence attends to all of itself, so a prompt is
never split) and a block pool that holds nothing (there is no KV cache): each step
batches as many waiting prompts as ``max_num_batched_tokens`` and ``max_num_seqs``
allow, runs the encoder once over them, pools each prompt's states (as the model's
files say: :mod:`.pooling`) and finishes them. Normalizing and cutting to fewer
dimensions are the front end's, per request.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch

from pyagent_framework import registries
from pyagent_framework.engine import entries, loader, setup
from pyagent_framework.engine.config import EngineConfig
from pyagent_framework.engine.core import StepTimes
from pyagent_framework.engine.errors import EMBEDDING_MODEL_NO_TEXT, ConfigError, InvalidRequestError
from pyagent_framework.engine.faults import ModelForwardError
from pyagent_framework.engine.pooling import PoolingConfig, pool
from pyagent_framework.engine.profiling import Profiler
from pyagent_framework.engine.scheduler import Scheduler
from pyagent_framework.engine.sequence import Sequence
from pyagent_framework.engine.scoring import activate, score_activation
from pyagent_framework.interfaces import CrossEncoderArchitecture, EncoderArchitecture
from pyagent_framework.messages import AddRequest, CoreError, CoreInfo, CoreOutput, CoreOutputs, ErrorCode, TensorBuffer

logger = logging.getLogger("pyagent_framework.engine")


def is_encoder(model_config: dict) -> bool:
    """Whether the config's architecture is a registered encoder."""
    for name in model_config.get("architectures") or []:
        if name in registries.model_architectures:
            return issubclass(loader.load_entry(registries.model_architectures, name, "model"), EncoderArchitecture)
    return False


class NullPool:
    """The block pool of a model without a KV cache: every allocation succeeds and
    nothing is cached."""

    num_blocks = 0

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return True

    def free(self, seq: Sequence) -> None:
        pass

    def match_prefix(self, seq: Sequence) -> None:
        pass


class PoolingCore:
    task = "embed"

    def __init__(self, config: EngineConfig, model_path: str, weight_format: tuple[str, Any], model_config: dict) -> None:
        """``weight_format``: what :func:`~.loader.choose_weight_format` chose for the model."""
        self.config = config
        if config.tensor_parallel_size > 1:
            raise ConfigError("an embedding model runs on one rank; drop tensor_parallel_size", field="tensor_parallel_size")
        if config.speculative_method or config.speculative_model:
            raise ConfigError("an embedding model generates nothing to speculate on; drop the speculative options",
                              field="speculative_method")
        if config.kv_connector:
            raise ConfigError("an embedding model keeps no KV cache for a connector to move; drop kv_connector", field="kv_connector")
        if config.enable_lora or config.lora_modules:
            raise ConfigError("LoRA adapters are served on generative models only; drop enable_lora and lora_modules",
                              field="enable_lora")
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = loader.choose_device(config.device)
        self.model_path, self.model_config = model_path, model_config
        self.weight_format, weight_format = weight_format
        self.tokenizer, self.tokenizer_name = setup.load_tokenizer(config, model_path)
        self.attention_backend = "encoder"  # the encoder's own bidirectional attention
        self.quantization = loader.choose_quantization(config.quantization, config.dtype, weight_format, self.device)
        self.model = loader.build_model(
            model_path, model_config, weight_format=weight_format, attention_backend=config.attention_backend,
            quantization=self.quantization, quantization_config=config.quantization_config, dtype=config.dtype,
            device=self.device,
        )
        self.pooling = PoolingConfig.from_model_dir(model_path, config.pooling, config.normalize)
        # A cross-encoder's output is its classifier's: num_labels scores per input.
        self.task = "classify" if isinstance(self.model, CrossEncoderArchitecture) else "embed"
        self.num_labels = int(self.model.num_labels) if self.task == "classify" else 0
        self.num_token_types = max(1, int(model_config.get("type_vocab_size", 2)))  # as the encoder sizes its table
        self.activation = score_activation(model_config, self.num_labels) if self.task == "classify" else None
        limits = [setup.max_model_len(config, model_config), int(self.model.max_positions)]
        if config.max_model_len is None and self.pooling.max_seq_length:
            limits.append(self.pooling.max_seq_length)  # sentence-transformers' own limit
        self.max_model_len = min(limits)
        if config.max_model_len is not None and config.max_model_len > self.model.max_positions:
            raise ConfigError(f"max_model_len {config.max_model_len} is over the model's {self.model.max_positions} positions",
                              field="max_model_len")
        self.hidden_size = int(model_config.get("hidden_size") or self.model.hidden_size)
        self.matryoshka = bool(model_config.get("is_matryoshka") or model_config.get("matryoshka_dimensions"))
        # A prompt is never split, so the budget holds at least the longest one.
        self.scheduler = Scheduler(
            NullPool(), max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=max(config.max_num_batched_tokens, self.max_model_len),
            max_model_len=self.max_model_len, whole_prompts=True,
        )
        self.requests: dict[str, Sequence] = {}
        self.token_types: dict[str, list[int]] = {}  # a text pair's segments, where any is not 0
        self.num_embedded = 0
        self.num_request_errors = 0
        self.step_times = StepTimes()
        self.profiler = Profiler(self.device)
        logger.info("entries in use: %s", entries.describe(self.entries()))

    def entries(self) -> dict[str, dict[str, str | None]]:
        """Every registry entry this engine runs, with the distribution that provides it."""
        return entries.selected(
            entries.model_names(self.weight_format, self.model_config, self.tokenizer_name, self.quantization)
        )

    def info(self) -> CoreInfo:
        return CoreInfo(
            vocab_size=int(self.model_config.get("vocab_size") or self.tokenizer.vocab_size),
            max_model_len=self.max_model_len,
            attention_backend=self.attention_backend,
            quantization=self.quantization,
            device=str(self.device),
            num_kv_blocks=0,
            block_size=self.config.block_size,
            pid=os.getpid(),
            task=self.task,
            hidden_size=self.hidden_size,
            matryoshka=self.matryoshka,
            normalize=self.pooling.normalize and self.task == "embed",
            num_labels=self.num_labels,
        )

    # ------------------------------------------------------------------ requests

    def add_request(self, request: AddRequest) -> None:
        if request.request_id in self.requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use", param="request_id")
        if not request.embed:
            raise InvalidRequestError(EMBEDDING_MODEL_NO_TEXT, param="model")
        if request.grammar is not None:
            raise InvalidRequestError("an embedding request takes no structured output", param="structured_outputs")
        ids = list(request.prompt_token_ids)
        if not ids or len(ids) > self.max_model_len:
            raise InvalidRequestError(f"the input has {len(ids)} tokens; this model reads 1 to {self.max_model_len}",
                                      param="input")
        types = request.token_type_ids
        if types is not None and (len(types) != len(ids) or not all(0 <= t < self.num_token_types for t in types)):
            raise InvalidRequestError(f"token_type_ids must hold one of 0..{self.num_token_types - 1} for each of the "
                                      f"{len(ids)} tokens", param="token_type_ids")
        seq = Sequence(request.request_id, ids, len(ids), request.params, request.arrival_time, self.max_model_len, None)
        self.scheduler.add(seq)
        self.requests[request.request_id] = seq
        if request.token_type_ids is not None and any(request.token_type_ids):
            self.token_types[request.request_id] = list(request.token_type_ids)

    def abort_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            seq = self.requests.pop(request_id, None)
            self.token_types.pop(request_id, None)
            if seq is not None:
                self.scheduler.remove(seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------------------------ stepping

    def step(self) -> CoreOutputs:
        batch = self.scheduler.schedule()
        if not batch:
            return CoreOutputs([], time.time())
        seqs = [seq for seq, _ in batch.items]
        try:
            prompts = [seq.token_ids[: seq.num_prompt_tokens] for seq in seqs]
            types = [self.token_types.pop(seq.request_id, None) for seq in seqs]
            vectors = self.embed(prompts, types) if any(t is not None for t in types) else self.embed(prompts)
        except Exception as exc:
            raise ModelForwardError(f"the model forward failed: {type(exc).__name__}: {exc}") from exc
        outputs = []
        for seq, vector in zip(seqs, vectors):
            self.scheduler.remove(seq)
            del self.requests[seq.request_id]
            bad = not bool(torch.isfinite(vector).all())
            if bad:  # a model that overflows fails the request, not the engine
                self.num_request_errors += 1
            outputs.append(CoreOutput(
                seq.request_id, finish_reason="error" if bad else "stop",
                error=CoreError(ErrorCode.INTERNAL, "the embedding is not finite (the model overflowed)") if bad else None,
                first_scheduled_time=seq.first_scheduled_time,
                embedding=None if bad else TensorBuffer.from_tensor(vector),
            ))
        self.num_embedded += len(seqs)
        self.step_times.observe(time.perf_counter() - batch.started)
        return CoreOutputs(outputs, time.time())

    def embed(self, prompts: list[list[int]], token_types: list[list[int] | None] | None = None) -> torch.Tensor:
        """The pooled (not normalized) float32 vectors of these token-id prompts; for a
        cross-encoder, its scores (the classifier's logits through the model's
        activation), ``[num_prompts, num_labels]``. ``token_types``: each prompt's
        segments (None: all 0)."""
        lengths = torch.tensor([len(p) for p in prompts])
        ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long, device=self.device)
        positions = torch.cat([torch.arange(n) for n in lengths.tolist()]).to(self.device)
        starts = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to(self.device)
        types = None
        if token_types is not None and any(t is not None for t in token_types):
            types = torch.tensor([t for p, kinds in zip(prompts, token_types) for t in (kinds or [0] * len(p))],
                                 dtype=torch.long, device=self.device)
        with torch.inference_mode():
            hidden = self.model(ids, positions, starts, types)
            if self.task == "classify":
                return activate(self.model.classify(hidden, starts).float(), self.activation).cpu()
            unit = PoolingConfig(self.pooling.mode, False)
            return pool(hidden, starts, unit).cpu()

    # ------------------------------------------------------------------ stats

    def stats(self) -> dict[str, Any]:
        return {
            "attention_backend": self.attention_backend,
            "quantization": self.quantization,
            "num_running": 0,
            "num_waiting": len(self.scheduler.waiting),
            "num_kv_blocks": 0,
            "num_free_kv_blocks": 0,
            "kv_cache_usage": 0.0,
            "num_preemptions": 0,
            "num_request_errors": self.num_request_errors,
            "num_embedded": self.num_embedded,
            "entries": self.entries(),
            **self.step_times.stats(),
        }

    def start_profile(self, directory: str) -> str:
        return self.profiler.start(directory)

    def stop_profile(self) -> str:
        return self.profiler.stop()

    def close(self) -> None:
        pass


def make_core(config: EngineConfig):
    """The engine core for ``config``'s model: :class:`PoolingCore` for an encoder,
    else :class:`~.core.EngineCore`."""
    from pyagent_framework.engine.core import EngineCore

    device = loader.choose_device(config.device)  # what fails before any model is read fails first, as in EngineCore
    if config.tensor_parallel_size > 1:
        setup.check_tensor_parallel(config, device)
    model_path = loader.resolve_model(config.model, config.gguf_file)
    weight_format = loader.choose_weight_format(model_path, config.weight_format)
    model_config = weight_format[1].load_config(model_path)
    if is_encoder(model_config):
        return PoolingCore(config, model_path, weight_format, model_config)
    return EngineCore(config)
