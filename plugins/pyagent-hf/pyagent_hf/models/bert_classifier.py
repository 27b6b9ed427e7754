"""Cross-encoders: the BERT family's sequence-classification models
(``BertForSequenceClassification``, ``RobertaForSequenceClassification``,
``XLMRobertaForSequenceClassification``), which read a pair of texts as one sequence
and give ``num_labels`` logits for it.

The encoder is :mod:`.bert`'s; the heads follow transformers' parameter names, so a
checkpoint loads by name:

- BERT: the pooler (``pooler.dense`` and tanh over the first token, ``[CLS]``), then
  ``classifier``;
- RoBERTa and XLM-R: ``classifier.dense`` and tanh over the first token (``<s>``), then
  ``classifier.out_proj`` (these checkpoints have no pooler).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import nn

from pyagent_framework.errors import ConfigError
from pyagent_framework.interfaces import CrossEncoderArchitecture
from pyagent_hf.models.bert import BertModel, RobertaModel


def num_labels(config: Mapping[str, Any]) -> int:
    """The classifier's outputs, as transformers' ``PretrainedConfig`` counts them."""
    labels = config.get("id2label")
    count = len(labels) if isinstance(labels, Mapping) and labels else config.get("num_labels", 2)
    if not isinstance(count, int) or count < 1:
        raise ConfigError(f"num_labels must be a positive integer, got {count!r}", field="num_labels")
    return count


def first_tokens(hidden: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:
    """Each sequence's first row (its ``[CLS]`` / ``<s>`` token)."""
    return hidden[query_start_loc[:-1].to(torch.long)]


class BertPooler(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)

    def forward(self, first: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(first))


class BertForSequenceClassification(BertModel, CrossEncoderArchitecture):
    """BERT (MiniLM, BGE rerankers and the like) with its pooler and a linear classifier."""

    unused_prefixes: ClassVar[tuple[str, ...]] = ("cls.", "lm_head.")  # the pooler is read here

    def __init__(self, config: Mapping[str, Any], **options: Any) -> None:
        super().__init__(config, **options)
        self.num_labels = num_labels(self.config)
        self.pooler = BertPooler(self.hidden_size)
        self.classifier = nn.Linear(self.hidden_size, self.num_labels)

    def classify(self, hidden: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.pooler(first_tokens(hidden, query_start_loc))).float()


class RobertaClassificationHead(nn.Module):
    def __init__(self, hidden: int, labels: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, labels)

    def forward(self, first: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(first)))


class RobertaForSequenceClassification(RobertaModel, CrossEncoderArchitecture):
    """RoBERTa with its classification head."""

    def __init__(self, config: Mapping[str, Any], **options: Any) -> None:
        super().__init__(config, **options)
        self.num_labels = num_labels(self.config)
        self.classifier = RobertaClassificationHead(self.hidden_size, self.num_labels)

    def classify(self, hidden: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:
        return self.classifier(first_tokens(hidden, query_start_loc)).float()


class XLMRobertaForSequenceClassification(RobertaForSequenceClassification):
    pass
