"""The legacy completions endpoint, whole or streamed: one or more prompts, each
sampled ``n`` times, optionally echoed."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

from pyagent_framework.engine.outputs import RequestOutput
from pyagent_framework.server import protocol as api
from pyagent_framework.server.beam_search import beam_completion, check_no_beam_fields
from pyagent_framework.server.errors import APIError
from pyagent_framework.server.streaming import Events, check_output, collect, error_event, merge, sse, streamed_usage, total_usage


class CompletionsMixin:
    """:class:`~pyagent_framework.server.serving.OpenAIServing`'s ``completion``; uses
    its model check, prompt tokenization, sampling and logprob helpers, ``_start`` and
    metrics."""

    async def completion(self, req: api.CompletionRequest) -> api.CompletionResponse | AsyncIterator[str]:
        lora = self.check_model(req.model)
        self.check_generates()
        if req.suffix is not None:
            raise APIError(400, "suffix is not supported", param="suffix")
        prompts = _prompt_list(req.prompt)
        if req.use_beam_search:
            return await beam_completion(self, req, prompts)
        check_no_beam_fields(req)
        if req.n > self.config.max_n:
            raise APIError(400, f"n must be <= {self.config.max_n}, got {req.n}", param="n")
        drawn = max(req.n, req.best_of or 0)  # best_of: drawn, the n best returned
        if req.best_of is not None and req.best_of > self.config.max_n:
            raise APIError(400, f"best_of must be <= {self.config.max_n}, got {req.best_of}", param="best_of")
        if len(prompts) * drawn > self.config.max_n:
            raise APIError(400, f"prompts × {'best_of' if drawn > req.n else 'n'} must be <= {self.config.max_n}, "
                                f"got {len(prompts) * drawn}", param="prompt")
        prompt_ids = [self.tokenize_prompt(p, req.add_special_tokens) for p in prompts]
        param_list = []
        for ids in prompt_ids:
            params = self.sampling_params(
                req, max_tokens=req.max_tokens, prompt_len=len(ids), logprobs=req.logprobs, prompt_param="prompt"
            )
            if req.echo and req.logprobs is not None:
                params.prompt_logprobs = max(req.logprobs, params.prompt_logprobs or 0)
            param_list.append(params)
        streams = []
        try:
            for ids, params in zip(prompt_ids, param_list):
                streams.append(await self._start(ids, params, req.cache_salt, tenant=self.tenant_of(req.user), lora=lora))
        except APIError:
            for stream in streams:
                await stream.aclose()
            raise
        request_id = f"cmpl-{uuid.uuid4().hex}"
        trackers = [self.metrics.track(len(ids), delta=bool(req.stream)) for ids in prompt_ids]
        if req.stream:
            return Events(self._completion_stream(req, request_id, streams, trackers), streams, trackers)
        finals = await asyncio.gather(*(collect(s, t) for s, t in zip(streams, trackers)))
        choices = []
        for p, final in enumerate(finals):
            for output in final.outputs:
                text, logprobs = output.text, None
                if req.logprobs is not None:
                    logprobs = self._completion_logprobs(output, 0, req.logprobs, final if req.echo else None)
                if req.echo:
                    text = self._prompt_text(final) + text
                choices.append(
                    api.CompletionChoice(
                        index=p * req.n + output.index,
                        text=text,
                        logprobs=logprobs,
                        finish_reason=output.finish_reason,
                        stop_reason=output.stop_reason,
                        prompt_logprobs=self._prompt_logprobs(req, final),
                    )
                )
        return api.CompletionResponse(id=request_id, model=self.served_as(req.model), choices=choices, usage=total_usage(finals))

    def _prompt_text(self, final: RequestOutput) -> str:
        return final.prompt if final.prompt is not None else self.tokenizer.decode(final.prompt_token_ids, skip_special_tokens=False)

    async def _completion_stream(self, req, request_id, streams, trackers) -> AsyncIterator[str]:
        created = int(time.time())
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        sent: dict[int, int] = {}  # choice index -> characters sent (the outputs are deltas)
        done: set[int] = set()

        def event(choices, usage_info=None) -> str:
            body = api.CompletionResponse(id=request_id, created=created, model=self.served_as(req.model), choices=choices, usage=usage_info)
            return sse(body.model_dump_json())

        try:
            async for p, out in merge(streams, trackers):
                check_output(out)
                choices = []
                for output in out.outputs:
                    index = p * req.n + output.index
                    if index in done:
                        continue
                    chars = sent.get(index, 0)
                    text = output.text
                    if req.echo and index not in sent:
                        text = self._prompt_text(out) + text
                    logprobs = None
                    if req.logprobs is not None and output.logprobs:
                        logprobs = self._completion_logprobs(output, 0, req.logprobs, None, first_offset=chars)
                    if not text and logprobs is None and output.finish_reason is None:
                        continue
                    sent[index] = chars + len(output.text)
                    if output.finish_reason is not None:
                        done.add(index)
                    choices.append(
                        api.CompletionChoice(
                            index=index, text=text, logprobs=logprobs, finish_reason=output.finish_reason, stop_reason=output.stop_reason
                        )
                    )
                if choices:
                    yield event(choices)
        except Exception as exc:  # the request failed: an error event, then the end of the stream
            yield error_event(exc)
            yield sse("[DONE]")
            return
        if include_usage:
            yield event([], streamed_usage(trackers))
        yield sse("[DONE]")


def _prompt_list(prompt) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "the prompt is empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return list(prompt)
