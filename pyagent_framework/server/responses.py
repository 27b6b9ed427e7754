"""OpenAI's Responses API (``POST /v1/responses``, ``GET`` and ``DELETE
/v1/responses/{id}``) over the chat machinery.

A Responses request becomes a chat request: ``instructions`` a first system message,
the ``input`` items (and, with ``previous_response_id``, the stored conversation
before them) chat messages, ``function_call`` items an assistant's tool calls and
``function_call_output`` items tool messages; the function tools, ``tool_choice`` and
``text.format`` the chat fields of the same meaning. From there the chat path runs
unchanged (:meth:`ChatMixin._start_chat`: template, sampling caps, tool-call and
reasoning parsers, structured output), and what the parsers read comes back as output
items: ``reasoning``, ``message`` (``output_text``) and ``function_call``.

A stream is OpenAI's typed events, numbered by ``sequence_number``: ``response.created``,
``response.in_progress``, per item ``output_item.added`` / ``content_part.added`` /
deltas / ``...done``, then ``response.completed`` (``response.incomplete`` when
``max_output_tokens`` cut it short), or an ``error`` event when the request fails.

Stored responses (``store``, on by default) live in a :class:`ResponseStore`: at most
``--max-stored-responses`` of them, least recently used evicted first. Each keeps its
whole conversation as a tuple of the items of every turn before it and its own (the
item objects are shared with the responses it continues, not copied), so a later
request names it and goes on from there. Each turn adds at most one request body
(``--max-request-body``) and one output (the context window); a conversation whose
rendered prompt no longer fits the window is refused, and so never stored.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from pyagent_framework.engine.outputs import CompletionOutput, ParsedMessage
from pyagent_framework.server import protocol as api
from pyagent_framework.server.errors import APIError
from pyagent_framework.server.streaming import Events, as_api_error, check_output, collect, merge, streamed_usage

# ---------------------------------------------------------------------- request

#: Most metadata pairs, and the longest key and value (OpenAI's limits).
MAX_METADATA = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512

INPUT_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
CONTENT_PART_TYPES = ("input_text", "output_text")


class TextPart(api.OpenAIModel):
    """A text part of a message (``input_text`` from a client, ``output_text`` as an
    earlier response's message carried it)."""

    type: Literal["input_text", "output_text"]
    text: str


class MessageItem(api.OpenAIModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(api.OpenAIModel):
    """A call the model made (from an earlier output), sent back with its result."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(api.OpenAIModel):
    """A function's result for the call ``call_id``."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]
    id: str | None = None
    status: str | None = None


class ReasoningPart(api.OpenAIModel):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(api.OpenAIModel):
    """Reasoning from an earlier output: given to the next assistant message."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningPart] = Field(default_factory=list)
    content: list[ReasoningPart] | None = None
    status: str | None = None


InputItem = Annotated[Union[MessageItem, FunctionCallItem, FunctionCallOutputItem, ReasoningItem], Field(discriminator="type")]


class FunctionTool(api.OpenAIModel):
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(api.OpenAIModel):
    type: Literal["function"]
    name: str


class TextFormat(api.OpenAIModel):
    """``text.format``: ``text``, ``json_object``, or ``json_schema`` with the schema
    at ``schema`` (and ``name``, ``description``, ``strict``)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True, serialize_by_alias=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(api.OpenAIModel):
    format: TextFormat | None = None


def _refuse(field: str, message: str) -> PydanticCustomError:
    # "unsupported_field": the app answers it with a 400 naming the field.
    return PydanticCustomError("unsupported_field", "{field}: " + message, {"field": field})


class ResponsesRequest(api.RequestBody):
    """The body of ``POST /v1/responses`` (the fields this server implements, plus
    vLLM's sampling extras ``top_k``, ``min_p``, ``repetition_penalty``, ``seed``,
    ``ignore_eos``, ``priority``). Item, part and tool types it does not implement are 400s naming them."""

    implemented: ClassVar[frozenset[str]] = frozenset()

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    tools: list[FunctionTool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    store: bool = True
    previous_response_id: str | None = Field(default=None, max_length=256)
    metadata: dict[str, str] | None = None
    stream: bool = False
    # vLLM-style extras
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    priority: int = 0
    # OpenAI fields this server does not implement: refused when set.
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None

    @model_validator(mode="before")
    @classmethod
    def _check_types(cls, data: Any) -> Any:
        """Types this server does not serve are 400s naming where they are; a message
        item may leave out its ``type``."""
        if not isinstance(data, dict):
            return data
        items = data.get("input")
        if isinstance(items, list):
            data = dict(data)
            data["input"] = items = list(items)
            for i, item in enumerate(items):
                if not isinstance(item, dict):
                    continue
                kind = item.get("type")
                if kind is None and "role" in item:
                    items[i] = item = {**item, "type": "message"}
                    kind = "message"
                if kind not in INPUT_ITEM_TYPES:
                    raise _refuse(f"input[{i}].type", f"an input item of type {kind!r} is not supported (use one of {', '.join(INPUT_ITEM_TYPES)})")
                parts = item.get("content") if kind == "message" else item.get("output") if kind == "function_call_output" else None
                if isinstance(parts, list):
                    where = "content" if kind == "message" else "output"
                    for j, part in enumerate(parts):
                        if isinstance(part, dict) and part.get("type") not in CONTENT_PART_TYPES:
                            raise _refuse(f"input[{i}].{where}[{j}].type",
                                          f"this model reads text only: a {part.get('type')!r} part cannot be used (use input_text)")
        tools = data.get("tools")
        if isinstance(tools, list):
            for i, tool in enumerate(tools):
                if isinstance(tool, dict) and tool.get("type") != "function":
                    raise _refuse(f"tools[{i}].type", f"only function tools are supported, not {tool.get('type')!r}")
        choice = data.get("tool_choice")
        if isinstance(choice, dict) and choice.get("type") != "function":
            raise _refuse("tool_choice.type", f"only a function may be chosen, not {choice.get('type')!r}")
        for name in ("background", "conversation", "prompt"):
            if data.get(name) not in (None, False):
                raise _refuse(name, "this server does not implement this field; leave it out")
        return data


# ---------------------------------------------------------------------- response


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(BaseModel):
    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = Annotated[Union[OutputMessage, OutputFunctionCall, OutputReasoning], Field(discriminator="type")]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"] | None = None


class ToolOut(BaseModel):
    type: Literal["function"] = "function"
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseObject(BaseModel):
    """A response, as ``POST /v1/responses`` and ``GET /v1/responses/{id}`` return it."""

    model_config = ConfigDict(serialize_by_alias=True)
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    error: dict[str, Any] | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice
    tools: list[ToolOut]
    text: TextConfig
    store: bool
    metadata: dict[str, str] = Field(default_factory=dict)
    usage: ResponseUsage | None = None
    user: str | None = None
    truncation: Literal["disabled"] = "disabled"
    background: bool = False


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True


# ---------------------------------------------------------------------- store


@dataclass(frozen=True)
class StoredResponse:
    response: ResponseObject
    #: Every turn's input and output items up to and including this response's
    #: (its instructions excepted: they hold for one request only, as OpenAI's do).
    conversation: tuple[Any, ...]


class ResponseStore:
    """At most ``capacity`` stored responses, the least recently used (stored or read)
    evicted first. The event loop is its only user: no lock."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def ids(self) -> list[str]:
        """Least recently used first."""
        return list(self._entries)

    def put(self, entry: StoredResponse) -> None:
        if self.capacity <= 0:
            return
        self._entries[entry.response.id] = entry
        self._entries.move_to_end(entry.response.id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None


def not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(404, f"no response with id {response_id!r} is stored on this server (it was never stored, "
                         "was deleted, or was evicted)", param=param, code="response_not_found")


# ---------------------------------------------------------------------- conversion


def _text(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "\n".join(part.text for part in content)


def chat_messages(instructions: str | None, items) -> list[dict[str, Any]]:
    """The conversation as chat messages: consecutive function calls (and the message
    before them from the same assistant turn) are one assistant message's tool calls;
    a reasoning item goes with the assistant message after it."""
    messages: list[dict[str, Any]] = []
    if instructions is not None:
        messages.append({"role": "system", "content": instructions})
    reasoning: str | None = None
    for item in items:
        if isinstance(item, ReasoningItem):
            parts = item.content if item.content else item.summary
            reasoning = "\n".join(p.text for p in parts) or None
        elif isinstance(item, MessageItem):
            message: dict[str, Any] = {"role": item.role, "content": _text(item.content)}
            if item.role == "assistant" and reasoning is not None:
                message["reasoning_content"], reasoning = reasoning, None
            messages.append(message)
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": None}
                if reasoning is not None:
                    last["reasoning_content"], reasoning = reasoning, None
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
    return messages


def as_input_item(item: BaseModel):
    """An output item as the input item a later turn reads."""
    if isinstance(item, OutputMessage):
        return MessageItem(role="assistant", content=[TextPart(type="output_text", text=p.text) for p in item.content], id=item.id)
    if isinstance(item, OutputFunctionCall):
        return FunctionCallItem(type="function_call", call_id=item.call_id, name=item.name, arguments=item.arguments, id=item.id)
    return ReasoningItem(type="reasoning", id=item.id, content=[ReasoningPart(type="reasoning_text", text=p.text) for p in item.content])


# Chat fields the chat path names in its errors -> this API's names.
PARAM_NAMES = {"messages": "input", "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
               "response_format": "text.format", "response_format.json_schema": "text.format.schema"}


def renamed(exc: APIError) -> APIError:
    """The error with the field named as this API names it."""
    if exc.param in PARAM_NAMES:
        old, exc.param = exc.param, PARAM_NAMES[exc.param]
        exc.message = re.sub(rf"\b{re.escape(old)}\b", exc.param, exc.message)
        exc.args = (exc.message,)
    return exc


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


# ---------------------------------------------------------------------- serving


class ResponsesMixin:
    """:class:`~pyagent_framework.server.serving.OpenAIServing`'s ``/v1/responses``;
    runs the chat path (``_start_chat``) and keeps ``response_store``."""

    async def responses(self, req: ResponsesRequest) -> ResponseObject | Events:
        self.check_model(req.model)
        self.check_generates()
        if req.metadata is not None:
            self._check_metadata(req.metadata)
        previous = None
        if req.previous_response_id is not None:
            previous = self.response_store.get(req.previous_response_id)
            if previous is None:
                raise not_found(req.previous_response_id, "previous_response_id")
        new_items = [MessageItem(role="user", content=req.input)] if isinstance(req.input, str) else list(req.input)
        conversation = (previous.conversation if previous else ()) + tuple(new_items)
        chat = self._as_chat_request(req, chat_messages(req.instructions, conversation))
        try:
            chat, stream, tracker = await self._start_chat(chat)
        except APIError as exc:
            raise renamed(exc) from None
        response_id = _item_id("resp")
        created = int(time.time())
        if req.stream:
            events = self._responses_stream(req, response_id, created, conversation, stream, tracker)
            return Events(events, [stream], [tracker])
        try:
            final = await collect(stream, tracker)
        except APIError as exc:
            raise renamed(exc) from None
        output = self._output_items(final.outputs[0])
        body = self._response_object(req, response_id, created, _status(final.outputs[0].finish_reason), output,
                                     self._usage(len(final.prompt_token_ids), len(final.outputs[0].token_ids), output))
        self._store(req, body, conversation)
        return body

    def retrieve_response(self, response_id: str) -> ResponseObject:
        entry = self.response_store.get(response_id)
        if entry is None:
            raise not_found(response_id)
        return entry.response

    def delete_response(self, response_id: str) -> DeletedResponse:
        if not self.response_store.delete(response_id):
            raise not_found(response_id)
        return DeletedResponse(id=response_id)

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def _check_metadata(metadata: dict[str, str]) -> None:
        if len(metadata) > MAX_METADATA:
            raise APIError(400, f"metadata may have at most {MAX_METADATA} pairs, got {len(metadata)}", param="metadata")
        for key, value in metadata.items():
            if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
                raise APIError(400, f"metadata keys may be at most {MAX_METADATA_KEY} characters and values "
                                    f"{MAX_METADATA_VALUE}; {key[:80]!r} is longer", param="metadata")

    def _as_chat_request(self, req: ResponsesRequest, messages: list[dict[str, Any]]) -> api.ChatCompletionRequest:
        body: dict[str, Any] = {
            "model": req.model, "messages": messages, "max_completion_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "user": req.user, "stream": req.stream,
            "parallel_tool_calls": req.parallel_tool_calls, "seed": req.seed, "top_k": req.top_k, "min_p": req.min_p,
            "repetition_penalty": req.repetition_penalty, "ignore_eos": req.ignore_eos, "priority": req.priority,
        }
        if req.tools:
            body["tools"] = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})} for t in req.tools]
        if isinstance(req.tool_choice, FunctionToolChoice):
            body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
        else:
            body["tool_choice"] = req.tool_choice
        fmt = req.text.format if req.text is not None else None
        if fmt is not None and fmt.type == "json_object":
            body["response_format"] = {"type": "json_object"}
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.schema_ is None:
                raise APIError(400, 'text.format type "json_schema" needs a schema', param="text.format.schema")
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict}}
        try:
            return api.ChatCompletionRequest.model_validate(body)
        except ValidationError as exc:  # the conversation has a shape chat refuses (say, no message at all)
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first.get("loc", ()))
            raise APIError(400, f"the input does not make a conversation: {where}: {first.get('msg')}", param="input") from None

    def _output_items(self, output: CompletionOutput) -> list[BaseModel]:
        message = output.message or ParsedMessage(content=output.text)
        status = _status(output.finish_reason)
        items: list[BaseModel] = []
        if message.reasoning_content:
            items.append(OutputReasoning(id=_item_id("rs"), content=[ReasoningText(text=message.reasoning_content)], status=status))
        if message.content or not message.tool_calls:
            items.append(OutputMessage(id=_item_id("msg"), status=status, content=[OutputText(text=message.content or "")]))
        for call in message.tool_calls:
            items.append(OutputFunctionCall(id=_item_id("fc"), call_id=call.id, name=call.name, arguments=call.arguments, status="completed"))
        return items

    def _usage(self, prompt_tokens: int, output_tokens: int, items) -> ResponseUsage:
        # Reasoning tokens: the reasoning text encoded again (the parser splits text, not tokens).
        reasoning = sum(len(self.tokenizer.encode(i.content[0].text, add_special_tokens=False)) for i in items if isinstance(i, OutputReasoning))
        return ResponseUsage(input_tokens=prompt_tokens, output_tokens=output_tokens, total_tokens=prompt_tokens + output_tokens,
                             output_tokens_details=OutputTokensDetails(reasoning_tokens=min(reasoning, output_tokens)))

    def _response_object(self, req: ResponsesRequest, response_id: str, created: int, status: str, output, usage) -> ResponseObject:
        fmt = req.text.format if req.text is not None and req.text.format is not None else TextFormat(type="text")
        if fmt.type == "json_schema" and fmt.name is None:
            fmt = fmt.model_copy(update={"name": "response"})  # the name the chat path gave it
        return ResponseObject(
            id=response_id, created_at=created, status=status, model=req.model or self.model_name, output=output,
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None,
            instructions=req.instructions, max_output_tokens=req.max_output_tokens,
            parallel_tool_calls=req.parallel_tool_calls is not False, previous_response_id=req.previous_response_id,
            temperature=req.temperature, top_p=req.top_p, tool_choice=req.tool_choice or "auto",
            tools=[ToolOut(**t.model_dump(exclude={"type"})) for t in req.tools or []], text=TextConfig(format=fmt),
            store=req.store, metadata=req.metadata or {}, usage=usage, user=req.user,
        )

    def _store(self, req: ResponsesRequest, body: ResponseObject, conversation: tuple) -> None:
        if req.store:
            self.response_store.put(StoredResponse(body, conversation + tuple(as_input_item(i) for i in body.output)))

    async def _responses_stream(self, req, response_id, created, conversation, stream, tracker) -> AsyncIterator[str]:
        events = ResponseEvents()
        start = self._response_object(req, response_id, created, "in_progress", [], None)
        yield events.emit("response.created", response=start)
        yield events.emit("response.in_progress", response=start)
        finish_reason = None
        try:
            async for _, out in merge([stream], [tracker]):
                check_output(out)
                output = out.outputs[0]
                for event in events.update(output):
                    yield event
                finish_reason = output.finish_reason or finish_reason
        except Exception as exc:  # the request failed: the error event ends the stream
            error = renamed(as_api_error(exc))
            yield events.emit("error", code=error.code, message=error.message, param=error.param)
            return
        status = _status(finish_reason)
        for event in events.finish(status):
            yield event
        usage = streamed_usage([tracker])
        body = self._response_object(req, response_id, created, status, events.items,
                                     self._usage(usage.prompt_tokens, usage.completion_tokens, events.items))
        self._store(req, body, conversation)
        yield events.emit("response.incomplete" if status == "incomplete" else "response.completed", response=body)


class ResponseEvents:
    """The typed events of one streamed response, built from the parsers' deltas: at
    most one output item is open at a time (reasoning, the message, or one function
    call); the next kind of delta closes it."""

    def __init__(self) -> None:
        self.sequence = 0
        self.items: list[BaseModel] = []  # closed items, in output order
        self.open: BaseModel | None = None
        self.open_call: int | None = None  # the tool-call index of an open function call
        self.text = ""

    def emit(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.sequence}
        for key, value in fields.items():
            body[key] = value.model_dump(mode="json") if isinstance(value, BaseModel) else value
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    @property
    def index(self) -> int:  # the open item's output_index
        return len(self.items)

    def update(self, output: CompletionOutput) -> list[str]:
        message = output.message_delta
        if message is None:
            return []
        out: list[str] = []
        if message.reasoning_content:
            out += self._delta(OutputReasoning, message.reasoning_content)
        if message.content:
            out += self._delta(OutputMessage, message.content)
        for call in message.tool_calls:
            if self.open_call != call.index:
                out += self._close("completed")
                self.open = OutputFunctionCall(id=_item_id("fc"), call_id=call.id or f"call_{uuid.uuid4().hex[:24]}",
                                               name=call.name or "", arguments="", status="in_progress")
                self.open_call = call.index
                self.text = ""
                out.append(self.emit("response.output_item.added", output_index=self.index, item=self.open))
            if call.arguments:
                self.text += call.arguments
                out.append(self.emit("response.function_call_arguments.delta", item_id=self.open.id, output_index=self.index,
                                     delta=call.arguments))
        return out

    def _delta(self, kind: type, delta: str) -> list[str]:
        out: list[str] = []
        if not isinstance(self.open, kind):
            out += self._close("completed")
            out += self._open(kind)
        self.text += delta
        name = "response.reasoning_text.delta" if kind is OutputReasoning else "response.output_text.delta"
        extra = {} if kind is OutputReasoning else {"logprobs": []}
        out.append(self.emit(name, item_id=self.open.id, output_index=self.index, content_index=0, delta=delta, **extra))
        return out

    def _open(self, kind: type) -> list[str]:
        self.text = ""
        self.open_call = None
        if kind is OutputReasoning:
            self.open = OutputReasoning(id=_item_id("rs"), content=[], status="in_progress")
            part = ReasoningText(text="")
        else:
            self.open = OutputMessage(id=_item_id("msg"), status="in_progress", content=[])
            part = OutputText(text="")
        return [self.emit("response.output_item.added", output_index=self.index, item=self.open),
                self.emit("response.content_part.added", item_id=self.open.id, output_index=self.index, content_index=0, part=part)]

    def _close(self, status: str) -> list[str]:
        item, self.open, self.open_call = self.open, None, None
        if item is None:
            return []
        index, text, out = len(self.items), self.text, []
        if isinstance(item, OutputFunctionCall):
            item = item.model_copy(update={"arguments": text, "status": "completed"})
            out.append(self.emit("response.function_call_arguments.done", item_id=item.id, output_index=index, arguments=text))
        elif isinstance(item, OutputReasoning):
            part = ReasoningText(text=text)
            item = item.model_copy(update={"content": [part], "status": status})
            out.append(self.emit("response.reasoning_text.done", item_id=item.id, output_index=index, content_index=0, text=text))
            out.append(self.emit("response.content_part.done", item_id=item.id, output_index=index, content_index=0, part=part))
        else:
            part = OutputText(text=text)
            item = item.model_copy(update={"content": [part], "status": status})
            out.append(self.emit("response.output_text.done", item_id=item.id, output_index=index, content_index=0, text=text, logprobs=[]))
            out.append(self.emit("response.content_part.done", item_id=item.id, output_index=index, content_index=0, part=part))
        out.append(self.emit("response.output_item.done", output_index=index, item=item))
        self.items.append(item)
        return out

    def finish(self, status: str) -> list[str]:
        """Close the open item; a response with neither a message nor a call gets an
        empty message, as a whole response does."""
        out = self._close(status)
        if not any(isinstance(i, (OutputMessage, OutputFunctionCall)) for i in self.items):
            out += self._open(OutputMessage)
            out += self._close(status)
        return out
