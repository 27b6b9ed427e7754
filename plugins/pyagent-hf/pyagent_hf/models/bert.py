"""The BERT family of encoders (BERT, MiniLM, BGE, E5; RoBERTa and XLM-RoBERTa) as a
plain ``nn.Module``, for embeddings: hidden states of every token, which the engine
pools into one vector per sequence.

Module and parameter names follow transformers' ``BertModel``, so a checkpoint's
tensors load by name (a ``bert.``/``roberta.`` prefix, old ``gamma``/``beta`` names and
the unused ``pooler``/masked-LM head are handled in :meth:`BertModel.load_weights`).
The batch is flattened as the decoders' is: the linears and norms run on the
``[num_tokens, hidden]`` rows, and attention takes each sequence's rows as they lie
(:class:`Layout`), so nothing is padded.

RoBERTa differs in two ways: positions start after the padding id
(``pad_token_id + 1``), and there is one token type.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from pyagent_framework.errors import ConfigError
from pyagent_framework.interfaces import EncoderArchitecture

ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}
#: Checkpoint names the encoder does not use: transformers' pooler (a dense + tanh
#: over the first token, which sentence-transformers does not read), masked-LM and
#: next-sentence heads, and position id buffers.
UNUSED_PREFIXES = ("pooler.", "cls.", "lm_head.")
UNUSED_SUFFIXES = ("position_ids", "token_type_ids")


class Layout:
    """The sequences of one forward: where each starts and ends among the flat rows.
    Sequences of one length attend as one batch; otherwise each attends on its own
    (no padding: a batch of mixed lengths costs the sum of their squares, not
    ``num_seqs * longest**2``, and no rows are gathered into a padded copy)."""

    def __init__(self, query_start_loc: torch.Tensor) -> None:
        starts = query_start_loc.to(torch.long).tolist()
        self.spans = list(zip(starts[:-1], starts[1:]))
        lengths = {end - start for start, end in self.spans}
        self.same_length = len(lengths) <= 1
        self.longest = max(lengths) if lengths else 0


class BertEmbeddings(nn.Module):
    def __init__(self, config: Mapping[str, Any], position_offset: int) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        self.word_embeddings = nn.Embedding(config["vocab_size"], hidden)
        self.position_embeddings = nn.Embedding(config.get("max_position_embeddings", 512), hidden)
        self.token_type_embeddings = nn.Embedding(max(1, config.get("type_vocab_size", 2)), hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=config.get("layer_norm_eps", 1e-12))
        self.position_offset = position_offset

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor | None) -> torch.Tensor:
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions + self.position_offset)
        if token_type_ids is None:
            x = x + self.token_type_embeddings.weight[0]
        else:
            x = x + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(x)


class BertSelfAttention(nn.Module):
    def __init__(self, hidden: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_size = num_heads, hidden // num_heads
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, layout: Layout) -> torch.Tensor:
        q, k, v = self.query(x), self.key(x), self.value(x)
        scale = 1.0 / math.sqrt(self.head_size)
        if layout.same_length:
            def heads(t: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [seqs, heads, length, head_size]
                return t.view(len(layout.spans), layout.longest, self.num_heads, self.head_size).transpose(1, 2)

            out = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), scale=scale)
            return out.transpose(1, 2).reshape(x.shape[0], -1)
        out = torch.empty_like(q)
        for start, end in layout.spans:
            def heads(t: torch.Tensor) -> torch.Tensor:  # [length, hidden] -> [1, heads, length, head_size]
                return t[start:end].view(1, end - start, self.num_heads, self.head_size).transpose(1, 2)

            attended = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), scale=scale)
            out[start:end] = attended[0].transpose(0, 1).reshape(end - start, -1)
        return out


class BertDenseNorm(nn.Module):
    """transformers' ``BertSelfOutput`` / ``BertOutput``: dense, then the residual's
    layer norm."""

    def __init__(self, inputs: int, hidden: int, eps: float) -> None:
        super().__init__()
        self.dense = nn.Linear(inputs, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, hidden: int, num_heads: int, eps: float) -> None:
        super().__init__()
        self.self = BertSelfAttention(hidden, num_heads)
        self.output = BertDenseNorm(hidden, hidden, eps)

    def forward(self, x: torch.Tensor, layout: Layout) -> torch.Tensor:
        return self.output(self.self(x, layout), x)


class BertIntermediate(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, intermediate)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, config: Mapping[str, Any], act) -> None:
        super().__init__()
        hidden, eps = config["hidden_size"], config.get("layer_norm_eps", 1e-12)
        self.attention = BertAttention(hidden, config["num_attention_heads"], eps)
        self.intermediate = BertIntermediate(hidden, config["intermediate_size"], act)
        self.output = BertDenseNorm(config["intermediate_size"], hidden, eps)

    def forward(self, x: torch.Tensor, layout: Layout) -> torch.Tensor:
        x = self.attention(x, layout)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    def __init__(self, config: Mapping[str, Any], act) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config, act) for _ in range(config["num_hidden_layers"]))


class BertModel(nn.Module, EncoderArchitecture):
    """``BertModel`` (and MiniLM, BGE, E5, which are BERTs)."""

    #: Checkpoint name prefixes of the task models that wrap the encoder.
    prefixes: ClassVar[tuple[str, ...]] = ("bert.", "model.")
    #: Checkpoint name prefixes (after the task prefix) this model does not read.
    unused_prefixes: ClassVar[tuple[str, ...]] = UNUSED_PREFIXES

    def __init__(self, config: Mapping[str, Any], **_: Any) -> None:
        super().__init__()
        self.config = dict(config)
        activation = self.config.get("hidden_act", "gelu")
        if activation not in ACTIVATIONS:
            raise ConfigError(f"hidden_act {activation!r} is not supported (supported: {', '.join(sorted(ACTIVATIONS))})",
                              field="hidden_act")
        if self.config.get("position_embedding_type", "absolute") != "absolute":
            raise ConfigError(f"position_embedding_type {self.config['position_embedding_type']!r} is not supported "
                              "(only 'absolute')", field="position_embedding_type")
        if self.config["hidden_size"] % self.config["num_attention_heads"]:
            raise ConfigError(f"hidden_size {self.config['hidden_size']} is not a multiple of num_attention_heads "
                              f"{self.config['num_attention_heads']}", field="num_attention_heads")
        self.embeddings = BertEmbeddings(self.config, self.position_offset())
        self.encoder = BertEncoder(self.config, ACTIVATIONS[activation])
        self.hidden_size = self.config["hidden_size"]

    def position_offset(self) -> int:
        return 0

    @property
    def max_positions(self) -> int:
        """The longest sequence the position table holds."""
        return self.embeddings.position_embeddings.num_embeddings - self.embeddings.position_offset

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, query_start_loc: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        if input_ids.numel() and int(positions.max()) >= self.max_positions:
            raise ValueError(f"a sequence is longer than the model's {self.max_positions} positions")
        layout = Layout(query_start_loc)
        x = self.embeddings(input_ids, positions, token_type_ids)
        for layer in self.encoder.layer:
            x = layer(x, layout)
        return x

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            key = name
            for prefix in self.prefixes:
                if key.startswith(prefix):
                    key = key[len(prefix):]
                    break
            if key.startswith(self.unused_prefixes) or key.endswith(UNUSED_SUFFIXES):
                continue
            key = key.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
            param = params.get(key)
            if param is None:
                raise ValueError(f"unexpected checkpoint tensor {name!r} for {type(self).__name__}")
            if tuple(param.shape) != tuple(tensor.shape):
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(tensor)
            loaded.add(key)
        missing = set(params) - loaded
        if missing:
            raise ValueError(f"the checkpoint has no tensor for {', '.join(sorted(missing)[:5])}"
                             f"{' ...' if len(missing) > 5 else ''}")
        return loaded


class RobertaModel(BertModel):
    """RoBERTa and XLM-RoBERTa: BERT with positions after the padding id."""

    prefixes = ("roberta.", "model.")

    def position_offset(self) -> int:
        return int(self.config.get("pad_token_id", 1)) + 1


class XLMRobertaModel(RobertaModel):
    pass
