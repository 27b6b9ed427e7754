"""The front end's half of a request's arrival: validation (once), tokenization, chat
templates and the messages for the engine core.

:meth:`InputProcessor.process` checks every field (errors name it), tokenizes the
prompt and returns the request's front-end record with one
:class:`~pyagent_framework.messages.AddRequest` per sample; a structured-output spec
travels as a :class:`~pyagent_framework.messages.GrammarRequest` the core compiles.
The request's output parsers are built here, once per sample, for the output processor.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence as Seq
from typing import Any

import msgspec

from pyagent_framework.chat_templates import render_chat_template
from pyagent_framework.engine.errors import ConfigError, InvalidRequestError
from pyagent_framework.engine.output_parsers import OutputParsers
from pyagent_framework.engine.output_processor import OutputProcessor, RequestState, child_id
from pyagent_framework.engine.params import SamplingParams
from pyagent_framework.messages import AddRequest, CoreSamplingParams, GrammarRequest

MAX_CACHE_SALT = 256  # characters

logger = logging.getLogger("pyagent_framework.engine")


class InputProcessor:
    def __init__(self, tokenizer: Any, *, vocab_size: int, max_model_len: int, chat_template: str | None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.chat_template = chat_template

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

    def process(
        self,
        request_id: str,
        prompt: str | Seq[int] | None,
        params: SamplingParams | None,
        outputs: OutputProcessor,
        *,
        arrival_time: float | None = None,
        add_special_tokens: bool = True,
        cache_salt: str | None = None,
        parsers: OutputParsers | None = None,
        tenant: str | None = None,
        lora: str | None = None,
    ) -> tuple[RequestState, list[AddRequest]]:
        """Validate and tokenize a request; raises :class:`InvalidRequestError` naming
        the bad field. ``parsers`` name the reasoning and tool-call parsers that read
        each sample's text; ``lora`` names the LoRA adapter it is generated with. With
        a structured-output grammar, the reasoning parser also makes the grammar
        constrain only the answer after the model's reasoning, as the core's own
        instance of it finds its end; if the prompt opened no reasoning (the parser says
        it is over before the first token), all is answer and none is parsed as
        reasoning."""
        params = (params or SamplingParams()).validate(self.vocab_size)
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt or len(cache_salt) > MAX_CACHE_SALT):
            raise InvalidRequestError(
                f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT} characters", param="cache_salt"
            )
        if tenant is not None and (not isinstance(tenant, str) or not tenant or len(tenant) > MAX_CACHE_SALT):
            raise InvalidRequestError(f"the tenant must be a non-empty string of at most {MAX_CACHE_SALT} characters",
                                      param="user")
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id must be a non-empty string", param="request_id")
        if request_id in outputs.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        text, ids = self.tokenize_prompt(prompt, add_special_tokens)
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens, but the context window is {self.max_model_len}; "
                "at least one token must be left to generate",
                param="prompt",
            )
        now = time.time() if arrival_time is None else arrival_time
        try:
            state = outputs.new_state(request_id, text, list(ids), params, now, parsers)
        except ConfigError as exc:  # a parser name no plugin registers
            raise InvalidRequestError(str(exc), param=f"parsers.{exc.field}") from None
        core_params = core_sampling_params(params, self.tokenizer)
        grammar = None
        if params.structured_outputs is not None:
            gate = None
            first = state.samples[0].parsers
            if first is not None and first.reasoning is not None:
                if _reasoning_over_at_start(first.reasoning, request_id):
                    for sample in state.samples:  # no reasoning opened: all is answer
                        sample.parsers.reasoning = None
                else:
                    gate = parsers
            spec = params.structured_outputs.spec()
            grammar = GrammarRequest(
                spec.kind,
                list(spec.value) if isinstance(spec.value, tuple) else spec.value,
                params.structured_outputs.backend,
                gate.reasoning_parser if gate is not None else None,
                dict(gate.request) if gate is not None else None,
            )
        # Prompt logprobs are the first sample's: the others need not compute them.
        others = msgspec.structs.replace(core_params, prompt_logprobs=None)
        adds = [
            AddRequest(child_id(request_id, index), list(ids), others if index else core_params, now, cache_salt, index, grammar,
                       tenant=tenant, lora=lora)
            for index in range(params.num_samples)
        ]
        return state, adds


def _reasoning_over_at_start(parser: Any, request_id: str) -> bool:
    """Whether the reasoning is over before the first output token (the prompt opened
    none); a parser that raises counts as over, as in the core's grammar gate."""
    try:
        return bool(parser.is_reasoning_end(()))
    except Exception:
        logger.exception("reasoning parser raised in is_reasoning_end (request %s); the grammar constrains all", request_id)
        return True


def bad_words_token_ids(tokenizer: Any, words: list[str], vocab_size: int | None = None) -> list[list[int]]:
    """Each bad word's token ids as it would start the text and, where that is
    another token sequence of the same length, as it would follow a space (vLLM's
    reading: a word is barred both at the start and in the middle of text)."""
    out: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        for ids in (plain, spaced):
            if ids and ids not in out and (ids is plain or (len(ids) == len(plain) and ids[0] != plain[0])):
                if vocab_size is not None and any(not 0 <= t < vocab_size for t in ids):
                    continue
                out.append(list(ids))
    return out


def core_sampling_params(params: SamplingParams, tokenizer: Any = None) -> CoreSamplingParams:
    """What the core reads of validated parameters (prompt logprobs: the first sample's);
    ``tokenizer`` reads ``bad_words``."""
    bad = bad_words_token_ids(tokenizer, params.bad_words) if params.bad_words and tokenizer is not None else None
    return CoreSamplingParams(
        temperature=float(params.temperature),
        top_k=params.top_k,
        top_p=float(params.top_p),
        min_p=float(params.min_p),
        repetition_penalty=float(params.repetition_penalty),
        frequency_penalty=float(params.frequency_penalty),
        presence_penalty=float(params.presence_penalty),
        logit_bias={int(k): float(v) for k, v in params.logit_bias.items()} if params.logit_bias else None,
        seed=params.seed,
        max_tokens=params.max_tokens,
        min_tokens=params.min_tokens,
        stop_token_ids=list(params.stop_token_ids) if params.stop_token_ids else None,
        ignore_eos=params.ignore_eos,
        logprobs=0 if params.logprobs is None and params.ranked else params.logprobs,  # best_of ranks by logprob
        prompt_logprobs=params.prompt_logprobs,
        priority=params.priority,
        speculative=params.speculative,
        allowed_token_ids=sorted(set(params.allowed_token_ids)) if params.allowed_token_ids else None,
        bad_words_token_ids=bad or None,
        logits_processors=list(params.logits_processors) if params.logits_processors else None,
    )
