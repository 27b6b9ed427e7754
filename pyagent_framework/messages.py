"""The messages between the front end and the engine core, declared once.

The front end (tokenization, templates, detokenization, parsers) and the engine core
(scheduler, KV cache, model, sampler) exchange only these types, whether the core runs
in the caller's process or in its own. Across a process they travel as msgpack over
ZMQ through :class:`Codec`, which decodes into these types and nothing else: no message
is ever pickled, and an object that is not one of them is refused, not serialised.

- to the core: :class:`AddRequests` (of :class:`AddRequest`), :class:`AbortRequests`, :class:`UtilityCall`,
  :class:`Shutdown`;
- from the core: :class:`CoreReady` once it is built, then :class:`CoreOutputs` (each
  step's new tokens: deltas, never the whole output again), :class:`GrammarReady` (a
  request's grammar compiled, or failed), :class:`UtilityResult` and, when it cannot go
  on, :class:`CoreFailed`.

Errors cross as a :class:`ErrorCode` and a message, never as exception objects.
Tensors that must cross go as :class:`TensorBuffer` (raw bytes, dtype and shape).
"""

from __future__ import annotations

import enum
from typing import Any, Union

import msgspec


class ErrorCode(enum.IntEnum):
    """Whose fault an error is; the front end maps each to its exception (and HTTP status)."""

    INVALID_REQUEST = 1  # the request cannot be served as asked (400)
    INTERNAL = 2  # a plugin or the engine failed this request; others go on (500)
    CONFIG = 3  # the engine cannot be built from its configuration
    ENGINE_DEAD = 4  # the engine core stopped: nothing more is served


class CoreError(msgspec.Struct, frozen=True):
    code: ErrorCode
    message: str
    field: str | None = None  # the request parameter or config field it names


class LogitsProcessorSpec(msgspec.Struct, frozen=True, omit_defaults=True):
    """A logits processor a request chose: its registry name and the arguments it is
    built with (``cls(**args)``; JSON values, checked by the front end)."""

    name: str
    args: dict[str, Any] = msgspec.field(default_factory=dict)


class CoreSamplingParams(msgspec.Struct, frozen=True, omit_defaults=True):
    """What the engine core reads of a request's sampling parameters, validated by the
    front end. Stop strings, detokenization options and ``n`` stay in the front end
    (a request for ``n`` samples reaches the core as ``n`` requests)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    priority: int = 0
    speculative: bool = True
    allowed_token_ids: list[int] | None = None
    bad_words_token_ids: list[list[int]] | None = None  # each word's ids (and with a leading space)
    logits_processors: list[LogitsProcessorSpec] | None = None  # applied in this order

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


class GrammarRequest(msgspec.Struct, frozen=True):
    """A structured-output constraint, already checked by the front end. ``kind`` and
    ``value`` are a :class:`~pyagent_framework.types.GrammarSpec`'s; ``backend`` a
    grammar-backend name or None (the engine's default). With ``reasoning_parser``
    the grammar applies only once that parser (built by name, one per request, and
    prepared with the prompt and ``reasoning_request``) says the reasoning ended."""

    kind: str
    value: Any = None
    backend: str | None = None
    reasoning_parser: str | None = None
    reasoning_request: dict[str, Any] | None = None


class TensorBuffer(msgspec.Struct, frozen=True):
    """A tensor as raw bytes: ``dtype`` is torch's name (``float32``, ``bfloat16``)."""

    dtype: str
    shape: list[int]
    data: bytes

    @classmethod
    def from_tensor(cls, tensor: Any) -> "TensorBuffer":
        tensor = tensor.detach().cpu().contiguous()
        raw = tensor.view(-1).view(_byte_dtype()).numpy().tobytes()
        return cls(str(tensor.dtype).removeprefix("torch."), list(tensor.shape), raw)

    def to_tensor(self) -> Any:
        import torch

        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown tensor dtype {self.dtype!r}")
        flat = torch.frombuffer(bytearray(self.data), dtype=torch.uint8)
        return flat.view(dtype).reshape(self.shape)


def _byte_dtype() -> Any:
    import torch

    return torch.uint8


class AddRequest(msgspec.Struct, frozen=True, tag=True, omit_defaults=True):
    """One sequence to generate. ``sample_index`` is its place among a request's
    ``n`` samples (it seeds the sampler for a seeded request)."""

    request_id: str
    prompt_token_ids: list[int]
    params: CoreSamplingParams
    arrival_time: float
    cache_salt: str | None = None
    sample_index: int = 0
    grammar: GrammarRequest | None = None
    embed: bool = False  # an embedding: the prompt's pooled hidden states, nothing generated
    tenant: str | None = None  # whose request, for --scheduling-policy fair
    lora: str | None = None  # the LoRA adapter (by name) it is generated with; None: the base model
    token_type_ids: list[int] | None = None  # a text pair's segments, for a cross-encoder (embed); None: all 0


class AddRequests(msgspec.Struct, frozen=True, tag=True):
    """Requests (a request's samples; an ``LLM.generate`` call's prompts) sent
    together so that the core schedules them in the same step (the same batch shape,
    whatever the timing of the messages)."""

    requests: list[AddRequest]


class AbortRequests(msgspec.Struct, frozen=True, tag=True):
    request_ids: list[str]


class UtilityCall(msgspec.Struct, frozen=True, tag=True):
    """Ask the core for something between steps (``method``: ``stats``)."""

    call_id: int
    method: str
    args: list[Any] = []


class Shutdown(msgspec.Struct, frozen=True, tag=True):
    pass


class TokenLogprobs(msgspec.Struct, frozen=True, array_like=True):
    """Logprobs at one position: ``token_ids[0]`` is the token there (the sampled one,
    or the prompt's), then the top alternatives; ``ranks`` are 1 for the most likely."""

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]


