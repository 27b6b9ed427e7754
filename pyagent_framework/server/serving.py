"""The OpenAI API over :class:`AsyncLLM`: requests become sampling parameters and
prompts, engine outputs become responses or server-sent-event chunks.

Nothing here knows about HTTP beyond :class:`APIError`; the FastAPI app
(:mod:`pyagent_framework.server.app`) routes to it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence as Seq
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from pyagent_framework.chat_templates import ChatTemplateError
from pyagent_framework.engine.async_llm import AsyncLLM, EngineDeadError
from pyagent_framework.engine.errors import InvalidRequestError
from pyagent_framework.engine.faults import PluginCallError, call_plugin
from pyagent_framework.engine.outputs import CompletionOutput, RequestOutput
from pyagent_framework.engine.params import SamplingParams
from pyagent_framework.server import protocol as api
from pyagent_framework.server import tool_choice
from pyagent_framework.server.config import ServerConfig
from pyagent_framework.server.errors import APIError
from pyagent_framework.server.metrics import RequestTracker, ServerMetrics
from pyagent_framework.types import DeltaMessage, ToolCallDelta

logger = logging.getLogger("pyagent_framework.server")

# Template variables a request may not set: the renderer's own inputs and its limits.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "chat_template", "max_output_chars", "timeout"}
)


def sse(data: str) -> str:
    return f"data: {data}\n\n"


class OpenAIServing:
    def __init__(
        self,
        engine: AsyncLLM,
        config: ServerConfig,
        *,
        model_name: str,
        metrics: ServerMetrics,
        tool_parser_cls: type | None = None,
        reasoning_parser_cls: type | None = None,
    ) -> None:
        self.engine = engine
        self.core = engine.engine  # the LLMEngine: tokenizer, chat template, limits
        self.config = config
        self.model_name = model_name
        self.metrics = metrics
        self.tool_parser_cls = tool_parser_cls
        self.reasoning_parser_cls = reasoning_parser_cls
        self.created = int(time.time())

    @property
    def tokenizer(self):
        return self.core.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                404, f"the model {model!r} does not exist; this server serves {self.model_name!r}", param="model", code="model_not_found"
            )

    # ------------------------------------------------------------------ sampling

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
        )
        try:
            params.validate(self.core.vocab_size)
        except InvalidRequestError as exc:
            raise APIError(400, str(exc), param=exc.param) from None
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

    async def _start(
        self, prompt: str | list[int], params: SamplingParams, cache_salt: str | None, *, reasoning_end=None, param: str | None = None
    ):
        """Queue the request; ``param`` names the request field an invalid
        structured-output spec came from, when the server built it."""
        request_id = f"req-{uuid.uuid4().hex}"
        try:
            stream = await self.engine.add_request(
                prompt, params, request_id=request_id, cache_salt=cache_salt, reasoning_end=reasoning_end
            )
        except InvalidRequestError as exc:
            where = param if param and (exc.param or "").startswith("structured_outputs") else exc.param
            raise APIError(400, str(exc), param=where) from None
        except EngineDeadError as exc:
            raise APIError(503, str(exc), code="engine_dead") from None
        return stream

    @staticmethod
    def structured_outputs(req: api.SamplingFields) -> dict[str, Any] | None:
        """OpenAI's ``response_format`` or vLLM's ``structured_outputs``, as the engine's
        structured-outputs mapping (checked by SamplingParams.validate)."""
        guided = {
            key: value
            for key, value in (("json", req.guided_json), ("regex", req.guided_regex), ("choice", req.guided_choice), ("grammar", req.guided_grammar))
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
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise APIError(
                400, 'response_format type "json_schema" needs json_schema.schema', param="response_format.json_schema"
            )
        return {"json": fmt.json_schema.schema_}

    # ------------------------------------------------------------------ prompts

    async def render(self, req: api.ChatCompletionRequest) -> list[int]:
        """The conversation's prompt ids. A template sent with the request renders on a
        worker thread: for up to its time limit it holds that thread, not the event loop
        every other response goes through."""
        if req.chat_template is None:
            return self.render_messages(req)
        return await asyncio.to_thread(self.render_messages, req)

    def render_messages(self, req: api.ChatCompletionRequest) -> list[int]:
        if req.chat_template is not None and not self.config.trust_request_chat_template:
            raise APIError(
                400, "this server does not accept chat templates in requests (start it with --trust-request-chat-template)", param="chat_template"
            )
        extra = dict(req.chat_template_kwargs or {})
        clash = sorted(RESERVED_TEMPLATE_KWARGS & set(extra))
        if clash:
            raise APIError(400, f"chat_template_kwargs may not set {', '.join(clash)}", param="chat_template_kwargs")
        if req.continue_final_message and (req.add_generation_prompt or req.messages[-1].role != "assistant"):
            raise APIError(
                400, "continue_final_message needs add_generation_prompt=false and a final assistant message", param="continue_final_message"
            )
        messages = [message_dict(m) for m in req.messages]
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        try:
            text = self.core.render_chat(
                messages, add_generation_prompt=req.add_generation_prompt, tools=tools, chat_template=req.chat_template, **extra
            )
        except (ChatTemplateError, InvalidRequestError) as exc:
            raise APIError(400, str(exc), param="messages") from None
        if req.continue_final_message:
            final = messages[-1]["content"] or ""
            cut = text.rfind(final) if final else -1
            if cut != -1:
                text = text[: cut + len(final)]
        return self.tokenizer.encode(text, add_special_tokens=False)

    def tokenize_prompt(self, prompt: str | list[int], add_special_tokens: bool) -> list[int]:
        try:
            return self.core.tokenize_prompt(prompt, add_special_tokens)[1]
        except InvalidRequestError as exc:
            raise APIError(400, str(exc), param=exc.param) from None

    # ------------------------------------------------------------------ chat

    def _tool_mode(self, req: api.ChatCompletionRequest) -> tuple[str | None, dict[str, Any] | None]:
        """How the output is read for tool calls: (None | "auto" | "required" |
        "named", the JSON schema that constrains the output for the last two),
        refusing what cannot be served."""
        choice = req.tool_choice
        if not req.tools:
            if choice not in (None, "none", "auto"):
                raise APIError(400, "tool_choice 'required' or a named function needs tools", param="tool_choice")
            return None, None
        names = [t.function.name for t in req.tools]
        if len(set(names)) != len(names):
            raise APIError(400, f"tool function names must be unique, got {names}", param="tools")
        if choice == "none":
            return None, None
        if choice in (None, "auto"):
            if not (self.config.enable_auto_tool_choice and self.tool_parser_cls is not None):
                raise APIError(
                    400,
                    '"auto" tool choice needs the server started with --enable-auto-tool-choice and --tool-call-parser',
                    param="tool_choice",
                )
            return "auto", None
        if (req.response_format is not None and req.response_format.type != "text") or req.structured_outputs is not None:
            raise APIError(400, "tool_choice 'required' or a named function cannot be combined with response_format or structured_outputs", param="tool_choice")
        tools = [t.model_dump(exclude_none=True) for t in req.tools]
        try:
            if choice == "required":
                return "required", tool_choice.required_schema(tools, parallel=req.parallel_tool_calls is not False)
            return "named", tool_choice.named_schema(tools, choice.function.name)
        except tool_choice.ToolChoiceError as exc:
            raise APIError(400, str(exc), param="tool_choice" if choice != "required" else "tools") from None

    def _tool_reader(self, mode: str | None, req: api.ChatCompletionRequest):
        """A fresh reader of one choice's output for tool calls (None: plain text)."""
        if mode == "auto":
            return call_plugin("tool_parser", self.config.tool_call_parser, "__init__", self.tool_parser_cls, self.tokenizer)
        if mode == "required":
            return tool_choice.RequiredToolCalls()
        if mode == "named":
            return tool_choice.NamedToolCall(req.tool_choice.function.name)
        return None

    def _reasoning_reader(self, prompt_ids: list[int], request_dict: dict[str, Any]):
        if self.reasoning_parser_cls is None:
            return None
        name = self.config.reasoning_parser
        parser = call_plugin("reasoning_parser", name, "__init__", self.reasoning_parser_cls, self.tokenizer)
        call_plugin("reasoning_parser", name, "prepare", parser.prepare, prompt_ids, request_dict)
        return parser

    async def chat(self, req: api.ChatCompletionRequest) -> api.ChatCompletionResponse | AsyncIterator[str]:
        self.check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        mode, schema = self._tool_mode(req)
        if mode == "auto":
            req = self._adjusted(req)
        prompt_ids = await self.render(req)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = self.sampling_params(
            req, max_tokens=max_tokens, prompt_len=len(prompt_ids), logprobs=logprobs, prompt_param="messages"
        )
        request_dict = req.model_dump(exclude_none=True)
        if schema is not None:
            params = dataclasses.replace(params, structured_outputs={"json": schema})
        reasoning_end = None
        reasoning = self.reasoning_parser_cls is not None
        if params.structured_outputs is not None and reasoning:
            # The grammar constrains the answer only, from the end of the reasoning on;
            # if that is the first token (the prompt opened no reasoning), all is answer.
            reasoning = not self._reasoning_reader(prompt_ids, request_dict).is_reasoning_end(())
            if reasoning:
                reasoning_end = lambda: self._reasoning_reader(prompt_ids, request_dict).is_reasoning_end  # noqa: E731
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        choices = [
            ChoiceState(
                tool_parser=self._tool_reader(mode, req),
                reasoning_parser=self._reasoning_reader(prompt_ids, request_dict) if reasoning else None,
                tool_name=self.config.tool_call_parser if mode == "auto" else f"tool_choice={mode}",
                reasoning_name=self.config.reasoning_parser or "",
            )
            for _ in range(req.n)
        ]
        stream = await self._start(prompt_ids, params, req.cache_salt, reasoning_end=reasoning_end, param="tools" if schema else None)
        tracker = self.metrics.track(len(prompt_ids))
        if req.stream:
            return Events(self._chat_stream(req, request_id, stream, choices, request_dict, tracker), [stream], [tracker])
        final = await collect(stream, tracker)
        return self._chat_response(req, request_id, final, choices, request_dict)

    def _adjusted(self, req: api.ChatCompletionRequest) -> api.ChatCompletionRequest:
        """The request as the tool parser wants it (e.g. special tokens kept)."""
        before = req.model_dump()
        parser = call_plugin("tool_parser", self.config.tool_call_parser, "__init__", self.tool_parser_cls, self.tokenizer)
        after = call_plugin("tool_parser", self.config.tool_call_parser, "adjust_request", parser.adjust_request, dict(before))
        updates = {k: v for k, v in after.items() if k in type(req).model_fields and v != before.get(k)}
        return req.model_copy(update=updates) if updates else req

    def _chat_response(self, req, request_id: str, final: RequestOutput, choices, request_dict) -> api.ChatCompletionResponse:
        out_choices = []
        for output, state in zip(final.outputs, choices):
            content: str | None = output.text
            reasoning = None
            if state.reasoning_parser is not None:
                split = state.call("reasoning_parser", "extract", state.reasoning_parser.extract, output.text, request_dict)
                reasoning, content = split.reasoning_content, split.content
            tool_calls = []
            finish_reason = output.finish_reason
            if state.tool_parser is not None:
                extracted = state.call("tool_parser", "extract", state.tool_parser.extract, content or "", request_dict)
                content = extracted.content
                tool_calls = [
                    api.ToolCallOut(id=c.id, function=api.FunctionCall(name=c.name, arguments=c.arguments))
                    for c in extracted.tool_calls
                ]
                if tool_calls and finish_reason == "stop":
                    finish_reason = "tool_calls"
            out_choices.append(
                api.ChatChoice(
                    index=output.index,
                    message=api.ChatResponseMessage(content=content, reasoning_content=reasoning, tool_calls=tool_calls),
                    logprobs=self._chat_logprobs(output, 0, req.top_logprobs or 0) if req.logprobs else None,
                    finish_reason=finish_reason,
                    stop_reason=output.stop_reason,
                )
            )
        return api.ChatCompletionResponse(
            id=request_id, model=self.model_name, choices=out_choices, usage=usage(final), prompt_logprobs=self._prompt_logprobs(req, final)
        )

    def _prompt_logprobs(self, req: api.SamplingFields, final: RequestOutput) -> api.PromptLogprobs | None:
        """vLLM's prompt_logprobs: per prompt token (None for the first), the token's own
        logprob and the top ``prompt_logprobs`` alternatives, keyed by token id."""
        if req.prompt_logprobs is None or final.prompt_logprobs is None:
            return None
        out: api.PromptLogprobs = []
        for position, entry in enumerate(final.prompt_logprobs):
            if entry is None:
                out.append(None)
                continue
            token = final.prompt_token_ids[position]
            out.append(
                {
                    str(lp.token_id): api.PromptLogprob(logprob=_finite(lp.logprob), rank=lp.rank, decoded_token=self._token_text(lp.token_id)[0])
                    for lp in entry.values()
                    if lp.token_id == token or lp.rank <= req.prompt_logprobs
                }
            )
        return out

    async def _chat_stream(self, req, request_id, stream, choices, request_dict, tracker) -> AsyncIterator[str]:
        created = int(time.time())
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = include_usage and bool(req.stream_options.continuous_usage_stats)

        def chunk(stream_choices, usage_info=None) -> str:
            body = api.ChatCompletionChunk(id=request_id, created=created, model=self.model_name, choices=stream_choices, usage=usage_info)
            return sse(body.model_dump_json())

        for index in range(req.n):
            yield chunk([api.ChatStreamChoice(index=index, delta=api.DeltaOut(role="assistant", content=""))])
        final = None
        try:
            async for _, out in merge([stream], [tracker]):
                final = out
                check_output(out)
                pieces = []
                for output, state in zip(out.outputs, choices):
                    piece = self._chat_delta(req, output, state, request_dict)
                    if piece is not None:
                        pieces.append(piece)
                if pieces:
                    yield chunk(pieces, usage(out) if continuous else None)
        except Exception as exc:  # the request failed: an error event, then the end of the stream
            yield error_event(exc)
            yield sse("[DONE]")
            return
        if include_usage and final is not None:
            yield chunk([], usage(final))
        yield sse("[DONE]")

    def _chat_delta(self, req, output: CompletionOutput, state: "ChoiceState", request_dict) -> api.ChatStreamChoice | None:
        """What one choice adds in this update, or None."""
        if state.done:
            return None
        message = state.parse(
            output.text[len(state.text) :], output.text, output.token_ids, request_dict, final=output.finish_reason is not None
        )
        logprobs = None
        if req.logprobs and output.logprobs is not None and len(output.logprobs) > state.num_logprobs:
            logprobs = self._chat_logprobs(output, state.num_logprobs, req.top_logprobs or 0)
            state.num_logprobs = len(output.logprobs)
        state.text, state.token_ids = output.text, list(output.token_ids)
        finish_reason = output.finish_reason
        if finish_reason is not None:
            state.done = True
            if state.called_tools and finish_reason == "stop":
                finish_reason = "tool_calls"
        if message is None and logprobs is None and finish_reason is None:
            return None
        delta = api.DeltaOut()
        if message is not None:
            delta.content = message.content
            delta.reasoning_content = message.reasoning_content
            if message.tool_calls:
                delta.tool_calls = [
                    api.ToolCallDeltaOut(
                        index=call.index,
                        id=call.id,
                        type="function" if call.id or call.name else None,
                        function=api.FunctionCallDelta(name=call.name, arguments=call.arguments),
                    )
                    for call in message.tool_calls
                ]
        return api.ChatStreamChoice(
            index=output.index,
            delta=delta,
            logprobs=logprobs,
            finish_reason=finish_reason,
            stop_reason=output.stop_reason if finish_reason else None,
        )

    def _token_text(self, token_id: int) -> tuple[str, list[int]]:
        raw = self.tokenizer.token_bytes(token_id)
        return raw.decode("utf-8", errors="replace"), list(raw)

    def _chat_logprobs(self, output: CompletionOutput, start: int, top: int) -> api.ChoiceLogprobs:
        content = []
        for position in range(start, len(output.logprobs or [])):
            entry = output.logprobs[position]
            chosen = output.token_ids[position]
            text, raw = self._token_text(chosen)
            alternatives = sorted((lp for lp in entry.values() if lp.rank <= top), key=lambda lp: lp.rank)[:top]
            content.append(
                api.TokenLogprob(
                    token=text,
                    logprob=_finite(entry[chosen].logprob),
                    bytes=raw,
                    top_logprobs=[
                        api.TopLogprob(token=t, logprob=_finite(lp.logprob), bytes=b)
                        for lp in alternatives
                        for t, b in [self._token_text(lp.token_id)]
                    ],
                )
            )
        return api.ChoiceLogprobs(content=content)

    # ------------------------------------------------------------------ completions

    async def completion(self, req: api.CompletionRequest) -> api.CompletionResponse | AsyncIterator[str]:
        self.check_model(req.model)
        if req.suffix is not None:
            raise APIError(400, "suffix is not supported", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(400, "best_of must equal n (or be left out)", param="best_of")
        prompts = _prompt_list(req.prompt)
        if req.n > self.config.max_n:
            raise APIError(400, f"n must be <= {self.config.max_n}, got {req.n}", param="n")
        if len(prompts) * req.n > self.config.max_n:
            raise APIError(400, f"prompts × n must be <= {self.config.max_n}, got {len(prompts) * req.n}", param="prompt")
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
                streams.append(await self._start(ids, params, req.cache_salt))
        except APIError:
            for stream in streams:
                await stream.aclose()
            raise
        request_id = f"cmpl-{uuid.uuid4().hex}"
        trackers = [self.metrics.track(len(ids)) for ids in prompt_ids]
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
        return api.CompletionResponse(id=request_id, model=self.model_name, choices=choices, usage=total_usage(finals))

    def _prompt_text(self, final: RequestOutput) -> str:
        return final.prompt if final.prompt is not None else self.tokenizer.decode(final.prompt_token_ids, skip_special_tokens=False)

    async def _completion_stream(self, req, request_id, streams, trackers) -> AsyncIterator[str]:
        created = int(time.time())
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        sent: dict[int, tuple[int, int]] = {}  # choice index -> (characters, logprob entries) sent
        done: set[int] = set()
        finals: dict[int, RequestOutput] = {}

        def event(choices, usage_info=None) -> str:
            body = api.CompletionResponse(id=request_id, created=created, model=self.model_name, choices=choices, usage=usage_info)
            return sse(body.model_dump_json())

        try:
            async for p, out in merge(streams, trackers):
                finals[p] = out
                check_output(out)
                choices = []
                for output in out.outputs:
                    index = p * req.n + output.index
                    if index in done:
                        continue
                    chars, num_lp = sent.get(index, (0, 0))
                    text = output.text[chars:]
                    if req.echo and index not in sent:
                        text = self._prompt_text(out) + text
                    logprobs = None
                    if req.logprobs is not None and output.logprobs is not None and len(output.logprobs) > num_lp:
                        logprobs = self._completion_logprobs(output, num_lp, req.logprobs, None, first_offset=chars)
                    if not text and logprobs is None and output.finish_reason is None:
                        continue
                    sent[index] = (len(output.text), len(output.logprobs or []))
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
        if include_usage and finals:
            yield event([], total_usage(finals.values()))
        yield sse("[DONE]")

    def _completion_logprobs(
        self, output: CompletionOutput, start: int, top: int, echo_of: RequestOutput | None, first_offset: int = 0
    ) -> api.CompletionLogprobs:
        result = api.CompletionLogprobs()
        offset = first_offset
        entries: list[tuple[int, dict | None]] = []
        if echo_of is not None:
            prompt_lps = echo_of.prompt_logprobs or [None] * len(echo_of.prompt_token_ids)
            entries.extend(zip(echo_of.prompt_token_ids, prompt_lps))
        entries.extend((output.token_ids[i], output.logprobs[i]) for i in range(start, len(output.logprobs or [])))
        for token_id, entry in entries:
            text, _ = self._token_text(token_id)
            result.tokens.append(text)
            result.text_offset.append(offset)
            offset += len(text)
            if entry is None:
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
                continue
            result.token_logprobs.append(_finite(entry[token_id].logprob))
            tops = sorted((lp for lp in entry.values() if lp.rank <= top), key=lambda lp: lp.rank)[:top]
            result.top_logprobs.append({self._token_text(lp.token_id)[0]: _finite(lp.logprob) for lp in tops})
        return result

    # ------------------------------------------------------------------ tokens

    async def tokenize(self, req: api.TokenizeRequest) -> api.TokenizeResponse:
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", param="prompt")
        if req.messages is not None:
            if not req.messages:
                raise APIError(400, "messages is empty", param="messages")
            chat = api.ChatCompletionRequest.model_construct(
                messages=req.messages,
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=False,
                chat_template=req.chat_template,
                chat_template_kwargs=req.chat_template_kwargs,
            )
            tokens = await self.render(chat)
        else:
            tokens = self.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return api.TokenizeResponse(count=len(tokens), max_model_len=self.max_model_len, tokens=tokens)

    def detokenize(self, req: api.DetokenizeRequest) -> api.DetokenizeResponse:
        self.check_model(req.model)
        vocab = self.core.vocab_size
        for token in req.tokens:
            if not 0 <= token < vocab:
                raise APIError(400, f"token {token} is not a token id of this model (0..{vocab - 1})", param="tokens")
        return api.DetokenizeResponse(prompt=self.tokenizer.decode(req.tokens, skip_special_tokens=False))

    def models(self) -> api.ModelList:
        # The model's name, never where its files lie on this machine.
        card = api.ModelCard(id=self.model_name, created=self.created, root=self.model_name, max_model_len=self.max_model_len)
        return api.ModelList(data=[card])


class Events:
    """A response's server-sent events. Closing it, even before the first event was
    read, aborts its engine requests (freeing their KV blocks)."""

    def __init__(self, events: AsyncIterator[str], streams: Seq[Any], trackers: Seq[RequestTracker]) -> None:
        self.events = events
        self.streams = streams
        self.trackers = trackers

    def __aiter__(self) -> AsyncIterator[str]:
        return self.events

    async def aclose(self) -> None:
        for stream in self.streams:  # first, and without awaiting: cancellation can't skip it
            stream.close()
        for tracker in self.trackers:
            tracker.close()
        await self.events.aclose()


@dataclass
class ChoiceState:
    """What one streamed choice has sent so far, and its parsers."""

    tool_parser: Any = None
    reasoning_parser: Any = None
    tool_name: str | None = None  # registry names, for errors that name the parser
    reasoning_name: str = ""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    content_text: str = ""  # the answer part, after reasoning (what the tool parser reads)
    num_logprobs: int = 0
    called_tools: bool = False
    done: bool = False

    def call(self, kind: str, method: str, fn, *args) -> Any:
        """A parser's method; an error names the parser and fails only this request."""
        return call_plugin(kind, self.tool_name if kind == "tool_parser" else self.reasoning_name, method, fn, *args)

    def parse(self, delta_text: str, text: str, token_ids: Seq[int], request: Any, final: bool = False) -> DeltaMessage | None:
        """What this update adds to the message; with ``final`` also what the parsers
        held back (the output has ended)."""
        delta_ids = token_ids[len(self.token_ids) :]
        if self.reasoning_parser is None:
            if self.tool_parser is None:
                return DeltaMessage(content=delta_text) if delta_text else None
            return self._tools(delta_text, token_ids, delta_ids, request, final)
        reasoner = self.reasoning_parser
        parts = [
            self.call(
                "reasoning_parser", "extract_streaming", reasoner.extract_streaming, self.text, text, delta_text, self.token_ids, token_ids, delta_ids
            )
        ]
        if final:
            parts.append(self.call("reasoning_parser", "finish_streaming", reasoner.finish_streaming, text))
        message = join_deltas(parts)
        if self.tool_parser is None:
            return message
        # The answer part goes on to the tool parser.
        answer = message.content if message is not None else None
        tools = self._tools(answer or "", token_ids, delta_ids, request, final)
        reasoning = message.reasoning_content if message is not None else None
        return join_deltas([DeltaMessage(reasoning_content=reasoning), tools])

    def _tools(self, delta_text: str, token_ids: Seq[int], delta_ids: Seq[int], request: Any, final: bool) -> DeltaMessage | None:
        previous = self.content_text
        self.content_text += delta_text
        parts = []
        parser = self.tool_parser
        if delta_text:
            parts.append(
                self.call(
                    "tool_parser", "extract_streaming", parser.extract_streaming,
                    previous, self.content_text, delta_text, self.token_ids, token_ids, delta_ids, request,
                )
            )
        if final:
            parts.append(self.call("tool_parser", "finish_streaming", parser.finish_streaming, self.content_text, request))
        message = join_deltas(parts)
        if message is not None and message.tool_calls:
            self.called_tools = True
        return message


def join_deltas(messages: Seq[DeltaMessage | None]) -> DeltaMessage | None:
    """Deltas one after another as one delta (fragments of the same call joined)."""
    content: list[str] = []
    reasoning: list[str] = []
    calls: list[ToolCallDelta] = []
    for message in messages:
        if message is None:
            continue
        content.append(message.content or "")
        reasoning.append(message.reasoning_content or "")
        for call in message.tool_calls:
            if calls and calls[-1].index == call.index:
                last = calls[-1]
                calls[-1] = ToolCallDelta(
                    index=call.index,
                    id=last.id or call.id,
                    name=last.name or call.name,
                    arguments=(last.arguments or "") + (call.arguments or "") if last.arguments or call.arguments else None,
                    type=last.type or call.type,
                )
            else:
                calls.append(call)
    out = DeltaMessage(content="".join(content) or None, reasoning_content="".join(reasoning) or None, tool_calls=calls)
    return None if out.is_empty() else out


def message_dict(message: api.ChatMessage) -> dict[str, Any]:
    """A chat message as the template sees it: text content, OpenAI field names."""
    out = message.model_dump(exclude_none=True)
    content = message.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, api.TextContentPart):
                raise APIError(400, f"this model reads text only; a {part.type!r} content part cannot be used", param="messages")
            texts.append(part.text)
        out["content"] = "\n".join(texts)
    else:
        out["content"] = content
    for call in out.get("tool_calls") or []:
        # OpenAI sends arguments as JSON text; templates (Hugging Face's among them)
        # write them with `| tojson`, which would quote the text again: give them
        # the object. Text that is not a JSON object stays as it is.
        function = call["function"]
        try:
            arguments = json.loads(function["arguments"])
        except ValueError:
            continue
        if isinstance(arguments, dict):
            function["arguments"] = arguments
    return out


