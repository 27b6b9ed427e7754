"""Scores of text pairs (``LLM.score``, ``/v1/score``, ``/rerank``).

Two kinds of model score a pair:

- a **cross-encoder** (task ``classify``: BERT's or RoBERTa's
  ``...ForSequenceClassification`` with one label) reads the pair as one sequence, as
  its tokenizer pairs them; the score is its logit through the model's activation
  (sigmoid unless its ``config.json`` names another, as sentence-transformers'
  ``CrossEncoder.predict`` does);
- an **embedding model** (task ``embed``) embeds each text; the score is the cosine
  similarity of the two embeddings.

Pairing follows vLLM: one text and a list pair the one with each; two lists of the
same length pair elementwise.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pyagent_framework.errors import ConfigError, InvalidRequestError

#: A cross-encoder's activations over its logit, by sentence-transformers' class name.
ACTIVATIONS = ("sigmoid", "identity")


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """One pair's score (``outputs.score``), or, with ``error`` set, why it failed
    (``error_kind`` as :class:`~.outputs.RequestOutput`'s). ``prompt_token_ids``: the
    pair's tokens (a cross-encoder's one sequence, or an embedding model's two inputs
    one after the other)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput | None
    finished: bool = True
    error: str | None = None
    error_kind: str | None = None


def pair_up(text_1: Any, text_2: Any, *, limit: int | None = None) -> list[tuple[str, str]]:
    """vLLM's pairing: ``str, str`` is one pair; ``str, [str, ...]`` pairs the first
    with each; ``[a, b], [c, d]`` pairs elementwise. Anything else is an
    InvalidRequestError naming the field; ``limit`` caps the number of pairs."""
    first, second = _texts(text_1, "text_1"), _texts(text_2, "text_2")
    if len(first) == 1:
        first = first * len(second)
    elif len(first) != len(second):
        raise InvalidRequestError(f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1 for any number "
                                  "of text_2, or lists of the same length", param="text_2")
    if limit is not None and len(first) > limit:
        raise InvalidRequestError(f"{len(first)} pairs; at most {limit} per request", param="text_2")
    return list(zip(first, second))


def _texts(value: Any, field: str) -> list[str]:
    texts = [value] if isinstance(value, str) else list(value) if isinstance(value, Sequence) else None
    if not texts or not all(isinstance(t, str) for t in texts):
        raise InvalidRequestError(f"{field} must be a text or a non-empty list of texts", param=field)
    for index, text in enumerate(texts):
        if not text:
            raise InvalidRequestError(f"{field}: text {index} is empty", param=field)
    return texts


def score_activation(model_config: Mapping[str, Any], num_labels: int) -> str:
    """How a cross-encoder's logit becomes its score, as sentence-transformers'
    ``CrossEncoder`` decides: the activation its ``config.json`` names
    (``sentence_transformers.activation_fn``, or the older
    ``sbert_ce_default_activation_function``) when that is a torch class, else sigmoid
    for one label and identity for more."""
    settings = model_config.get("sentence_transformers")
    path = settings.get("activation_fn") if isinstance(settings, Mapping) else None
    path = path or model_config.get("sbert_ce_default_activation_function")
    if isinstance(path, str) and path.startswith("torch."):
        name = path.rsplit(".", 1)[-1].lower()
        if name not in ACTIVATIONS:
            raise ConfigError(f"the model's activation {path!r} is not supported (supported: torch's Sigmoid, Identity)",
                              field="model")
        return name
    return "sigmoid" if num_labels == 1 else "identity"


def activate(logits: Any, activation: str) -> Any:
    import torch

    return torch.sigmoid(logits) if activation == "sigmoid" else logits


def cosine(a: Any, b: Any) -> float:
    """Cosine similarity of two vectors, in float32 as sentence-transformers'
    ``cos_sim`` computes it."""
    import torch

    a = torch.as_tensor(a, dtype=torch.float32)
    b = torch.as_tensor(b, dtype=torch.float32)
    a = torch.nn.functional.normalize(a, p=2, dim=-1)
    b = torch.nn.functional.normalize(b, p=2, dim=-1)
    return float(a @ b)


def check_scorer(engine: Any) -> str:
    """The way ``engine`` (an :class:`~.llm_engine.LLMEngine`) scores, ``classify`` or
    ``embed``; an InvalidRequestError naming ``model`` for a text model or a classifier
    with more than one label (its outputs are no single score)."""
    from pyagent_framework.engine.errors import TEXT_MODEL_NO_SCORES

    if engine.task == "classify" and engine.info.num_labels != 1:
        raise InvalidRequestError(f"this model is a classifier with {engine.info.num_labels} labels; a score needs a "
                                  "cross-encoder with one label, or an embedding model", param="model")
    if engine.task not in ("classify", "embed"):
        raise InvalidRequestError(TEXT_MODEL_NO_SCORES, param="model")
    return engine.task


def unique_texts(pairs: list[tuple[str, str]]) -> list[str]:
    """Every text of the pairs once, in first-seen order (each is embedded once)."""
    return list(dict.fromkeys(text for pair in pairs for text in pair))


def classified(out: Any) -> ScoringRequestOutput:
    """A cross-encoder's output (its one score in ``outputs.embedding``) as a score."""
    if out.outputs is None:
        return ScoringRequestOutput(out.request_id, out.prompt_token_ids, None, True, out.error, out.error_kind)
    return ScoringRequestOutput(out.request_id, out.prompt_token_ids, ScoringOutput(float(out.outputs.embedding[0])))


def cosines(request_ids: list[str], pairs: list[tuple[str, str]], embedded: dict[str, Any]) -> list[ScoringRequestOutput]:
    """An embedding model's scores: each pair's cosine, from its texts' embeddings
    (``embedded``: text -> its EmbeddingRequestOutput)."""
    outputs = []
    for request_id, (first, second) in zip(request_ids, pairs):
        a, b = embedded[first], embedded[second]
        ids = list(a.prompt_token_ids) + list(b.prompt_token_ids)
        failed = a if a.outputs is None else b if b.outputs is None else None
        if failed is not None:
            outputs.append(ScoringRequestOutput(request_id, ids, None, True, failed.error, failed.error_kind))
        else:
            outputs.append(ScoringRequestOutput(request_id, ids, ScoringOutput(cosine(a.outputs.embedding, b.outputs.embedding))))
    return outputs
