"""Request and response bodies of the OpenAI-compatible API (pydantic models, so
``/openapi.json`` describes exactly what the server accepts and returns).

Field names, defaults and shapes follow OpenAI's API; the sampling extras (``top_k``,
``min_p``, ``repetition_penalty``, ``ignore_eos``, ``min_tokens``, ...) follow vLLM's.
Types are checked here (a wrong type is a 422); ranges and caps are checked when the
request is turned into :class:`SamplingParams` (a bad value is a 400 naming the field).
"""

from __future__ import annotations

import time
from typing import Any, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError


class OpenAIModel(BaseModel):
    # Unknown fields are ignored, as OpenAI's API does, so newer clients keep working.
    model_config = ConfigDict(extra="ignore")


MAX_CHECKED_DEPTH = 64

# vLLM request fields this server does not implement, with the value that means "not
# used": a request that sets one to anything else is refused (400 naming the field),
# never served as if the field were not there.
UNSUPPORTED_FIELDS: dict[str, Any] = {
    "use_beam_search": False,
    "length_penalty": 1.0,
    "truncate_prompt_tokens": None,
    "spaces_between_special_tokens": True,
    "guided_whitespace_pattern": None,
    "logits_processors": None,
    "return_tokens_as_token_ids": False,
    "return_token_ids": False,
    "prompt_embeds": None,
    "documents": None,
    "mm_processor_kwargs": None,
    "kv_transfer_params": None,
    "vllm_xargs": None,
}


class RequestBody(OpenAIModel):
    """A request body: every string in it must be valid Unicode (a JSON string may
    carry a lone surrogate such as "\\ud800", which no tokenizer can encode), and no
    vLLM field this server does not implement may be set. Both are 400s naming where."""

    #: Fields of UNSUPPORTED_FIELDS that this body does implement.
    implemented: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _check_body(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, unused in UNSUPPORTED_FIELDS.items():
                if name in cls.implemented:
                    continue
                value = data.get(name, unused)
                if value != unused and value not in (None, [], {}):
                    raise PydanticCustomError(
                        "unsupported_field",
                        "{field}: this server does not implement this vLLM field; leave it out",
                        {"field": name},
                    )
        _check_unicode(data, ())
        return data


def _check_unicode(value: Any, path: tuple, depth: int = 0) -> None:
    if isinstance(value, str):
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:
                where = ".".join(str(p) for p in path) or "body"
                raise PydanticCustomError(
                    "invalid_unicode",
                    "{where}: the string is not valid Unicode (a lone surrogate, {code} at character {index})",
                    {"where": where, "code": f"\\u{ord(value[exc.start]):04x}", "index": exc.start},
                ) from None
    elif depth < MAX_CHECKED_DEPTH:
        if isinstance(value, dict):
            for key, item in value.items():
                _check_unicode(key, path, depth + 1)
                _check_unicode(item, (*path, key), depth + 1)
        elif isinstance(value, list):
            for index, item in enumerate(value):
                _check_unicode(item, (*path, index), depth + 1)


# ---------------------------------------------------------------------- errors


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ---------------------------------------------------------------------- shared


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(OpenAIModel):
    """OpenAI's ``response_format.json_schema``: the schema sits under ``schema``."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    # structural_tag, in vLLM's form (structures, triggers) or xgrammar's (format)
    structures: list[Any] | None = None
    triggers: list[Any] | None = None
    format: dict[str, Any] | None = None


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class LogitsProcessorField(OpenAIModel):
    """One entry of ``logits_processors``: a registered logits processor's name and
    the arguments it is built with."""

    name: str
    args: dict[str, Any] | None = None


class SamplingFields(RequestBody):
    """The sampling fields both endpoints share."""

    implemented: ClassVar[frozenset[str]] = frozenset({"logits_processors"})

    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM-style extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    cache_salt: str | None = None
    priority: int = 0
    speculative: bool = True  # false: no speculative drafts for this request
    response_format: ResponseFormat | None = None
    # vLLM's extra: exactly one of json, json_object, regex, choice, grammar, structural_tag; optional backend
    structured_outputs: dict[str, Any] | None = None
    # vLLM's older names for the same, mapped onto structured_outputs
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structural_tag: dict[str, Any] | str | None = None  # vLLM's top-level field, JSON text or an object
    guided_decoding_backend: str | None = None
    # vLLM's extra: the top logprobs of every prompt token (not with stream=true)
    prompt_logprobs: int | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    # registered logits processors, applied in order: [{"name": "no_repeat_ngram", "args": {"n": 3}}] (or bare names)
    logits_processors: list[Union[str, LogitsProcessorField]] | None = None


# ---------------------------------------------------------------------- chat


class TextContentPart(OpenAIModel):
    type: Literal["text"]
    text: str


class OtherContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str


class FunctionCall(OpenAIModel):
    name: str
    arguments: str


class ToolCallMessage(OpenAIModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[Union[TextContentPart, OtherContentPart]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class FunctionDefinition(OpenAIModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")  # as OpenAI's: a chat template embeds it verbatim
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedToolChoiceFunction(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"] = "function"
    function: NamedToolChoiceFunction


class ChatCompletionRequest(SamplingFields):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ChatTool] | None = Field(default=None, max_length=128)  # OpenAI's cap
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] = Field(default_factory=list)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class PromptLogprob(BaseModel):
    """vLLM's shape of one alternative at one prompt position."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One entry per prompt token (None for the first): token id -> its logprob.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDeltaOut(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta | None = None


class DeltaOut(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDeltaOut] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaOut
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


# ---------------------------------------------------------------------- completions


class CompletionRequest(SamplingFields):
    model: str | None = None
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True
    # vLLM's beam search: beam_width (else best_of, else n) beams; the n best are returned
    implemented: ClassVar[frozenset[str]] = SamplingFields.implemented | {"use_beam_search", "length_penalty"}
    use_beam_search: bool = False
    beam_width: int | None = None
    length_penalty: float = 1.0


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# ---------------------------------------------------------------------- misc


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pyagent"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None


class LoadLoRAAdapterRequest(RequestBody):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRAAdapterRequest(RequestBody):
    lora_name: str = Field(min_length=1, max_length=256)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(RequestBody):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class HealthResponse(BaseModel):
    status: Literal["ok"] = "ok"


# ---------------------------------------------------------------------- embeddings

#: Most inputs in one embeddings request (OpenAI's own limit).
MAX_EMBEDDING_INPUTS = 2048


class EmbeddingRequest(RequestBody):
    """OpenAI's ``/v1/embeddings`` body, with vLLM's ``truncate_prompt_tokens``,
    ``normalize`` and ``add_special_tokens``."""

    implemented: ClassVar[frozenset[str]] = frozenset({"truncate_prompt_tokens"})

    input: Union[str, list[str], list[int], list[list[int]]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None
    normalize: bool | None = None
    add_special_tokens: bool = True
    priority: int = 0


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: Union[list[float], str]  # base64: little-endian float32


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage
