"""Data types shared by the kernel, the engine and plugins. Declared once, here.

Plugins import these; they never re-declare them. Nothing here imports torch: tensor
fields are annotated by name only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # pragma: no cover - typing only
    from collections.abc import Sequence

    import torch

# --------------------------------------------------------------------------- attention


@dataclass
class AttentionMetadata:
    """What an attention backend needs to know about one forward pass.

    The batch is flattened: the new tokens of every sequence are concatenated, in
    sequence order. The paged KV cache of one layer is a tensor of shape
    ``[2, num_blocks, block_size, num_kv_heads, head_size]`` (keys, then values).

    - ``slot_mapping[i]``: flat cache slot (``block * block_size + offset``) that the
      i-th new token's key/value is written to; ``-1`` means "do not write".
    - ``query_start_loc``: ``[num_seqs + 1]`` prefix sums of new-token counts.
    - ``seq_lens``: ``[num_seqs]`` total length of each sequence after this step
      (cached context plus new tokens); new tokens are the last ones.
    - ``block_tables``: ``[num_seqs, max_blocks]`` block ids of each sequence, padded
      with ``-1``.

    - ``all_slots_written``: the caller knows no slot is ``-1``, so a backend need not
      ask the device (a CUDA graph capture forbids that host sync); ``max_seq_len`` may
      then be an upper bound (the capture's), never less than any ``seq_lens``.

    One object describes one forward pass and is not modified afterwards, so a backend
    may cache what it derives from it (on the object) for the other layers.
    """

    slot_mapping: "torch.Tensor"
    query_start_loc: "torch.Tensor"
    seq_lens: "torch.Tensor"
    block_tables: "torch.Tensor"
    block_size: int
    max_query_len: int
    max_seq_len: int
    all_slots_written: bool = False


@dataclass
class ForwardContext:
    """Everything a model's layers need for one forward pass besides the tokens.

    ``kv_caches[i]`` is layer ``i``'s paged cache (see :class:`AttentionMetadata`).
    ``lora_slots``: with LoRA adapters in the batch, each token row's adapter slot
    (int ``[num_tokens]``, -1: the base model), for a whole-stack step that computes
    them (the layers themselves are the engine's ``LoRALinear`` modules); None otherwise.
    """

    metadata: AttentionMetadata
    kv_caches: "list[torch.Tensor]"
    lora_slots: "torch.Tensor | None" = None


# --------------------------------------------------------------------------- grammar

GrammarKind = Literal["json_schema", "json_object", "regex", "choice", "grammar", "structural_tag"]


@dataclass(frozen=True)
class GrammarSpec:
    """One structured-output constraint.

    ``value`` is a JSON schema (dict or JSON text) for ``json_schema``, ``None`` for
    ``json_object``, a pattern for ``regex``, a list of strings for ``choice``, grammar
    text for ``grammar`` and, for ``structural_tag``, the JSON text of a structural tag
    (vLLM's ``{"structures": [{"begin", "schema", "end"}], "triggers"}`` or xgrammar's
    ``{"format": {...}}``, checked for shape by the engine).

    ``checked_after``: whoever asked validates each finished output against the JSON
    schema (the engine does, for every ``json_schema`` spec). A backend may then leave
    to that check the keywords its grammar cannot express (``uniqueItems``, a
    ``oneOf`` whose branches overlap, ...), compiling a grammar that admits more than
    the schema at those places only, instead of refusing the spec. Without it a
    backend refuses what it cannot enforce. A grammar may always admit less than the
    schema (every output it admits must be valid).
    """

    kind: GrammarKind
    value: Any = None
    checked_after: bool = False


@dataclass(frozen=True)
class TokenizerInfo:
    """The vocabulary as a grammar backend sees it.

    ``vocab[i]`` is the raw bytes token ``i`` decodes to (byte-fallback and
    multi-byte pieces included); ``special_ids`` never match grammar text.
    """

    vocab: tuple[bytes, ...]
    eos_token_ids: frozenset[int]
    special_ids: frozenset[int] = frozenset()

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)


# --------------------------------------------------------------------------- parsers


@dataclass
class ToolCall:
    """A complete tool call in OpenAI's shape; ``arguments`` is JSON text."""

    id: str
    name: str
    arguments: str
    type: str = "function"


@dataclass
class ExtractedToolCalls:
    """Result of parsing a whole model output for tool calls."""

    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)

    @property
    def tools_called(self) -> bool:
        return bool(self.tool_calls)


@dataclass
class ToolCallDelta:
    """A streamed fragment of the ``index``-th tool call of a message.

    ``id`` and ``name`` are sent once, with the first fragment; ``arguments`` carries
    the next piece of the JSON argument text.
    """

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None
    type: str | None = None


@dataclass
class DeltaMessage:
    """What one streamed step adds to the assistant message."""

    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not (self.content or self.reasoning_content or self.tool_calls)


@dataclass
class ReasoningSplit:
    """Result of splitting a whole output into reasoning and answer."""

    reasoning_content: str | None
    content: str | None


# --------------------------------------------------------------------------- speculative decoding


@dataclass
class DraftRequest:
    """One decoding sequence a proposer may draft for: ``token_ids`` is its prompt
    then output so far (read-only), ``max_tokens`` the most draft tokens wanted."""

    seq_id: int
    token_ids: "Sequence[int]"
    num_prompt_tokens: int
    max_tokens: int


@dataclass
class Draft:
    """Proposed continuation: ``tokens`` (at most the request's ``max_tokens``) and,
    optionally, ``probs`` ``[len(tokens), vocab]``: the distribution each was drawn
    from (None: the proposer chose them deterministically, a one-hot draft)."""

    tokens: list[int]
    probs: Any = None


# --------------------------------------------------------------------------- logits processors


@dataclass
class LogitsRow:
    """One sequence's row for a logits processor: ``processor`` is the request's own
    instance (built from its arguments), ``prompt_token_ids`` and ``output_token_ids``
    its tokens so far (read-only), ``stop_token_ids`` the tokens that would end it now
    (the model's end-of-sequence tokens unless ``ignore_eos``, and ``stop_token_ids``)."""

    processor: Any
    prompt_token_ids: "Sequence[int]"
    output_token_ids: "Sequence[int]"
    stop_token_ids: frozenset[int] = frozenset()
