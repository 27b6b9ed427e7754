"""The synchronous front end: requests in, outputs out, one core step at a time.

:class:`LLMEngine` joins the three parts: the :class:`InputProcessor` (validation,
tokenization, templates), an engine-core client (the core in this process or in its
own) and the :class:`OutputProcessor` (detokenization, stop strings, outputs).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence as Seq
from typing import Any

import attrs

from pyagent_framework.engine import loader, setup
from pyagent_framework.engine.config import EngineConfig, make_config
from pyagent_framework.engine.core_client import EngineDeadError, InprocClient
from pyagent_framework.engine.errors import (
    CROSS_ENCODER_NO_EMBEDDINGS, CROSS_ENCODER_NO_TEXT, EMBEDDING_MODEL_NO_TEXT, TEXT_MODEL_NO_EMBEDDINGS, TEXT_MODEL_NO_SCORES,
    ConfigError, InvalidRequestError,
)
from pyagent_framework.engine.process_client import ProcessClient
from pyagent_framework.engine.input_processor import InputProcessor
from pyagent_framework.engine.output_processor import OutputProcessor
from pyagent_framework.engine.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from pyagent_framework.engine.params import PoolingParams, SamplingParams
from pyagent_framework.messages import AddRequest, CoreOutput, CoreOutputs, CoreSamplingParams, ErrorCode


class LLMEngine:
    """``add_request`` validates and queues; ``step`` returns an output for every
    request that advanced (the core's next step's deltas applied)."""

    def __init__(self, config: EngineConfig, *, step_timeout: float | None = None, on_dead=None) -> None:
        self.config = config
        if config.engine_process:
            self.client = _process_client(config, step_timeout, on_dead)
            self.core = None
            model_path = loader.resolve_model(config.model, config.gguf_file)
            self.tokenizer, tokenizer_name = setup.load_tokenizer(config, model_path)
        elif config.data_parallel_size > 1:
            raise ConfigError(
                f"data_parallel_size {config.data_parallel_size} runs each replica's engine core in a process of "
                "its own; drop --no-engine-process (engine_process=False) or use data_parallel_size 1",
                field="engine_process",
            )
        else:
            self.client = InprocClient(config)
            self.core = self.client.core  # the EngineCore itself, for tests and debugging
            self.tokenizer, tokenizer_name = self.core.tokenizer, self.core.tokenizer_name
        info = self.client.info
        self.task = info.task  # "generate", or "embed" for an encoder
        self._embeds: dict[str, tuple[str | None, list[int], PoolingParams]] = {}  # embedding requests in flight
        self.info = info
        self.vocab_size = info.vocab_size
        self.max_model_len = info.max_model_len
        self.attention_backend = info.attention_backend
        self.quantization = info.quantization
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids)
        self.chat_template = setup.chat_template(config, self.tokenizer)
        self.input_processor = InputProcessor(
            self.tokenizer, vocab_size=info.vocab_size, max_model_len=info.max_model_len, chat_template=self.chat_template
        )
        self.output_processor = OutputProcessor(self.tokenizer, tokenizer_name)
        self.lora_adapters: set[str] = set(info.lora_adapters)  # the LoRA adapters the core has loaded
        self._failed: deque[RequestOutput] = deque()  # requests the core refused after their add
        self._failed_lock = threading.Lock()

    @classmethod
    def from_args(cls, config_file: str | None = None, **engine_args: Any) -> "LLMEngine":
        return cls(make_config(engine_args, config_file=config_file))

    # ------------------------------------------------------------------ requests

    def render_chat(self, messages: Seq[Mapping[str, Any]], **options: Any) -> str:
        return self.input_processor.render_chat(messages, **options)

    def tokenize_prompt(self, prompt, add_special_tokens: bool = True) -> tuple[str | None, list[int]]:
        return self.input_processor.tokenize_prompt(prompt, add_special_tokens)

    def add_request(self, request_id: str, prompt: str | Seq[int] | None, params: SamplingParams | None = None, **options: Any) -> None:
        """Validate and queue a request; raises :class:`InvalidRequestError` naming the
        bad field (a structured-output spec no backend compiles included) and leaves
        the engine unchanged. Options: see :meth:`InputProcessor.process`."""
        self.wait_added([self.add_request_nowait(request_id, prompt, params, **options)])

    def add_request_nowait(self, request_id: str, prompt, params: SamplingParams | None = None, **options: Any):
        """Queue a request; returns ``(request_id, futures)`` for :meth:`wait_added`
        (a grammar compiles meanwhile)."""
        [added] = self.add_requests_nowait([(request_id, prompt, params)], **options)
        return added

    def add_requests_nowait(self, requests: list[tuple[str, Any, SamplingParams | None]], **options: Any):
        """Queue several requests, every one or none (the first that fails validation
        raises), in one message to the core, so that its next step sees them all (a
        batch's composition, and so its float rounding, does not depend on timing).
        Returns ``(request_id, futures)`` pairs for :meth:`wait_added`."""
        if self.task != "generate":
            raise InvalidRequestError(CROSS_ENCODER_NO_TEXT if self.task == "classify" else EMBEDDING_MODEL_NO_TEXT, param="model")
        loras = options.pop("lora", None)
        loras = list(loras) if isinstance(loras, (list, tuple)) else [loras] * len(requests)
        for lora in loras:
            self.check_lora(lora)
        processed = [
            (request_id, *self.input_processor.process(request_id, prompt, params, self.output_processor, lora=lora, **options))
            for (request_id, prompt, params), lora in zip(requests, loras, strict=True)
        ]
        for _, state, _ in processed:
            self.output_processor.add(state)
        try:
            futures = self.client.add_requests([add for _, _, adds in processed for add in adds])
        except BaseException:
            for request_id, _, _ in processed:
                self.abort_request(request_id)
            raise
        added, at = [], 0
        for request_id, _, adds in processed:
            mine = futures[at : at + len(adds)]
            at += len(adds)
            for future in mine:  # a grammar that fails to compile ends the request (the core dropped it)
                future.add_done_callback(lambda done, rid=request_id: self._refused(rid, done))
            added.append((request_id, mine))
        return added

    def add_embed_requests_nowait(self, requests: list[tuple[str, Any, PoolingParams | None]], *, arrival_time: float | None = None,
                                  add_special_tokens: bool = True, priority: int = 0):
        """Queue embedding requests (every one or none: the first bad input raises
        :class:`InvalidRequestError` naming it) in one message to the core. A text is
        tokenized with the model's special tokens; ``truncate_prompt_tokens`` keeps its
        first tokens and the closing special token, as the tokenizer's own truncation
        does. Returns ``(request_id, futures)`` pairs for :meth:`wait_added`."""
        if self.task != "embed":
            raise InvalidRequestError(CROSS_ENCODER_NO_EMBEDDINGS if self.task == "classify" else TEXT_MODEL_NO_EMBEDDINGS,
                                      param="model")
        prepared = []
        for request_id, prompt, params in requests:
            self._check_new_id(request_id, prepared)
            params = params or PoolingParams()
            params.check(self.info.hidden_size, self.info.matryoshka, self.max_model_len)
            text, ids = self.input_processor.tokenize_prompt(prompt, add_special_tokens=add_special_tokens)
            limit = params.truncate_prompt_tokens
            if limit is not None:
                ids = self._truncated(ids, self.max_model_len if limit == -1 else limit, text is not None)
            if len(ids) > self.max_model_len:
                raise InvalidRequestError(
                    f"the input has {len(ids)} tokens; this model reads at most {self.max_model_len} "
                    "(truncate_prompt_tokens keeps the first ones)", param="input")
            prepared.append((request_id, text, ids, params, None))
        return self._add_pooling(prepared, arrival_time, priority)

    def add_score_requests_nowait(self, requests: list[tuple[str, str, str]], *, truncate_prompt_tokens: int | None = None,
                                  arrival_time: float | None = None, priority: int = 0):
        """Queue text pairs ``(request_id, text_1, text_2)`` for a cross-encoder (task
        ``classify``), each tokenized as its tokenizer pairs texts; every one or none.
        ``truncate_prompt_tokens`` cuts the longer text of a pair first until the pair
        fits (-1: the model's limit); without it a pair longer than the model reads
        raises. Each output's "embedding" is the model's scores (:mod:`.scoring`).
        An embedding model's scores are cosines of embeddings: see ``LLM.score``."""
        if self.task != "classify":
            raise InvalidRequestError(TEXT_MODEL_NO_SCORES if self.task == "generate" else
                                      "this model is an embedding model: its scores are cosines of embeddings", param="model")
        params = PoolingParams(truncate_prompt_tokens, normalize=False)
        params.check(self.info.num_labels, False, self.max_model_len)
        limit = None if truncate_prompt_tokens is None else (
            self.max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens)
        prepared = []
        for request_id, first, second in requests:
            self._check_new_id(request_id, prepared)
            try:
                ids, types = self.tokenizer.encode_pair(first, second, max_length=limit)
            except ValueError as exc:
                raise InvalidRequestError(str(exc), param="model") from None
            if limit is not None and len(ids) > limit:  # the tokenizer could not cut below its special tokens
                raise InvalidRequestError(f"truncate_prompt_tokens {limit} is too few for a pair: its special "
                                          f"tokens alone take more (uncut, it has {len(ids)} tokens)", param="truncate_prompt_tokens")
            if len(ids) > self.max_model_len:
                raise InvalidRequestError(
                    f"the text pair has {len(ids)} tokens; this model reads at most {self.max_model_len} "
                    "(truncate_prompt_tokens cuts the longer text first)", param="text_2")
            prepared.append((request_id, None, ids, params, types))
        return self._add_pooling(prepared, arrival_time, priority)

    def _check_new_id(self, request_id: Any, prepared: list) -> None:
        if not isinstance(request_id, str) or not request_id or self.in_flight(request_id) or any(
                request_id == other for other, *_ in prepared):
            raise InvalidRequestError(f"request id {request_id!r} is empty or already in use", param="request_id")

    def _add_pooling(self, prepared: list, arrival_time: float | None, priority: int):
        """Send checked pooling requests ``(request_id, text, ids, params, token_type_ids)``
        to the core in one message."""
        arrival = time.time() if arrival_time is None else arrival_time
        adds = []
        for request_id, text, ids, params, types in prepared:
            self._embeds[request_id] = (text, ids, params)
            adds.append(AddRequest(request_id, ids, CoreSamplingParams(priority=priority), arrival, embed=True,
                                   token_type_ids=types if types is not None and any(types) else None))
        try:
            futures = self.client.add_requests(adds)
        except BaseException:
            for request_id, *_ in prepared:
                self.abort_request(request_id)
            raise
        for (request_id, *_), future in zip(prepared, futures):
            future.add_done_callback(lambda done, rid=request_id: self._refused(rid, done))
        return [(request_id, [future]) for (request_id, *_), future in zip(prepared, futures)]

    def _truncated(self, ids: list[int], limit: int, tokenized_here: bool) -> list[int]:
        if len(ids) <= limit:
            return ids
        special = getattr(self.tokenizer, "special_token_ids", frozenset()) or frozenset()
        if tokenized_here and limit > 1 and ids[-1] in special:
            return ids[: limit - 1] + ids[-1:]  # [CLS] first tokens [SEP]
        return ids[:limit]

    def _embedding(self, out: CoreOutput) -> EmbeddingRequestOutput | None:
        """The output of a finished embedding request; None if it was aborted meanwhile
        (another thread may abort while a step's outputs are processed)."""
        entry = self._embeds.pop(out.request_id, None)
        if entry is None:
            return None
        text, ids, params = entry
        if out.embedding is None:
            kind = "invalid_request" if out.error is not None and out.error.code == ErrorCode.INVALID_REQUEST else "internal"
            message = out.error.message if out.error is not None else f"the request ended ({out.finish_reason})"
            return EmbeddingRequestOutput(out.request_id, text, ids, None, True, message, kind)
        import torch

        vector = out.embedding.to_tensor().to(torch.float32)
        if params.dimensions is not None:
            vector = vector[: params.dimensions]
        if self.info.normalize if params.normalize is None else params.normalize:
            vector = torch.nn.functional.normalize(vector, dim=-1)
        return EmbeddingRequestOutput(out.request_id, text, ids, EmbeddingOutput(vector.tolist()))

    def process_outputs(self, core_outputs: CoreOutputs) -> tuple[list, list[str]]:
        """One core step's outputs (embeddings made here, the rest by the output
        processor), and the requests to abort in the core."""
        if not self._embeds:
            return self.output_processor.process(core_outputs)
        mine = [out for out in core_outputs.outputs if out.request_id in self._embeds]
        rest = CoreOutputs([out for out in core_outputs.outputs if out.request_id not in self._embeds], core_outputs.timestamp)
        outputs, aborts = self.output_processor.process(rest)
        embedded = [self._embedding(out) for out in mine]
        return outputs + [out for out in embedded if out is not None], aborts

    def in_flight(self, request_id: str) -> bool:
        return request_id in self.output_processor.requests or request_id in self._embeds

    def _refused(self, request_id: str, done: concurrent.futures.Future) -> None:
        error = done.exception()
        if error is not None and request_id in self._embeds:  # the core refused an embedding
            failed = CoreOutput(request_id, finish_reason="error")
            with self._failed_lock:
                output = self._embedding(failed)
                if output is not None:
                    output.error = str(error)
                    output.error_kind = "invalid_request" if isinstance(error, InvalidRequestError) else "internal"
                    self._failed.append(output)
            self.client.wake()
            return
        if error is not None:
            kind = "invalid_request" if isinstance(error, InvalidRequestError) else "internal"
            with self._failed_lock:  # against wait_added, which tells the caller instead
                output, child_ids = self.output_processor.fail(request_id, str(error), kind, time.time())
                if output is not None:
                    self._failed.append(output)
            self.client.abort_requests(child_ids)
            if output is not None:
                self.client.wake()  # a step() waiting on the core returns it

    def wait_added(self, pending: list[tuple[str, list[concurrent.futures.Future]]]) -> None:
        """Wait until the core has every one of these requests; if one cannot be served
        (its grammar failed), abort all of them and raise its error."""
        error = None
        for _, futures in pending:
            for future in futures:
                try:
                    future.result()
                except Exception as exc:
                    error = error or exc
        if error is not None:
            ids = {request_id for request_id, _ in pending}
            with self._failed_lock:  # the caller gets the error, not a failed output too
                for request_id in ids:
                    self.abort_request(request_id)
                kept = [out for out in self._failed if out.request_id not in ids]
                self._failed.clear()
                self._failed.extend(kept)
            raise error

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; returns its final output (or None
        if it is unknown or already done)."""
        if self._embeds.pop(request_id, None) is not None:
            self.client.abort_requests([request_id])
            return None
        output, child_ids = self.output_processor.abort(request_id, time.time())
        self.client.abort_requests(child_ids)
        return output

    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor.requests or self._embeds)

    # ------------------------------------------------------------------ stepping

    def step(self, timeout: float | None = None) -> list[RequestOutput]:
        """The outputs of the core's next step. In process mode, waits up to ``timeout``
        seconds for it (forever by default) and raises EngineDeadError if the core died."""
        failed = self._take_failed()
        if failed or not self.has_unfinished_requests():
            return failed
        core_outputs = self.client.get_outputs(timeout)
        if core_outputs is None:
            return self._take_failed()
        outputs, aborts = self.process_outputs(core_outputs)
        self.client.abort_requests(aborts)
        return self._take_failed() + outputs

    def _take_failed(self) -> list[RequestOutput]:
        failed = []
        while self._failed:
            failed.append(self._failed.popleft())
        return failed

    # ------------------------------------------------------------------ stats

    def stats(self) -> dict[str, Any]:
        return {**self.client.stats(), "num_unfinished_requests": len(self.output_processor.requests) + len(self._embeds)}

    def check_lora(self, name: str | None) -> None:
        """Raise InvalidRequestError unless ``name`` is None or a loaded adapter's."""
        if name is not None and name not in self.lora_adapters:
            if not self.info.max_loras:
                raise InvalidRequestError(f"LoRA adapter {name!r}: LoRA is off (start the engine with --enable-lora)",
                                          param="model")
            loaded = ", ".join(sorted(self.lora_adapters)) or "none"
            raise InvalidRequestError(f"no LoRA adapter named {name!r} is loaded (loaded: {loaded})", param="model")

    def add_lora(self, name: str, path: str) -> None:
        """Load a PEFT LoRA adapter from directory ``path`` in every engine core;
        InvalidRequestError says what is wrong with it."""
        if not self.info.max_loras:
            raise InvalidRequestError("LoRA is off: start the engine with --enable-lora", param="lora_name")
        try:
            self.client.call("add_lora", name, str(path))
        except InvalidRequestError:
            raise
        except ValueError as exc:  # in this process: the adapter's ConfigError
            raise InvalidRequestError(str(exc), param="lora_path") from None
        self.lora_adapters.add(name)

    def remove_lora(self, name: str) -> None:
        """Unload an adapter no request is using."""
        if name not in self.lora_adapters:
            raise InvalidRequestError(f"no LoRA adapter named {name!r} is loaded", param="lora_name")
        try:
            self.client.call("remove_lora", name)
        except InvalidRequestError:
            raise
        except ValueError as exc:
            raise InvalidRequestError(str(exc), param="lora_name") from None
        self.lora_adapters.discard(name)

    def start_profile(self, directory: str) -> None:
        """Start a torch profile in each engine core (its process, where the model runs)."""
        self.client.call("start_profile", directory)

    def stop_profile(self) -> list[str]:
        """Stop the profiles; the trace files written, one per engine core."""
        paths = self.client.call("stop_profile")
        return list(paths) if isinstance(paths, list) else [paths]

    def close(self) -> None:
        """Finish queued KV saves and release the connector (when there is one); stop
        the grammar compiler processes and, in process mode, the core process."""
        self.client.close()


def _process_client(config: EngineConfig, step_timeout: float | None, on_dead):
    """The core in a process of its own, or N of them (data parallelism)."""
    if config.tensor_parallel_size > 1 and config.distributed_executor_backend == "ray":
        from pyagent_framework.engine.ray_executor import connect

        # The core's process joins the cluster this one is in (or starts here).
        ray = connect(config, "distributed_executor_backend")
        config = attrs.evolve(config, ray_address=ray.get_runtime_context().gcs_address)
    if config.data_parallel_size > 1:
        from pyagent_framework.engine.data_parallel import DataParallelClient

        return DataParallelClient(config, step_timeout=step_timeout, on_dead=on_dead)
    return ProcessClient(config, step_timeout=step_timeout, on_dead=on_dead)


__all__ = ["EngineDeadError", "LLMEngine"]
