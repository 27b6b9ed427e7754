"""The offline Python API: ``LLM(...).generate(...)``, ``.chat(...)``, ``.stream(...)``."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence as Seq
from typing import Any, Union

from pyagent_framework.engine import beam_search, scoring
from pyagent_framework.engine.beam_search import BeamSearchOutput, BeamSearchParams
from pyagent_framework.engine.config import make_config
from pyagent_framework.engine.errors import InvalidRequestError
from pyagent_framework.engine.llm_engine import LLMEngine
from pyagent_framework.engine.output_parsers import OutputParsers
from pyagent_framework.engine.outputs import EmbeddingRequestOutput, RequestOutput
from pyagent_framework.engine.params import LoRARequest, PoolingParams, SamplingParams

Prompt = Union[str, Seq[int]]
Messages = Seq[Mapping[str, Any]]


class LLM:
    """Generate from a model.

    ``LLM(model="smollm2", attention_backend="torch", quantization=None, **engine_args)``
    takes the same options as the ``pyagent generate|chat|serve`` flags. The engine core
    runs in a process of its own (``engine_process=False``: in this one, for debugging).
    """

    def __init__(
        self, model: str | None = None, *, config_file: str | None = None, environment: bool = True, **engine_args: Any
    ) -> None:
        """``environment=False`` ignores ``PYAGENT_*`` variables (an engine inside an
        engine, such as a draft model, takes only the options it is given)."""
        config = make_config({"model": model, **engine_args}, config_file=config_file, env=environment)
        self.engine = LLMEngine(config)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def max_model_len(self) -> int:
        """The context window: prompt and output tokens together."""
        return self.engine.max_model_len

    def close(self) -> None:
        """Finish queued KV-connector saves and release the connector; stop the engine
        core's process (also done at exit)."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        cache_salt: str | None = None,
        parsers: OutputParsers | None = None,
        lora_request: LoRARequest | str | Seq[LoRARequest | str | None] | None = None,
    ) -> list[RequestOutput]:
        """Outputs for every prompt, in the order given. A single prompt may be a string
        or a list of token ids. ``cache_salt`` keeps these prompts' cached KV blocks
        apart from requests with another salt (or none). ``parsers`` name reasoning and
        tool-call parsers: each sample's ``message`` is then what they read in its text.
        ``lora_request`` generates with a LoRA adapter (a :class:`LoRARequest` or a loaded
        adapter's name), one for all prompts or one per prompt (None: the base model).
        A request that fails while it runs (a plugin raised for it, its grammar ran
        over its time budget) comes back with ``finish_reason="error"`` and the reason
        in ``error``; the others are unaffected."""
        ids = self._submit(prompts, params, cache_salt, output_kind="final_only", parsers=parsers, lora_request=lora_request)
        finals = {out.request_id: out for out in self._run(ids) if out.finished}
        return [finals[request_id] for request_id in ids]

    def beam_search(
        self, prompts: Prompt | Seq[Prompt], params: BeamSearchParams, *, cache_salt: str | None = None,
        lora_request: LoRARequest | str | None = None,
    ) -> list[BeamSearchOutput]:
        """The ``params.beam_width`` best continuations of every prompt by beam search
        (transformers' ``num_beams`` semantics, see :mod:`.beam_search`), best first, in
        the order given. The prompts' beams step through the engine together."""
        searches = beam_search.start(self.engine, _as_prompt_list(prompts), params)
        [lora] = self._lora_names(lora_request, 1)  # one adapter for every beam
        beam_search.run(searches, lambda step_prompts, step: self.generate(step_prompts, step, cache_salt=cache_salt,
                                                                           lora_request=lora))
        return beam_search.outputs(searches, self.tokenizer)

    def embed(
        self,
        prompts: Prompt | Seq[Prompt],
        params: PoolingParams | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        normalize: bool | None = None,
        dimensions: int | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """The embedding of every input, in the order given, from an embedding model
        (an encoder: ``LLM(model=<all-MiniLM-L6-v2 directory>)``). The options (or
        ``params``) are :class:`PoolingParams`'. Inputs are batched by the engine's token
        budget; an input longer than the model reads raises unless
        ``truncate_prompt_tokens`` is given."""
        if params is None:
            params = PoolingParams(truncate_prompt_tokens, normalize, dimensions)
        prompts = _as_prompt_list(prompts)
        ids = [f"llm-{next(self._ids)}" for _ in prompts]
        self.engine.wait_added(self.engine.add_embed_requests_nowait([(i, p, params) for i, p in zip(ids, prompts)]))
        finals = {out.request_id: out for out in self._run(ids)}
        return [finals[request_id] for request_id in ids]

    def score(
        self, text_1: str | Seq[str], text_2: str | Seq[str], *, truncate_prompt_tokens: int | None = None
    ) -> list[scoring.ScoringRequestOutput]:
        """The score of every text pair (``outputs.score``), in order. Pairs as vLLM makes
        them: one ``text_1`` with each ``text_2``, or two lists of the same length
        elementwise. A cross-encoder reads each pair as one sequence (its score is the
        model's, sigmoid of the logit by default); an embedding model scores the
        cosine similarity of the two texts' embeddings. ``truncate_prompt_tokens``: see
        :meth:`embed` (a pair's longer text is cut first)."""
        task = scoring.check_scorer(self.engine)
        pairs = scoring.pair_up(text_1, text_2)
        ids = [f"llm-{next(self._ids)}" for _ in pairs]
        if task == "embed":
            texts = scoring.unique_texts(pairs)
            embedded = self.embed(texts, PoolingParams(truncate_prompt_tokens, normalize=True))
            return scoring.cosines(ids, pairs, dict(zip(texts, embedded)))
        self.engine.wait_added(self.engine.add_score_requests_nowait(
            [(i, a, b) for i, (a, b) in zip(ids, pairs)], truncate_prompt_tokens=truncate_prompt_tokens))
        finals = {out.request_id: out for out in self._run(ids)}
        return [scoring.classified(finals[request_id]) for request_id in ids]

    def stream(
        self, prompts: Prompt | Seq[Prompt], params: SamplingParams | Seq[SamplingParams] | None = None
    ) -> Iterator[RequestOutput]:
        """Yield an output each time a request advances; all run together. Requests are
        submitted when iteration starts; stopping early aborts the rest."""
        yield from self._run(self._submit(prompts, params))

    def _submit(self, prompts, params, cache_salt: str | None = None, output_kind: str | None = None, parsers=None,
                lora_request=None) -> list[str]:
        """Validate and queue every prompt, or none of them. Grammars compile in
        parallel, and a spec that does not compile raises before anything runs."""
        prompts = _as_prompt_list(prompts)
        param_list = _as_params_list(params, len(prompts))
        if output_kind is not None:
            param_list = [(p or SamplingParams()).replace(output_kind=output_kind) for p in param_list]
        ids = [f"llm-{next(self._ids)}" for _ in prompts]
        loras = self._lora_names(lora_request, len(prompts))
        pending = self.engine.add_requests_nowait(
            list(zip(ids, prompts, param_list)), cache_salt=cache_salt, parsers=parsers, lora=loras
        )
        self.engine.wait_added(pending)
        return ids

    def _lora_names(self, lora_request, count: int) -> list[str | None]:
        """One adapter name (or None) per prompt; a :class:`LoRARequest` with a path
        the engine has not loaded is loaded first."""
        requests = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * count
        if len(requests) != count:
            raise InvalidRequestError(f"{len(requests)} LoRA requests for {count} prompts", param="lora_request")
        names = []
        for request in requests:
            if isinstance(request, LoRARequest):
                if request.path is not None and request.name not in self.engine.lora_adapters:
                    self.engine.add_lora(request.name, request.path)
                request = request.name
            if request is not None and not isinstance(request, str):
                raise InvalidRequestError(f"lora_request must be a LoRARequest or an adapter name, got {request!r}",
                                          param="lora_request")
            names.append(request)
        return names

    def _run(self, ids: list[str]) -> Iterator[RequestOutput]:
        pending = set(ids)
        try:
            while pending:
                # A request that fails (a plugin raised for it, its grammar ran over its
                # time budget) ends with finish_reason "error" and out.error; the rest go on.
                for out in self.engine.step():
                    if out.request_id in pending:
                        if out.finished:
                            pending.discard(out.request_id)
                        yield out
        finally:
            for request_id in pending:  # the caller stopped early
                self.engine.abort_request(request_id)

    def chat(
        self,
        messages: Messages | Seq[Messages],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        tools: Seq[Mapping[str, Any]] | None = None,
        tool_parser: str | None = None,
        reasoning_parser: str | None = None,
        lora_request: LoRARequest | str | None = None,
    ) -> list[RequestOutput]:
        """Render each conversation with the chat template, then generate. With
        ``tool_parser`` / ``reasoning_parser`` (registry names, as ``pyagent serve``
        takes them) each sample's ``message`` holds its content, reasoning and tool calls."""
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        prompts = [
            self.encode_chat(c, add_generation_prompt=add_generation_prompt, tools=tools, chat_template=chat_template)
            for c in conversations
        ]
        parsers = None
        if tool_parser is not None or reasoning_parser is not None:
            request = {"tools": [dict(t) for t in tools]} if tools else {}
            parsers = OutputParsers(tool_parser=tool_parser, reasoning_parser=reasoning_parser, request=request)
        return self.generate(prompts, params, parsers=parsers, lora_request=lora_request)

    def encode_chat(self, messages: Messages, **render_options: Any) -> list[int]:
        """Token ids of a conversation rendered with the chat template (which carries
        its own special tokens, so none are added)."""
        return self.engine.tokenizer.encode(self.engine.render_chat(messages, **render_options), add_special_tokens=False)


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


def _as_params_list(params, count: int) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} sampling params for {count} prompts")
    return params
