"""The engine core: the scheduler, the KV cache and its connector, the model, the
sampler and the optional features that enter through them (speculative drafts through
the scheduler and the sampler, grammars through the :class:`GrammarGate` they ask).

Sequences come in as :class:`~pyagent_framework.messages.AddRequest` (validated and
tokenized by the front end); each :meth:`EngineCore.step` returns what it added to
each sequence as :class:`~pyagent_framework.messages.CoreOutputs`. The core runs in
the caller's process (:class:`~.core_client.InprocClient`) or in its own
(:mod:`.core_process`); either way it is stepped from one thread.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import time
from typing import Any

import torch

from pyagent_framework import parallel, registries
from pyagent_framework.engine import entries, kv_sizing, loader, setup
from pyagent_framework.engine.config import EngineConfig
from pyagent_framework.engine.cuda_graphs import DecodeGraphs
from pyagent_framework.engine.errors import TEXT_MODEL_NO_EMBEDDINGS, ConfigError, InvalidRequestError
from pyagent_framework.engine.faults import ModelForwardError
from pyagent_framework.engine.grammar_gate import GrammarGate
from pyagent_framework.engine.kv_cache import BlockPool
from pyagent_framework.engine.model_runner import ModelRunner, StepLogits
from pyagent_framework.engine.profiling import Profiler
from pyagent_framework.engine.sampler import Sampler
from pyagent_framework.engine.scheduler import ScheduledBatch, Scheduler
from pyagent_framework.engine.sequence import Sequence
from pyagent_framework.engine.step_sampler import Sampled, StepSampler
from pyagent_framework.engine.structured import StructuredOutputManager
from pyagent_framework.engine.tensor_parallel import TensorParallelWorkers
from pyagent_framework.engine.updater import RequestUpdater
from pyagent_framework.interfaces import layer_ops
from pyagent_framework.messages import AddRequest, CoreInfo, CoreOutputs

logger = logging.getLogger("pyagent_framework.engine")

GRAMMAR_POLL_SECONDS = 0.005  # how long an idle step waits for a grammar to compile


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        tp_size = config.tensor_parallel_size
        if config.num_threads or tp_size > 1:  # the ranks share the cores
            torch.set_num_threads(config.rank_threads(torch.get_num_threads()))
        self.device = loader.choose_device(config.device)
        if tp_size > 1:
            setup.check_tensor_parallel(config, self.device)
        self.model_path = loader.resolve_model(config.model, config.gguf_file)
        self.weight_format, weight_format = loader.choose_weight_format(self.model_path, config.weight_format)
        self.model_config = weight_format.load_config(self.model_path)
        self.tokenizer, self.tokenizer_name = setup.load_tokenizer(config, self.model_path)
        # "auto" / unset resolved to the names that run (native ones when installed).
        self.attention_backend = loader.choose_attention_backend(config.attention_backend, self.device)
        self.quantization = loader.choose_quantization(config.quantization, config.dtype, weight_format, self.device)
        backend_cls = loader.load_entry(registries.attention_backends, self.attention_backend, "attention_backend")
        self.layer_ops = layer_ops(backend_cls)
        kv_dtype = setup.kv_cache_dtype(config, backend_cls, self.attention_backend)
        logger.info("device %s, attention backend %r, quantization %r", self.device, self.attention_backend, self.quantization)
        # Names are checked before the weights load, so a misspelt one fails fast.
        grammar_backend = setup.check_grammar_backend(config.grammar_backend)
        grammar_cache_bytes = config.grammar_cache_bytes()
        connector_cls = setup.kv_connector_class(config)
        policy_cls = None
        if config.enable_prefix_caching:
            policy_cls = loader.load_entry(registries.eviction_policies, config.eviction_policy, "eviction_policy")
        with parallel.building(parallel.TensorParallel(0, tp_size)):  # rank 0's slice of the model
            self.model = loader.build_model(
                self.model_path,
                self.model_config,
                weight_format=weight_format,
                attention_backend=self.attention_backend,
                quantization=self.quantization,
                quantization_config=config.quantization_config,
                dtype=config.dtype,
                device=self.device,
            )
        self.lora = setup.make_lora(config, self.model, self.device, self.layer_ops)  # before the KV cache: its slots take memory too
        self.vocab_size = int(self.model_config.get("vocab_size") or self.tokenizer.vocab_size)
        self.max_model_len = setup.max_model_len(config, self.model_config)
        self.kv_cache, num_blocks = setup.allocate_kv_cache(
            config, self.model, self.max_model_len, self.device, dtype=kv_dtype, profile=self._profile_forward
        )
        self.kv_caches = list(self.kv_cache.unbind(0))  # one [2, blocks, ...] view per layer
        # Blocks of one engine hold one model's keys/values; the key still marks whose.
        # With a KV connector, blocks are shared between engines wherever the files lie,
        # so the hash chain starts from the weights' identity instead of their path.
        self.model_identity = None
        if connector_cls is not None:
            self.model_identity = setup.model_identity(config, self.model_path, self.model_config, self.quantization)
        policy, policy_name = (None, None) if policy_cls is None else setup.eviction_policy(config, policy_cls, num_blocks)
        try:
            self.pool = BlockPool(
                num_blocks,
                config.block_size,
                eviction_policy=policy,
                model_key=self.model_path if self.model_identity is None else self.model_identity.hex(),
                hash_algorithm=config.prefix_cache_hash,
                policy_name=policy_name,
            )
        except ValueError as exc:
            raise ConfigError(str(exc), field="prefix_cache_hash") from None
        self.kv_transfer = setup.make_kv_transfer(config, connector_cls, self.kv_cache, self.model_identity)
        self.speculator = setup.make_speculator(config)
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids)
        structured = StructuredOutputManager(
            self.tokenizer,
            self.vocab_size,
            default_backend=grammar_backend,
            cache_bytes=grammar_cache_bytes,
            compile_timeout=config.grammar_compile_timeout,
        )
        self.grammar = GrammarGate(structured, self.tokenizer, self.layer_ops, config.grammar_token_timeout)
        self.scheduler = Scheduler(
            self.pool,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            kv_transfer=self.kv_transfer,
            speculator=self.speculator,
            grammar=self.grammar,
            max_model_len=self.max_model_len,
            policy=config.scheduling_policy,
            max_loras=config.max_loras if self.lora is not None else None,
        )
        self.workers = None  # ranks 1 and up of a tensor-parallel group
        if tp_size > 1:
            self.workers = TensorParallelWorkers(
                config, size=tp_size, num_blocks=num_blocks, threads=torch.get_num_threads(),
                attention_backend=self.attention_backend, quantization=self.quantization,
            )
        self.runner = ModelRunner(self.model, self.kv_caches, config.block_size, self.device, self.workers,
                                  lora=self.lora.state if self.lora is not None else None)
        # Graphs reserve one block for their padding rows: only where a longest sequence still fits without it.
        if (self.device.type == "cuda" and not config.enforce_eager and getattr(backend_cls, "cuda_graphs", False)
                and self.lora is None and tp_size == 1 and (num_blocks - 1) * config.block_size >= self.max_model_len):
            self.runner.graphs = DecodeGraphs(
                self.model, self.kv_caches, config.block_size, self.device, max_num_seqs=config.max_num_seqs,
                max_model_len=self.max_model_len, pad_block=self.pool.reserve(),
            )
        self.step_sampler = StepSampler(Sampler(eos_token_ids=self.eos_token_ids, seed=config.seed), self.grammar, self.speculator)
        self.updater = RequestUpdater(self)
        self.requests: dict[str, Sequence] = {}
        self._batch: ScheduledBatch | None = None  # the step under way, once scheduled
        self.step_times = StepTimes()  # of steps that ran the model
        self.profiler = Profiler(self.device)
        logger.info("entries in use: %s", entries.describe(self.entries()))

    def _profile_forward(self) -> int:
        """The activation peak (bytes) of the largest step, for sizing the KV cache on a GPU."""
        return kv_sizing.profile_forward(
            self.model, self.device, num_tokens=self.config.max_num_batched_tokens, num_seqs=self.config.max_num_seqs,
            max_model_len=self.max_model_len, block_size=self.config.block_size,
        )

    def entries(self) -> dict[str, dict[str, str | None]]:
        """Every registry entry this engine runs, with the distribution that provides it."""
        return entries.selected({
            **entries.model_names(self.weight_format, self.model_config, self.tokenizer_name, self.quantization),
            "attention_backend": self.attention_backend,
            "eviction_policy": self.pool.policy_name if self.pool.caching else None,
            "kv_connector": self.config.kv_connector if self.kv_transfer is not None else None,
            "proposer": self.speculator.name if self.speculator is not None else None,
            "grammar_backend": None if self.config.grammar_backend == "auto" else self.config.grammar_backend,
            "chat_template": self.config.chat_template if self.config.chat_template in registries.chat_templates else None,
        })

    def info(self) -> CoreInfo:
        return CoreInfo(
            vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
            attention_backend=self.attention_backend,
            quantization=self.quantization,
            device=str(self.device),
            num_kv_blocks=self.pool.num_blocks,
            block_size=self.config.block_size,
            pid=os.getpid(),
            lora_adapters=sorted(self.lora.adapters) if self.lora is not None else [],
            max_loras=self.config.max_loras if self.lora is not None else 0,
        )

    # ------------------------------------------------------------------ requests

    def add_request(self, request: AddRequest) -> concurrent.futures.Future | None:
        """Queue a sequence the front end validated. With a grammar, returns the future
        of its compile: the sequence is scheduled once it is done, and dropped (with no
        output: the future's error is the caller's answer) if it fails."""
        if request.request_id in self.requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use", param="request_id")
        if request.embed:
            raise InvalidRequestError(TEXT_MODEL_NO_EMBEDDINGS, param="model")
        ids = list(request.prompt_token_ids)
        if not ids or len(ids) >= self.max_model_len:
            raise InvalidRequestError(f"the prompt has {len(ids)} tokens; the context window is {self.max_model_len}", param="prompt")
        params = request.params
        seq = Sequence(request.request_id, ids, len(ids), params, request.arrival_time, self.max_model_len, request.cache_salt,
                       tenant=request.tenant)
        if request.lora is not None:
            if self.lora is None or request.lora not in self.lora.adapters:
                loaded = ", ".join(sorted(self.lora.adapters)) if self.lora is not None else "none: LoRA is off (--enable-lora)"
                raise InvalidRequestError(f"no LoRA adapter named {request.lora!r} is loaded (loaded: {loaded or 'none'})",
                                          param="model")
            seq.lora, seq.lora_key = request.lora, self.lora.key(request.lora)
        if params.seed is not None:
            seq.generator = torch.Generator().manual_seed((params.seed * 1_000_003 + request.sample_index) % 2**63)
        grammar = None
        if request.grammar is not None:
            grammar = self.grammar.submit(seq, request.grammar)
        else:
            self.scheduler.add(seq)
        self.requests[request.request_id] = seq
        return grammar

    def abort_requests(self, request_ids: list[str]) -> None:
        """Stop these sequences now and free their blocks (unknown ids are ignored)."""
        for request_id in request_ids:
            seq = self.requests.pop(request_id, None)
            if seq is not None and not seq.is_finished:
                self.updater.finish(seq, "abort")

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------------------------ stepping

    def step(self) -> CoreOutputs:
        """One step: the deltas of every sequence that advanced or ended. A fault of one
        request fails that request; only a failed model forward raises (ModelForwardError)."""
        self._batch = None
        try:
            return self._step()
        except ModelForwardError:
            raise
        except Exception as exc:
            return self._step_failed(exc)

    def _step(self) -> CoreOutputs:
        batch = self._batch = self.scheduler.schedule()
        if not batch:
            return self._idle(batch)
        logits = self.execute(batch)  # the model forward
        sampled = self.step_sampler.sample(batch, logits)  # masks, sampling, draft verification
        outputs = self.updater.update(batch, sampled)  # tokens appended, stops, deltas
        self.step_times.observe(time.perf_counter() - batch.started)
        return outputs

    def execute(self, batch: ScheduledBatch) -> StepLogits:
        if self.lora is not None:  # each row's adapter, in a slot (not the forward: a fault here is the step's)
            running = {seq.lora for seq in self.scheduler.running if seq.lora is not None}
            self.lora.prepare([(seq.lora, n) for seq, n in batch.items], running)
        try:
            return self.runner.execute(batch)
        except Exception as exc:
            raise ModelForwardError(f"the model forward failed: {type(exc).__name__}: {exc}") from exc

    def _idle(self, batch: ScheduledBatch) -> CoreOutputs:
        """Nothing to run: wait a moment for a grammar to compile, if one is."""
        if not batch.not_started:
            self.grammar.wait(GRAMMAR_POLL_SECONDS)
        return self.updater.update(batch, Sampled())

    def _step_failed(self, exc: Exception) -> CoreOutputs:
        """A failure in the step's own bookkeeping fails the sequences of the step (all,
        if it failed before scheduling), not the engine."""
        logger.exception("engine step failed outside the model forward")
        batch = self._batch
        concerned = [seq for seq, _ in batch.items] if batch is not None else list(self.requests.values())
        for seq in concerned:
            self.updater.fail(seq, f"internal error while serving the request: {type(exc).__name__}: {exc}")
        return self.updater.outputs()

    # ------------------------------------------------------------------ stats

    def stats(self) -> dict[str, Any]:
        pool = self.pool
        return {
            "attention_backend": self.attention_backend,
            "quantization": self.quantization,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_kv_blocks": pool.num_blocks,
            "num_free_kv_blocks": pool.num_free_blocks,
            "kv_cache_usage": pool.num_used_blocks / pool.num_blocks,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_priority_preemptions": self.scheduler.num_priority_preemptions,
            "num_request_errors": self.updater.num_request_errors,
            "prefix_caching": pool.caching,
            "entries": self.entries(),
            **pool.stats(),
            **self.grammar.stats(),
            **(self.kv_transfer.stats() if self.kv_transfer is not None else {}),
            **(self.speculator.stats() if self.speculator is not None else {}),
            **self.step_times.stats(),
            **(self.lora.stats() if self.lora is not None else {}),
        }

    def add_lora(self, name: str, path: str) -> dict[str, Any]:
        """Load a LoRA adapter (between steps); an error names what is wrong with it."""
        if self.lora is None:
            raise InvalidRequestError("LoRA is off: start the engine with --enable-lora", param="lora_name")
        return self.lora.add(name, path)

    def remove_lora(self, name: str) -> None:
        if self.lora is None:
            raise InvalidRequestError("LoRA is off: start the engine with --enable-lora", param="lora_name")
        self.lora.remove(name, in_use=any(seq.lora == name for seq in self.requests.values()))

    def start_profile(self, directory: str) -> str:
        return self.profiler.start(directory)

    def stop_profile(self) -> str:
        return self.profiler.stop()

    def close(self) -> None:
        """Finish queued KV saves and release the connector (when there is one); stop
        the grammar compiler processes."""
        self.grammar.close()
        if self.kv_transfer is not None:
            self.kv_transfer.close()
        if self.workers is not None:
            self.workers.close()


class StepTimes:
    """A histogram of engine step durations (seconds), as cumulative bucket counts."""

    BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)

    def __init__(self) -> None:
        self.counts = [0] * len(self.BUCKETS)
        self.total = 0.0
        self.count = 0

    def observe(self, seconds: float) -> None:
        for i, bound in enumerate(self.BUCKETS):
            if seconds <= bound:
                self.counts[i] += 1
        self.total += seconds
        self.count += 1

    def stats(self) -> dict[str, Any]:
        return {"step_time_buckets": [[b, c] for b, c in zip(self.BUCKETS, self.counts)],
                "step_time_sum": self.total, "step_time_count": self.count}