def usage(final: RequestOutput) -> api.UsageInfo:
    prompt = len(final.prompt_token_ids)
    completion = sum(len(o.token_ids) for o in final.outputs)
    return api.UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def total_usage(finals) -> api.UsageInfo:
    parts = [usage(f) for f in finals]
    return api.UsageInfo(
        prompt_tokens=sum(u.prompt_tokens for u in parts),
        completion_tokens=sum(u.completion_tokens for u in parts),
        total_tokens=sum(u.total_tokens for u in parts),
    )


async def collect(stream: AsyncIterator[RequestOutput], tracker: RequestTracker) -> RequestOutput:
    """The final output of a request; leaving early (a cancelled task) aborts it."""
    final = None
    try:
        async for _, out in merge([stream], [tracker]):
            final = out
    except Exception as exc:  # the engine died, or the stream ended in an error
        raise as_api_error(exc) from None
    if final is None or not final.finished:
        raise APIError(503, "the engine stopped before the request finished", code="engine_dead")
    check_output(final)
    return final


def check_output(out: RequestOutput) -> None:
    """Raise the APIError of a request that failed in the engine: 400 when it was the
    request's own doing (a grammar over its time budget), else 500 naming the fault."""
    if out.error is None:
        return
    if out.error_kind == "invalid_request":
        raise APIError(400, out.error, param="structured_outputs" if out.error.startswith("structured_outputs") else None)
    raise APIError(500, out.error, code="request_failed")


def as_api_error(exc: BaseException) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), code="engine_dead")
    if isinstance(exc, PluginCallError):
        return APIError(500, str(exc), code="plugin_error")
    logger.error("a request failed", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error")


def error_event(exc: BaseException) -> str:
    """The server-sent event that tells a streaming client its request failed."""
    return sse(as_api_error(exc).body().model_dump_json())


async def merge(streams, trackers) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several requests as they come, tagged with the request's index."""
    if len(streams) == 1:
        try:
            async with aclosing(streams[0]):
                async for out in streams[0]:
                    trackers[0].update(out)
                    yield 0, out
        finally:
            trackers[0].close()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int) -> None:
        try:
            async with aclosing(streams[index]):
                async for out in streams[index]:
                    trackers[index].update(out)
                    await queue.put((index, out))
        except BaseException as exc:  # handed to the consumer
            await queue.put((index, exc))
        finally:
            trackers[index].close()
            await queue.put((index, None))

    tasks = [asyncio.create_task(pump(i)) for i in range(len(streams))]
    remaining = len(tasks)
    try:
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _prompt_list(prompt) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "the prompt is empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return list(prompt)


def _finite(value: float) -> float:
    """JSON has no -inf: a token the model gives zero probability gets the lowest float."""
    return value if value > float("-inf") else -9999.0

