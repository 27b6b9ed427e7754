"""The synchronous engine: requests in, one scheduling step at a time, outputs out."""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pyagent_framework import registries
from pyagent_framework.chat_templates import render_chat_template
from pyagent_framework.engine import loader
from pyagent_framework.engine.config import EngineConfig, make_config
from pyagent_framework.engine.detokenizer import IncrementalDetokenizer, find_stop, partial_stop_length
from pyagent_framework.engine.errors import ConfigError, InvalidRequestError
from pyagent_framework.engine.faults import GuardedMatcher, ModelForwardError, PluginCallError, call_plugin
from pyagent_framework.engine.kv_cache import BlockPool
from pyagent_framework.engine.kv_transfer import KVTransfer
from pyagent_framework.engine.model_runner import ModelRunner, StepLogits
from pyagent_framework.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pyagent_framework.engine.params import SamplingParams
from pyagent_framework.engine.sampler import SampleResult, Sampler, top_logprobs
from pyagent_framework.engine.scheduler import Scheduler
from pyagent_framework.engine.sequence import Sequence, SequenceStatus
from pyagent_framework.engine.speculative import SpeculativeDecoder
from pyagent_framework.engine.structured import StructuredOutputManager
from pyagent_framework.interfaces import layer_ops

# kv_connector_config keys the engine reads itself (the rest go to the connector).
KV_TRANSFER_OPTIONS = ("failure_threshold", "backoff_seconds", "max_pending_saves", "model_identity")
# How long a producer (--kv-role producer) waits for a finished request's blocks to be saved.
PRODUCER_FLUSH_SECONDS = 30.0

logger = logging.getLogger("pyagent_framework.engine")

MAX_CACHE_SALT = 256  # characters
GRAMMAR_POLL_SECONDS = 0.005  # how long an idle step waits for a grammar to compile


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    metrics: RequestMetrics
    prompt_logprobs: list | None = None
    reported: bool = field(default=False)
    grammar: concurrent.futures.Future | None = None  # compiling: scheduled once done
    error: str | None = None  # why it failed (finish_reason "error")
    error_kind: str | None = None  # "invalid_request" (the request's fault) or "internal"

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


class LLMEngine:
    """Owns the model, the KV cache and every request's state.

    ``add_request`` validates and queues; ``step`` runs one forward pass for the
    scheduled batch and returns an output for every request that advanced.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = loader.choose_device(config.device)
        self.model_path = loader.resolve_model(config.model)
        weight_format = loader.choose_weight_format(self.model_path, config.weight_format)
        self.model_config = weight_format.load_config(self.model_path)
        self.tokenizer = self._load_tokenizer(config)
        # "auto" / unset resolved to the names that run (native ones when installed).
        self.attention_backend = loader.choose_attention_backend(config.attention_backend, self.device)
        self.quantization = loader.choose_quantization(config.quantization, config.dtype, weight_format, self.device)
        self.layer_ops = layer_ops(loader.load_entry(registries.attention_backends, self.attention_backend, "attention_backend"))
        logger.info(
            "device %s, attention backend %r, quantization %r", self.device, self.attention_backend, self.quantization
        )
        # Checked before the weights load, so a misspelt name fails fast.
        self.grammar_backend = self._check_grammar_backend(config.grammar_backend)
        grammar_cache_bytes = config.grammar_cache_bytes()
        connector_cls = self._kv_connector_class(config)
        policy_cls = None
        if config.enable_prefix_caching:
            policy_cls = loader.load_entry(registries.eviction_policies, config.eviction_policy, "eviction_policy")
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
        self.vocab_size = int(self.model_config.get("vocab_size") or self.tokenizer.vocab_size)
        self.max_model_len = self._max_model_len(config)
        self.kv_cache, num_blocks = self._allocate_kv_cache(config)
        self.kv_caches = list(self.kv_cache.unbind(0))  # one [2, blocks, ...] view per layer
        policy = None if policy_cls is None else policy_cls(num_blocks)
        # Blocks of one engine hold one model's keys/values; the key still marks whose.
        # With a KV connector, blocks are shared between engines wherever the files lie,
        # so the hash chain starts from the weights' identity instead of their path.
        self.model_identity = self._model_identity(config) if connector_cls is not None else None
        try:
            self.pool = BlockPool(
                num_blocks,
                config.block_size,
                eviction_policy=policy,
                model_key=self.model_path if self.model_identity is None else self.model_identity.hex(),
                hash_algorithm=config.prefix_cache_hash,
                policy_name=config.eviction_policy,
            )
        except ValueError as exc:
            raise ConfigError(str(exc), field="prefix_cache_hash") from None
        self.kv_transfer = self._make_kv_transfer(config, connector_cls)
        self.speculator = self._make_speculator(config)
        self.scheduler = Scheduler(
            self.pool,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            kv_transfer=self.kv_transfer,
            speculator=self.speculator,
            max_model_len=self.max_model_len,
        )
        self.runner = ModelRunner(self.model, self.kv_caches, config.block_size, self.device)
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids)
        self.sampler = Sampler(eos_token_ids=self.eos_token_ids, seed=config.seed)
        self.chat_template = self._chat_template(config)
        self.structured = StructuredOutputManager(
            self.tokenizer,
            self.vocab_size,
            default_backend=self.grammar_backend,
            cache_bytes=grammar_cache_bytes,
            compile_timeout=config.grammar_compile_timeout,
        )
        self.requests: dict[str, Request] = {}
        self.compiling: list[Request] = []  # waiting for their grammar, in arrival order
        self.num_preemptions = 0
        self.num_request_errors = 0  # requests failed by a fault of their own (plugin, budget)
        self._failed: list[str] = []  # this step's failed requests, reported with its outputs
        self._step_requests: set[str] | None = None  # the requests of the step under way, once scheduled

    @classmethod
    def from_args(cls, config_file: str | None = None, **engine_args: Any) -> "LLMEngine":
        return cls(make_config(engine_args, config_file=config_file))

    # ------------------------------------------------------------------ set-up

    def _load_tokenizer(self, config: EngineConfig):
        name, path = "hf", self.model_path
        if config.tokenizer:
            if config.tokenizer in registries.tokenizers:
                name = config.tokenizer
            else:
                name, path = "hf", config.tokenizer
        cls = loader.load_entry(registries.tokenizers, name, "tokenizer")
        self._tokenizer_name = name  # the registry entry, for errors that name it
        try:
            return cls.from_pretrained(path)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"tokenizer: cannot load {name!r} from {path}: {exc}", field="tokenizer") from exc

    @staticmethod
    def _check_grammar_backend(name: str) -> str:
        """``auto`` (try each installed backend in turn) or a registered name."""
        if name != "auto":
            loader.load_entry(registries.grammar_backends, name, "grammar_backend")
        return name

    @staticmethod
    def _kv_connector_class(config: EngineConfig):
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

    @staticmethod
    def _make_speculator(config: EngineConfig) -> SpeculativeDecoder | None:
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

    def _model_identity(self, config: EngineConfig) -> bytes:
        """32 bytes naming the weights as this engine computes with them (dtype and
        quantization included; ``loader.model_identity``), or the digest of the
        ``model_identity`` a user names in ``kv_connector_config``. The attention
        backend is left out: backends agree to float rounding."""
        named = (config.kv_connector_config or {}).get("model_identity")
        if named is not None:
            return hashlib.sha256(b"pyagent-framework named model\0" + str(named).encode()).digest()
        options = json.dumps(config.quantization_config or {}, sort_keys=True, default=str)
        variant = f"dtype={config.dtype} quantization={self.quantization} options={options}"
        return loader.model_identity(self.model_path, self.model_config, variant)

    def _make_kv_transfer(self, config: EngineConfig, connector_cls) -> KVTransfer | None:
        """The connector built from ``kv_connector_config`` (less the keys the engine
        reads itself) inside a :class:`KVTransfer`; a rejected option is a ConfigError."""
        if connector_cls is None:
            return None
        options = dict(config.kv_connector_config or {})
        engine_options = {key: options.pop(key) for key in KV_TRANSFER_OPTIONS if key in options}
        engine_options.pop("model_identity", None)  # read by _model_identity
        try:
            connector = connector_cls(options)
        except (TypeError, ValueError, OSError) as exc:
            raise ConfigError(
                f"kv_connector_config: connector {config.kv_connector!r} rejects {options}: {exc}",
                field="kv_connector_config",
            ) from None
        try:
            return KVTransfer(
                connector, self.kv_cache, model_identity=self.model_identity, role=config.kv_role, **engine_options
            )
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"kv_connector_config: {exc}", field="kv_connector_config") from None

    def _max_model_len(self, config: EngineConfig) -> int:
        native = self.model_config.get("max_position_embeddings")
        if config.max_model_len is None:
            if not native:
                raise ConfigError("the model config has no max_position_embeddings; set max_model_len", field="max_model_len")
            return int(native)
        return config.max_model_len

    def _allocate_kv_cache(self, config: EngineConfig) -> tuple[torch.Tensor, int]:
        dtype = loader.torch_dtype(config.dtype)
        per_block = self.model.kv_cache_shape(1, config.block_size)
        bytes_per_block = math.prod(per_block) * torch.empty((), dtype=dtype).element_size()
        if config.num_kv_blocks is not None:
            num_blocks = config.num_kv_blocks
        else:
            num_blocks = config.kv_cache_bytes() // bytes_per_block
        capacity = num_blocks * config.block_size
        if capacity < self.max_model_len:
            raise ConfigError(
                f"the KV cache holds {capacity} tokens ({num_blocks} blocks of {config.block_size}), fewer than "
                f"max_model_len={self.max_model_len}: raise kv_cache_memory/num_kv_blocks or lower max_model_len",
                field="kv_cache_memory",
            )
        cache = torch.zeros(self.model.kv_cache_shape(num_blocks, config.block_size), dtype=dtype, device=self.device)
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB)", num_blocks, config.block_size, cache.nbytes / 2**20)
        return cache, num_blocks

    def _chat_template(self, config: EngineConfig) -> str | None:
        name = config.chat_template
        if not name:
            return self.tokenizer.chat_template
        if name not in registries.chat_templates and name.endswith(".jinja") and Path(name).is_file():
            return Path(name).read_text(encoding="utf-8")
        return loader.load_entry(registries.chat_templates, name, "chat_template").source

    # ------------------------------------------------------------------ requests

    def render_chat(
        self,
        messages: Seq[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools=None,
        chat_template: str | None = None,
        **template_kwargs: Any,
    ) -> str:
        """The conversation as prompt text, rendered in the sandbox; ``template_kwargs``
        reach the template as variables (e.g. ``enable_thinking``)."""
        source = chat_template or self.chat_template
        if source is None:
            raise InvalidRequestError(
                "this model's tokenizer has no chat template; pass chat_template (e.g. 'chatml')", param="messages"
            )
        # Content None (an assistant message that only calls tools, as OpenAI sends it)
        # renders as "": templates test and concatenate content, and None breaks that.
        messages = [{**m, "content": ""} if m.get("content", "") is None else m for m in messages]
        return render_chat_template(
            source,
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            bos_token=getattr(self.tokenizer, "bos_token", None) or "",
            eos_token=getattr(self.tokenizer, "eos_token", None) or "",
            **template_kwargs,
        )

    def add_request(
        self,
        request_id: str,
        prompt: str | Seq[int] | None,
        params: SamplingParams | None = None,
        *,
        arrival_time: float | None = None,
        add_special_tokens: bool = True,
        cache_salt: str | None = None,
        grammar: concurrent.futures.Future | None = None,
        reasoning_end: Callable[[], Callable[[Seq[int]], bool]] | None = None,
    ) -> None:
        """Validate and queue a request; raises :class:`InvalidRequestError` naming the
        bad field and leaves the engine unchanged. Requests share cached prefix blocks
        only when their ``cache_salt`` is equal (``None`` included), so a tenant's
        salt keeps its prompts' KV apart from everyone else's. ``grammar`` is what
        :meth:`prepare_grammar` returned for these params (else it is compiled here).

        ``reasoning_end`` makes a structured-output grammar constrain only the answer
        after the model's reasoning: called once per sequence, it returns a predicate
        (a reasoning parser's ``is_reasoning_end``) over the output token ids so far;
        tokens are unconstrained until it first holds."""
        params = (params or SamplingParams()).validate(self.vocab_size)
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt or len(cache_salt) > MAX_CACHE_SALT):
            raise InvalidRequestError(
                f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT} characters", param="cache_salt"
            )
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id must be a non-empty string", param="request_id")
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        text, ids = self.tokenize_prompt(prompt, add_special_tokens)
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens, but the context window is {self.max_model_len}; "
                "at least one token must be left to generate",
                param="prompt",
            )
        now = time.time() if arrival_time is None else arrival_time
        seqs = []
        for index in range(params.n):
            seq = Sequence(
                request_id=request_id,
                index=index,
                token_ids=list(ids),
                num_prompt_tokens=len(ids),
                params=params,
                arrival_time=now,
                max_total_tokens=self.max_model_len,
                cache_salt=cache_salt,
            )
            if params.seed is not None:
                seq.generator = torch.Generator().manual_seed((params.seed * 1_000_003 + index) % 2**63)
            if params.logprobs is not None:
                seq.logprobs = []
            if reasoning_end is not None and params.structured_outputs is not None:
                seq.reasoning_end = reasoning_end()
                if self._reasoning_over(seq):
                    seq.reasoning_end = None  # nothing to wait for
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, ids, skip_special_tokens=params.skip_special_tokens)
            seqs.append(seq)
        request = Request(request_id, text, list(ids), params, seqs, RequestMetrics(arrival_time=now))
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None]  # the first prompt token has no logprob
        if params.structured_outputs is not None:
            request.grammar = grammar or self.structured.submit(params.structured_outputs)
        self.requests[request_id] = request
        if request.grammar is not None:
            self.compiling.append(request)
        else:
            for seq in seqs:
                self.scheduler.add(seq)

    def prepare_grammar(self, params: SamplingParams) -> concurrent.futures.Future | None:
        """Start compiling ``params``' structured-output spec (any thread may call this);
        the future fails with InvalidRequestError for a bad spec. Awaiting it before
        ``add_request`` turns a bad spec into an error before anything is queued."""
        params.validate(self.vocab_size)
        if params.structured_outputs is None:
            return None
        return self.structured.submit(params.structured_outputs)

    def tokenize_prompt(self, prompt, add_special_tokens: bool = True) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a prompt given as text or ids; raises
        InvalidRequestError (param ``prompt``) for an empty prompt or an id outside the
        vocabulary. Reads no engine state, so any thread may call it."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("the prompt is empty", param="prompt")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        if prompt is None or isinstance(prompt, (bytes, Mapping)):
            raise InvalidRequestError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}", param="prompt")
        ids = list(prompt)
        if not ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        for token in ids:
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < self.vocab_size:
                raise InvalidRequestError(
                    f"prompt token {token!r} is not a token id of this model (0..{self.vocab_size - 1})", param="prompt"
                )
        return None, ids

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; returns its final output (or None
        if it is unknown or already done)."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        now = time.time()
        for seq in request.seqs:
            if not seq.is_finished:
                self._finish(seq, "abort", now)
        return self._output(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------------------------ stepping

    def step(self) -> list[RequestOutput]:
        """One scheduling step. A fault of one request (a plugin that raises, a grammar
        over its time budget) fails that request and the step goes on; a failure in the
        step's own bookkeeping fails the requests of the step. Only a failure of the
        model forward is raised (:class:`ModelForwardError`): the engine cannot go on."""
        self._failed = []
        self._step_requests = None
        try:
            outputs = self._step()
        except ModelForwardError:
            raise
        except Exception as exc:
            logger.exception("engine step failed outside the model forward")
            concerned = self._step_requests if self._step_requests is not None else set(self.requests)
            now = time.time()
            for request_id in concerned:
                request = self.requests.get(request_id)
                if request is not None:
                    self._fail_request(request, f"internal error while serving the request: {type(exc).__name__}: {exc}", now)
            outputs = []
        return outputs + self._collect_failed()

    def _step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        if self.compiling:
            self._start_compiled()
        batch = self.scheduler.schedule()
        self._step_requests = {seq.request_id for seq, _ in batch.items}
        self.num_preemptions += batch.num_preempted
        if batch.failed:  # a proposer raised for these: fail them before the forward
            now = time.time()
            for seq, error in batch.failed:
                self._fail_request(self.requests[seq.request_id], str(error), now, kind="internal")
            batch.items = [(seq, n) for seq, n in batch.items if not seq.is_finished]
        if not batch:
            if self.compiling and not self._failed:  # nothing to run until a grammar is ready
                concurrent.futures.wait(
                    [r.grammar for r in self.compiling], GRAMMAR_POLL_SECONDS, concurrent.futures.FIRST_COMPLETED
                )
            return []
        decode_step = all(seq.num_computed_tokens >= seq.num_tokens - 1 - len(seq.spec_tokens) for seq, _ in batch.items)
        try:
            logits = self.runner.execute(batch)
        except Exception as exc:
            raise ModelForwardError(f"the model forward failed: {type(exc).__name__}: {exc}") from exc
        drafts = self._advance(batch)
        now = time.time()
        self._record_prompt_logprobs(logits)
        if logits.sample_seqs:
            matchers = [seq.matcher if seq.reasoning_end is None else None for seq in logits.sample_seqs]
            if any(m is not None for m in matchers):
                self.structured.apply_masks(logits.sample_logits, matchers, self.layer_ops)
                for seq, matcher in zip(logits.sample_seqs, matchers):
                    if getattr(matcher, "error", None) is not None:
                        self._fail_request(self.requests[seq.request_id], str(matcher.error), now, kind="internal")
            results = self._sample(logits.sample_logits, logits.sample_seqs, now)
            for seq, result in zip(logits.sample_seqs, results):
                if not seq.is_finished:
                    self._guarded(seq, now, self._append_token, seq, result, now)
        if drafts:
            self._accept_drafts(batch, logits, drafts, now)
        self._charge_grammar_time(batch, drafts, now)
        if self.speculator is not None and decode_step:
            # A decode step's time, drafting and verifying included, prices a scored row.
            self.speculator.observe_step(time.perf_counter() - started, batch.num_tokens, len(batch.items))
        touched = dict.fromkeys(seq.request_id for seq in logits.sample_seqs)
        touched.update(dict.fromkeys(seq.request_id for seq, _ in batch.items if seq.seq_id in drafts))
        if self.kv_transfer is not None and self.kv_transfer.role == "producer":
            # A prefill instance's answer tells a router the blocks are ready for the
            # decode instance: a finished request waits for its saves.
            if any(self.requests[r].finished for r in touched if r in self.requests):
                self.kv_transfer.flush(timeout=PRODUCER_FLUSH_SECONDS)
        outputs = []
        for request_id in touched:
            request = self.requests.get(request_id)
            if request is None or request.error is not None:  # a failed one is reported by step()
                continue
            outputs.append(self._output(request))
            if request.finished:
                del self.requests[request_id]
        return outputs

    def _advance(self, batch) -> dict[int, tuple[list[int], object]]:
        """After the forward pass: count the scheduled tokens as computed, file the
        blocks they filled (and save them through a KV connector), and take the
        speculative drafts back out of their sequences until they are verified;
        returns those drafts by sequence."""
        filed, drafts = [], {}
        for seq, num_new in batch.items:
            if seq.spec_tokens:
                drafts[seq.seq_id] = self.speculator.take_back(seq)
                num_new -= len(drafts[seq.seq_id][0])
            seq.num_computed_tokens += num_new
            filed += self.pool.cache_full_blocks(seq)
        if self.kv_transfer is not None and filed:
            self.kv_transfer.save(filed)
        return drafts

    def _accept_drafts(self, batch, logits: StepLogits, drafts: dict, now: float) -> None:
        for seq, _ in batch.items:
            if seq.seq_id in drafts and not seq.is_finished:
                self._guarded(seq, now, self._accept_draft, seq, logits, drafts[seq.seq_id], now)

    def _accept_draft(self, seq: Sequence, logits: StepLogits, drafted: tuple, now: float) -> None:
        """Append the verified tokens of a drafted sequence (see
        :mod:`pyagent_framework.engine.speculative`): the kept draft tokens count as
        computed, the blocks only a rejected draft used go back to the pool."""
        draft, probs = drafted
        rows = logits.spec_rows[seq.seq_id]
        if seq.matcher is not None and seq.reasoning_end is None:
            rows = rows.float().clone()
            kept = self.speculator.mask_for_grammar(
                seq, rows, draft, lambda row, matchers: self.structured.apply_masks(row, matchers, self.layer_ops)
            )
            if getattr(seq.matcher, "error", None) is not None:  # its fill_bitmask raised
                raise seq.matcher.error
            rows, probs = rows[: len(kept) + 1], None if probs is None else probs[: len(kept)]
            draft = kept
        emitted = self.speculator.verify(seq, rows, draft, probs)
        for i, token in enumerate(emitted):
            self._append_token(seq, SampleResult(token), now)
            if seq.is_finished:
                break
            if i < len(emitted) - 1:  # a kept draft token: its keys/values are in the cache
                seq.num_computed_tokens += 1
        if not seq.is_finished:
            self.pool.trim(seq)

    def _start_compiled(self) -> None:
        """Schedule the requests whose grammar is ready (each sequence gets its own
        matcher); fail those whose spec failed, with the error in their output."""
        still = []
        for request in self.compiling:
            if self.requests.get(request.request_id) is not request:
                continue  # aborted while compiling
            if not request.grammar.done():
                still.append(request)
                continue
            error = request.grammar.exception()
            if error is None:
                grammar = request.grammar.result()
                try:
                    for seq in request.seqs:
                        matcher = call_plugin("grammar_backend", grammar.backend_name, "matcher", grammar.matcher)
                        seq.matcher = GuardedMatcher(matcher, grammar.backend_name)
                except PluginCallError as exc:
                    self._fail_request(request, str(exc), time.time())
                    continue
                for seq in request.seqs:
                    self.scheduler.add(seq)
                continue
            # Compiled again after the cache evicted it, and failed this time.
            self._fail_request(request, str(error), time.time(), kind="invalid_request")
        self.compiling = still

    # ------------------------------------------------------------------ faults

    def _fail_request(self, request: Request, message: str, now: float, *, kind: str = "internal") -> None:
        """Finish every sequence of the request with ``finish_reason="error"`` and free
        its blocks; the step reports it. ``kind``: ``invalid_request`` when the request
        itself cannot be served, ``internal`` for a plugin's or the engine's fault."""
        if request.error is not None:
            return
        request.error, request.error_kind = message, kind
        self.num_request_errors += 1
        logger.warning("request %s failed: %s", request.request_id, message)
        for seq in request.seqs:
            if not seq.is_finished:
                try:
                    self._finish(seq, "error", now)
                except Exception:  # the bookkeeping itself broke: the sequence is out regardless
                    logger.exception("freeing request %s after its failure", request.request_id)
                    seq.status = SequenceStatus.FINISHED
                    seq.finish_reason = "error"
        self._failed.append(request.request_id)

    def _collect_failed(self) -> list[RequestOutput]:
        """Outputs of the requests this step failed that it has not reported yet."""
        outputs = []
        for request_id in self._failed:
            request = self.requests.pop(request_id, None)
            if request is not None:
                outputs.append(self._output(request))
        self._failed = []
        return outputs

    def _guarded(self, seq: Sequence, now: float, fn, *args) -> None:
        """``fn(*args)`` for one sequence; an error fails its request, not the step."""
        try:
            fn(*args)
        except PluginCallError as exc:
            self._fail_request(self.requests[seq.request_id], str(exc), now)
        except Exception as exc:
            logger.exception("advancing request %s failed", seq.request_id)
            self._fail_request(
                self.requests[seq.request_id], f"internal error while advancing the request: {type(exc).__name__}: {exc}", now
            )

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], now: float) -> list[SampleResult | None]:
        """The batch sampled at once; if that raises, row by row, so that only the rows
        that raise again fail their requests."""
        try:
            return self.sampler.sample(logits, seqs)
        except Exception:
            logger.exception("sampling the batch failed; sampling row by row")
        results: list[SampleResult | None] = []
        for row, seq in enumerate(seqs):
            try:
                results.append(self.sampler.sample(logits[row : row + 1], [seq])[0])
            except Exception as exc:
                self._fail_request(self.requests[seq.request_id], f"sampling failed: {type(exc).__name__}: {exc}", now)
                results.append(None)
        return results

    def _charge_grammar_time(self, batch, drafts: dict, now: float) -> None:
        """Fail the requests whose grammar spent more than its per-token budget
        (``grammar_token_timeout``) on this step's tokens (a drafted sequence's
        matcher walks its draft too)."""
        budget = self.config.grammar_token_timeout
        for seq, _ in batch.items:
            matcher = seq.matcher
            if not isinstance(matcher, GuardedMatcher):
                continue
            spent = matcher.take_spent()
            tokens = 1 + (len(drafts[seq.seq_id][0]) if seq.seq_id in drafts else 0)
            if spent > budget * tokens and not seq.is_finished:
                self._fail_request(
                    self.requests[seq.request_id],
                    f"structured_outputs: the grammar took {spent:.2f} s to match one output token, over the "
                    f"{budget:g} s budget (grammar_token_timeout); simplify the pattern or schema",
                    now,
                    kind="invalid_request",
                )

    @staticmethod
    def _reasoning_over(seq: Sequence) -> bool:
        """Whether the sequence's reasoning has ended; a predicate that raises
        counts as ended (the grammar then applies) rather than stopping the engine."""
        try:
            return bool(seq.reasoning_end(seq.token_ids[seq.num_prompt_tokens :]))
        except Exception:
            logger.exception("reasoning_end raised (request %s); constraining from here on", seq.request_id)
            return True

    def _record_prompt_logprobs(self, logits: StepLogits) -> None:
        for request in self.requests.values():
            seq = request.seqs[0]
            if request.prompt_logprobs is None or seq.seq_id not in logits.prompt_rows:
                continue
            self._guarded(seq, time.time(), self._record_rows, request, *logits.prompt_rows[seq.seq_id])

    def _record_rows(self, request: Request, first: int, rows: torch.Tensor) -> None:
        logprobs = torch.log_softmax(rows.float().cpu(), dim=-1)
        for offset in range(rows.shape[0]):
            position = first + offset
            if position + 1 < len(request.prompt_logprobs):
                continue  # recomputed after a preemption: already recorded
            target = request.prompt_token_ids[position + 1]
            _, entry = top_logprobs(logprobs[offset], target, request.params.prompt_logprobs)
            request.prompt_logprobs.append(entry)

    def _append_token(self, seq: Sequence, result: SampleResult, now: float) -> None:
        params = seq.params
        token = result.token_id
        constrained = seq.matcher is not None and seq.reasoning_end is None
        if constrained and not seq.matcher.accept_tokens([token]):
            # Only a token the mask allowed can be sampled; if the backend disagrees
            # with its own mask, fail this request rather than emit unconstrained text.
            error = RuntimeError(f"refused token {token}, which its own mask allowed")
            raise PluginCallError("grammar_backend", getattr(seq.matcher, "backend", "?"), "GrammarMatcher.accept_tokens", error)
        seq.token_ids.append(token)
        if seq.first_token_time is None:
            seq.first_token_time = now
        if seq.logprobs is not None and result.top_logprobs is not None:
            seq.logprobs.append(result.top_logprobs)
            seq.cumulative_logprob += result.logprob
        num_out = seq.num_output_tokens
        can_stop = num_out >= params.min_tokens
        # A token that ends the sequence (end-of-sequence, a stop token id) is not
        # part of the text, even when special tokens are kept.
        ends = (can_stop and not params.ignore_eos and token in self.eos_token_ids) or (
            can_stop and token in (params.stop_token_ids or ())
        ) or (constrained and token in self.eos_token_ids and seq.matcher.is_terminated())
        delta = "" if ends and not params.include_stop_str_in_output else self._detokenize(seq.detokenizer.add, token)
        seq.output_text += delta

        if can_stop and delta:
            stop = self._cut_at_stop(seq, len(delta))
            if stop is not None:
                self._finish(seq, "stop", now, stop)
                return
        if seq.reasoning_end is not None and self._reasoning_over(seq):
            seq.reasoning_end = None  # the grammar constrains the tokens from here on
        if constrained and seq.matcher.is_terminated():
            self._finish(seq, "stop", now)  # the grammar ended (on an end-of-sequence token)
        elif can_stop and not params.ignore_eos and token in self.eos_token_ids:
            self._finish(seq, "stop", now)
        elif can_stop and token in (params.stop_token_ids or ()):
            self._finish(seq, "stop", now, token)
        elif params.max_tokens is not None and num_out >= params.max_tokens:
            self._finish(seq, "length", now)
        elif seq.num_tokens >= seq.max_total_tokens:
            self._finish(seq, "length", now)
        if seq.is_finished:
            tail = self._detokenize(seq.detokenizer.flush)
            seq.output_text += tail
            if tail:
                stop = self._cut_at_stop(seq, len(tail))
                if stop is not None:
                    seq.finish_reason, seq.stop_reason = "stop", stop

    def _detokenize(self, fn, *args) -> str:
        return call_plugin("tokenizer", self._tokenizer_name, "decode", fn, *args)

    @staticmethod
    def _cut_at_stop(seq: Sequence, new_chars: int) -> str | None:
        """If a stop string ends in the last ``new_chars`` characters of the output,
        cut the text there (keeping the stop string only if asked) and return it."""
        stops = seq.params.stop_strings
        found = find_stop(seq.output_text, new_chars, stops) if stops else None
        if found is None:
            return None
        index, stop = found
        seq.output_text = seq.output_text[: index + (len(stop) if seq.params.include_stop_str_in_output else 0)]
        return stop

    def _finish(self, seq: Sequence, reason: str, now: float, stop_reason: str | int | None = None) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        seq.finish_time = now
        self.scheduler.remove(seq)
        if self.speculator is not None:
            self.speculator.finished(seq)

    def _output(self, request: Request) -> RequestOutput:
        outputs = []
        for seq in request.seqs:
            text = seq.output_text
            if not seq.is_finished and seq.params.stop_strings:
                withheld = partial_stop_length(text, seq.params.stop_strings)
                text = text[: len(text) - withheld]
            outputs.append(
                CompletionOutput(
                    index=seq.index,
                    text=text,
                    token_ids=list(seq.output_token_ids),
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                    logprobs=None if seq.logprobs is None else list(seq.logprobs),
                    cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
                )
            )
        metrics = request.metrics
        firsts = [s.first_token_time for s in request.seqs if s.first_token_time is not None]
        metrics.first_token_time = min(firsts) if firsts else None
        scheduled = [s.first_scheduled_time for s in request.seqs if s.first_scheduled_time is not None]
        metrics.first_scheduled_time = min(scheduled) if scheduled else None
        if request.finished:
            metrics.finish_time = max(s.finish_time or 0.0 for s in request.seqs)
        metrics.num_preemptions = sum(s.num_preemptions for s in request.seqs)
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=outputs,
            finished=request.finished,
            metrics=metrics,
            prompt_logprobs=request.prompt_logprobs,
            error=request.error,
            error_kind=request.error_kind,
        )

    # ------------------------------------------------------------------ stats

    def stats(self) -> dict[str, Any]:
        return {
            "attention_backend": self.attention_backend,
            "quantization": self.quantization,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_kv_blocks": self.pool.num_blocks,
            "num_free_kv_blocks": self.pool.num_free_blocks,
            "kv_cache_usage": self.pool.num_used_blocks / self.pool.num_blocks,
            "num_preemptions": self.num_preemptions,
            "num_request_errors": self.num_request_errors,
            "prefix_caching": self.pool.caching,
            "num_compiling": len(self.compiling),
            **self.pool.stats(),
            **self.structured.stats(),
            **(self.kv_transfer.stats() if self.kv_transfer is not None else {}),
            **(self.speculator.stats() if self.speculator is not None else {}),
        }

    def close(self) -> None:
        """Finish queued KV saves and release the connector (when there is one); stop
        the grammar compiler processes."""
        self.structured.close()
        if self.kv_transfer is not None:
            self.kv_transfer.close()