class CoreOutput(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    """What one step added to one request: new tokens (and their logprobs), new prompt
    logprobs, and how it ended once it has. ``error`` is set with ``finish_reason``
    ``"error"``."""

    request_id: str
    new_token_ids: list[int] = []
    new_logprobs: list[TokenLogprobs] | None = None
    new_prompt_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | None = None  # the stop token id that ended it
    ended_by_token: bool = False  # the last new token (end of sequence, a stop id) is not text
    error: CoreError | None = None
    first_scheduled_time: float | None = None
    num_preemptions: int = 0
    embedding: TensorBuffer | None = None  # an embedding request's pooled vector (float32, not normalized)


class CoreInfo(msgspec.Struct, frozen=True):
    """Facts about the engine the front end needs; sent once the core is built."""

    vocab_size: int
    max_model_len: int
    attention_backend: str
    quantization: str | None
    device: str
    num_kv_blocks: int
    block_size: int
    pid: int
    task: str = "generate"  # "embed": an encoder, which serves embedding requests only; "classify": a cross-encoder
    hidden_size: int = 0  # an embedding's length (embed)
    matryoshka: bool = False  # whether an embedding may be cut to fewer dimensions (embed)
    normalize: bool = True  # whether embeddings are scaled to unit length unless a request says (embed)
    num_labels: int = 0  # a cross-encoder's logits per input (task "classify"): its "embedding" is them
    lora_adapters: list[str] = []  # the LoRA adapters loaded at start (--lora-modules)
    max_loras: int = 0  # LoRA slots (0: LoRA is off)


class CoreReady(msgspec.Struct, frozen=True, tag=True):
    info: CoreInfo


class CoreOutputs(msgspec.Struct, frozen=True, tag=True):
    outputs: list[CoreOutput]
    timestamp: float


class GrammarReady(msgspec.Struct, frozen=True, tag=True):
    """A request's grammar compiled (``error`` None: it is scheduled) or failed (it is
    dropped; the front end reports the error)."""

    request_id: str
    error: CoreError | None = None


class UtilityResult(msgspec.Struct, frozen=True, tag=True):
    call_id: int
    result: Any = None
    error: CoreError | None = None


class CoreFailed(msgspec.Struct, frozen=True, tag=True):
    """The core cannot go on (a failed model forward, a stalled step, a bad config);
    it exits after sending this."""

    error: CoreError
    details: str = ""


class CoreStartup(msgspec.Struct, frozen=True):
    """What a core process is started with (on its standard input): the engine
    configuration's fields and the watchdog's limit."""

    config: dict[str, Any]
    step_timeout: float | None = None


ToCore = Union[AddRequest, AddRequests, AbortRequests, UtilityCall, Shutdown]
FromCore = Union[CoreReady, CoreOutputs, GrammarReady, UtilityResult, CoreFailed]

MESSAGE_TYPES = (
    AddRequest, AddRequests, AbortRequests, UtilityCall, Shutdown, CoreReady, CoreOutputs, GrammarReady, UtilityResult, CoreFailed,
)


class Codec:
    """msgpack for one direction's messages. Encoding refuses anything but the message
    types and plain data (an object msgpack has no type for raises TypeError rather
    than being pickled); decoding yields only the declared types."""

    def __init__(self, decodes: Any) -> None:
        self._encoder = msgspec.msgpack.Encoder(enc_hook=_refuse)
        self._decoder = msgspec.msgpack.Decoder(decodes)

    def encode(self, message: Any) -> bytes:
        if not isinstance(message, MESSAGE_TYPES):
            raise TypeError(f"not an engine message: {type(message).__name__}")
        return self._encoder.encode(message)

    def decode(self, data: bytes | memoryview) -> Any:
        return self._decoder.decode(data)


def _refuse(obj: Any) -> Any:
    raise TypeError(
        f"an engine message may hold only numbers, strings, bytes, lists, dicts and message types; "
        f"got {type(obj).__module__}.{type(obj).__qualname__}"
    )
