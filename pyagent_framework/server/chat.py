"""The chat-completions endpoint, whole or streamed: tool choice, which parsers read
each choice (the front end runs them), and the response or its chunks."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pyagent_framework.engine.faults import call_plugin
from pyagent_framework.engine.output_parsers import NAMED_TOOL_CALL, REQUIRED_TOOL_CALLS, OutputParsers
from pyagent_framework.engine.outputs import CompletionOutput, ParsedMessage, RequestOutput
from pyagent_framework.server import protocol as api
from pyagent_framework.server import tool_choice
from pyagent_framework.server.errors import APIError
from pyagent_framework.server.streaming import Events, check_output, collect, error_event, merge, sse, streamed_usage, usage


class ChatMixin:
    """:class:`~pyagent_framework.server.serving.OpenAIServing`'s ``chat``; uses its
    model check, rendering, sampling and logprob helpers, ``_start`` and metrics."""

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
            if not (self.config.enable_auto_tool_choice and self.config.tool_call_parser):
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

    def _parsers(self, mode: str | None, request_dict: dict[str, Any]) -> OutputParsers:
        """The parsers that read each choice: the tool-call reader for the tool mode and
        the server's reasoning parser."""
        tool = {"auto": self.config.tool_call_parser, "required": REQUIRED_TOOL_CALLS, "named": NAMED_TOOL_CALL}.get(mode)
        return OutputParsers(tool_parser=tool, reasoning_parser=self.config.reasoning_parser, request=request_dict)

    async def chat(self, req: api.ChatCompletionRequest) -> api.ChatCompletionResponse | AsyncIterator[str]:
        req, stream, tracker = await self._start_chat(req)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        if req.stream:
            return Events(self._chat_stream(req, request_id, stream, tracker), [stream], [tracker])
        final = await collect(stream, tracker)
        return self._chat_response(req, request_id, final)

    async def _start_chat(self, req: api.ChatCompletionRequest):
        """Check, render and queue a chat request (also what ``/v1/responses`` runs):
        the request as the parsers adjusted it, its output stream and its tracker."""
        lora = self.check_model(req.model)
        self.check_generates()
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        mode, schema = self._tool_mode(req)
        if self.config.reasoning_parser:
            req = self._adjusted(req, "reasoning_parser", self.config.reasoning_parser, self.reasoning_parser_cls)
        if mode == "auto":
            req = self._adjusted(req, "tool_parser", self.config.tool_call_parser, self.tool_parser_cls)
        prompt_ids = await self.render(req)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = self.sampling_params(
            req, max_tokens=max_tokens, prompt_len=len(prompt_ids), logprobs=logprobs, prompt_param="messages"
        )
        if schema is not None:
            params = dataclasses.replace(params, structured_outputs={"json": schema})
        # The grammar, if any, constrains the answer only: the front end and the core
        # ask the reasoning parser where the reasoning ends.
        parsers = self._parsers(mode, req.model_dump(exclude_none=True))
        stream = await self._start(prompt_ids, params, req.cache_salt, parsers=parsers, param="tools" if schema else None, lora=lora,
                                   tenant=self.tenant_of(req.user))
        tracker = self.metrics.track(len(prompt_ids), delta=bool(req.stream))
        return req, stream, tracker

    def _adjusted(self, req: api.ChatCompletionRequest, kind: str, name: str, cls: type) -> api.ChatCompletionRequest:
        """The request as a parser wants it (e.g. special tokens kept)."""
        before = req.model_dump()
        parser = call_plugin(kind, name, "__init__", cls, self.tokenizer)
        after = call_plugin(kind, name, "adjust_request", parser.adjust_request, dict(before))
        updates = {k: v for k, v in after.items() if k in type(req).model_fields and v != before.get(k)}
        return req.model_copy(update=updates) if updates else req

    def _chat_response(self, req, request_id: str, final: RequestOutput) -> api.ChatCompletionResponse:
        out_choices = []
        for output in final.outputs:
            # What the parsers read: content, reasoning, tool calls (a sample cut short by
            # the engine's shutdown has only its text).
            message = output.message or ParsedMessage(content=output.text)
            tool_calls = [
                api.ToolCallOut(id=c.id, function=api.FunctionCall(name=c.name, arguments=c.arguments)) for c in message.tool_calls
            ]
            finish_reason = output.finish_reason
            if tool_calls and finish_reason == "stop":
                finish_reason = "tool_calls"
            out_choices.append(
                api.ChatChoice(
                    index=output.index,
                    message=api.ChatResponseMessage(
                        content=message.content, reasoning_content=message.reasoning_content, tool_calls=tool_calls
                    ),
                    logprobs=self._chat_logprobs(output, 0, req.top_logprobs or 0) if req.logprobs else None,
                    finish_reason=finish_reason,
                    stop_reason=output.stop_reason,
                )
            )
        return api.ChatCompletionResponse(
            id=request_id, model=self.served_as(req.model), choices=out_choices, usage=usage(final), prompt_logprobs=self._prompt_logprobs(req, final)
        )

    async def _chat_stream(self, req, request_id, stream, tracker) -> AsyncIterator[str]:
        created = int(time.time())
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = include_usage and bool(req.stream_options.continuous_usage_stats)

        def chunk(stream_choices, usage_info=None) -> str:
            body = api.ChatCompletionChunk(id=request_id, created=created, model=self.served_as(req.model), choices=stream_choices, usage=usage_info)
            return sse(body.model_dump_json())

        for index in range(req.n):
            yield chunk([api.ChatStreamChoice(index=index, delta=api.DeltaOut(role="assistant", content=""))])
        final = None
        done: set[int] = set()  # choices whose finish went out
        called: set[int] = set()  # choices that sent a tool call
        try:
            async for _, out in merge([stream], [tracker]):
                final = out
                check_output(out)
                pieces = []
                for output in out.outputs:
                    piece = self._chat_delta(req, output, done, called)
                    if piece is not None:
                        pieces.append(piece)
                if pieces:
                    yield chunk(pieces, streamed_usage([tracker]) if continuous else None)
        except Exception as exc:  # the request failed: an error event, then the end of the stream
            yield error_event(exc)
            yield sse("[DONE]")
            return
        if include_usage and final is not None:
            yield chunk([], streamed_usage([tracker]))
        yield sse("[DONE]")

    def _chat_delta(self, req, output: CompletionOutput, done: set[int], called: set[int]) -> api.ChatStreamChoice | None:
        """What one choice adds in this update, or None."""
        if output.index in done:
            return None
        # A delta output: the text, token ids, logprobs and parsed message new since the last one.
        message = output.message_delta
        if message is not None and message.tool_calls:
            called.add(output.index)
        logprobs = None
        if req.logprobs and output.logprobs:
            logprobs = self._chat_logprobs(output, 0, req.top_logprobs or 0)
        finish_reason = output.finish_reason
        if finish_reason is not None:
            done.add(output.index)
            if output.index in called and finish_reason == "stop":
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
