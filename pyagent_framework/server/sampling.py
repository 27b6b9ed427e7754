"""Sampling-parameter mapping: a request body's sampling fields, checked against the
server's caps and the context window, as the engine's :class:`SamplingParams`
(``response_format``, ``structured_outputs`` and vLLM's ``guided_*`` included)."""

from __future__ import annotations

import hashlib
from typing import Any

from pyagent_framework.engine.params import SamplingParams
from pyagent_framework.server import protocol as api
from pyagent_framework.server.errors import APIError


class SamplingMixin:
    """:class:`~pyagent_framework.server.serving.OpenAIServing`'s request-to-params
    mapping; uses its ``config``, ``core`` and ``max_model_len``."""

    @staticmethod
    def tenant_of(user: str | None) -> str | None:
        """The scheduling tenant of a request (``--scheduling-policy fair``): its
        OpenAI ``user`` field, hashed when longer than 256 characters."""
        if not user:
            return None
        return user if len(user) <= 256 else "sha256:" + hashlib.sha256(user.encode()).hexdigest()

    def sampling_params(
        self, req: api.SamplingFields, *, max_tokens: int | None, prompt_len: int, logprobs: int | None, prompt_param: str
    ) -> SamplingParams:
        """Check the server's caps, then build and validate the engine's params.
        ``max_tokens=None`` means what the context window leaves after the prompt."""
        cfg = self.config
        self.check_prompt_len(prompt_len, prompt_param)
        if max_tokens is None:
            max_tokens = self.max_model_len - prompt_len
        n = req.n
        if n > cfg.max_n:
            raise APIError(400, f"n must be <= {cfg.max_n}, got {n}", param="n")
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stops) > cfg.max_stop_strings:
            raise APIError(400, f"at most {cfg.max_stop_strings} stop strings, got {len(stops)}", param="stop")
        if logprobs is not None and logprobs > cfg.max_logprobs:
            raise APIError(400, f"at most {cfg.max_logprobs} logprobs per token, got {logprobs}", param="logprobs")
        if req.prompt_logprobs is not None:
            if req.stream:
                raise APIError(400, "prompt_logprobs cannot be streamed; ask without stream=true", param="prompt_logprobs")
            if not 0 <= req.prompt_logprobs <= cfg.max_logprobs:
                raise APIError(400, f"prompt_logprobs must be between 0 and {cfg.max_logprobs}, got {req.prompt_logprobs}", param="prompt_logprobs")
        bias = None
        if req.logit_bias:
            if len(req.logit_bias) > cfg.max_logit_bias:
                raise APIError(400, f"logit_bias may have at most {cfg.max_logit_bias} entries, got {len(req.logit_bias)}", param="logit_bias")
            bias = {}
            for key, value in req.logit_bias.items():
                try:
                    bias[int(key)] = value
                except ValueError:
                    raise APIError(400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias") from None
        params = SamplingParams(
            structured_outputs=self.structured_outputs(req),
            n=n,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            frequency_penalty=req.frequency_penalty,
            presence_penalty=req.presence_penalty,
            logit_bias=bias,
            seed=req.seed,
            stop=stops or None,
            stop_token_ids=req.stop_token_ids,
            include_stop_str_in_output=req.include_stop_str_in_output,
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=req.prompt_logprobs,
            skip_special_tokens=req.skip_special_tokens,
            priority=req.priority,
            speculative=req.speculative,
            best_of=getattr(req, "best_of", None),
            bad_words=req.bad_words,
            allowed_token_ids=req.allowed_token_ids,
            logits_processors=None if req.logits_processors is None else [
                p if isinstance(p, str) else {"name": p.name, "args": p.args or {}} for p in req.logits_processors
            ],
            # A stream takes each step's new text only (O(n) in its length); a whole
            # response the cumulative outputs (each step's tokens count in the metrics).
            output_kind="delta" if getattr(req, "stream", False) else "cumulative",
        )
        if prompt_len + max_tokens > self.max_model_len:
            raise APIError(
                400,
                f"this model's context window is {self.max_model_len} tokens; the prompt has {prompt_len} and "
                f"max_tokens asks for {max_tokens} more",
                param="max_tokens",
            )
        return params

    def check_prompt_len(self, prompt_len: int, param: str) -> None:
        if prompt_len >= self.max_model_len:
            raise APIError(
                400,
                f"the prompt has {prompt_len} tokens, but this model's context window is {self.max_model_len}; "
                "at least one token must be left to generate",
                param=param,
            )

    @staticmethod
    def structured_outputs(req: api.SamplingFields) -> dict[str, Any] | None:
        """OpenAI's ``response_format`` or vLLM's ``structured_outputs``, as the engine's
        structured-outputs mapping (checked by SamplingParams.validate)."""
        guided = {
            key: value
            for key, value in (("json", req.guided_json), ("regex", req.guided_regex), ("choice", req.guided_choice),
                               ("grammar", req.guided_grammar), ("structural_tag", req.structural_tag))
            if value is not None
        }
        if guided:  # vLLM's older names
            if req.structured_outputs is not None or (req.response_format is not None and req.response_format.type != "text"):
                raise APIError(400, "give guided_* or structured_outputs/response_format, not both", param="structured_outputs")
            if req.guided_decoding_backend is not None:
                guided["backend"] = req.guided_decoding_backend
            return guided
        if req.guided_decoding_backend is not None:
            raise APIError(400, "guided_decoding_backend needs a guided_* field", param="guided_decoding_backend")
        fmt = req.response_format
        if fmt is None or fmt.type == "text":
            return req.structured_outputs
        if req.structured_outputs is not None:
            raise APIError(400, "give response_format or structured_outputs, not both", param="structured_outputs")
        if fmt.type == "json_object":
            return {"json_object": True}
        if fmt.type == "structural_tag":
            return {"structural_tag": fmt.model_dump(exclude_none=True, include={"type", "structures", "triggers", "format"})}
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise APIError(
                400, 'response_format type "json_schema" needs json_schema.schema', param="response_format.json_schema"
            )
        return {"json": fmt.json_schema.schema_}
