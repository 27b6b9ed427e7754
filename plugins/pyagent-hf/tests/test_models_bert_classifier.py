"""The cross-encoders (BERT-family sequence classifiers) against transformers on the
same random weights: every label's logit, for a batch of sequences of different
lengths with token types, and the checkpoints' names."""

from __future__ import annotations

import pytest
import torch

from pyagent_framework import registries
from pyagent_framework.interfaces import CrossEncoderArchitecture

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=120, hidden_size=48, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
             initializer_range=0.2)
CASES = {
    "BertForSequenceClassification": lambda labels: transformers.BertConfig(
        **SMALL, max_position_embeddings=64, type_vocab_size=2, num_labels=labels),
    "RobertaForSequenceClassification": lambda labels: transformers.RobertaConfig(
        **SMALL, max_position_embeddings=70, pad_token_id=1, type_vocab_size=1, layer_norm_eps=1e-5, num_labels=labels),
    "XLMRobertaForSequenceClassification": lambda labels: transformers.XLMRobertaConfig(
        **SMALL, max_position_embeddings=70, pad_token_id=1, type_vocab_size=1, hidden_act="gelu_new", num_labels=labels),
}
LENGTHS = (7, 1, 13, 13, 4)


@pytest.mark.parametrize("labels", [1, 3])
@pytest.mark.parametrize("name", sorted(CASES))
def test_logits_match_transformers_in_a_batch_of_mixed_lengths(name, labels):
    torch.manual_seed(0)
    config = CASES[name](labels)
    reference = getattr(transformers, name)(config).eval()
    ours = registries.model_architectures.load(name)(config.to_dict()).eval()
    assert isinstance(ours, CrossEncoderArchitecture) and ours.num_labels == labels
    loaded = ours.load_weights(reference.state_dict().items())
    assert {"classifier.weight", "pooler.dense.weight"} <= loaded if name.startswith("Bert") else "classifier.out_proj.weight" in loaded
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, 120, (n,), generator=g) for n in LENGTHS]
    types = [(torch.arange(len(s)) >= len(s) // 2).long() if name.startswith("Bert") else torch.zeros(len(s), dtype=torch.long)
             for s in seqs]
    starts = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    with torch.no_grad():
        hidden = ours(torch.cat(seqs), torch.cat([torch.arange(n) for n in LENGTHS]), starts, torch.cat(types))
        got = ours.classify(hidden, starts)
        pad = config.pad_token_id or 0
        ids = torch.full((len(seqs), max(LENGTHS)), pad)
        mask = torch.zeros_like(ids)
        token_types = torch.zeros_like(ids)
        for i, s in enumerate(seqs):
            ids[i, : len(s)], mask[i, : len(s)], token_types[i, : len(s)] = s, 1, types[i]
        want = reference(input_ids=ids, attention_mask=mask, token_type_ids=token_types).logits
    assert got.shape == (len(seqs), labels) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    assert float(want.std()) > 0.05  # the logits differ between sequences: a wrong head shows


def test_a_classifier_checkpoint_without_its_head_is_named():
    config = CASES["BertForSequenceClassification"](1)
    reference = transformers.BertForSequenceClassification(config)
    ours = registries.model_architectures.load("BertForSequenceClassification")(config.to_dict())
    weights = {k: v for k, v in reference.state_dict().items() if not k.startswith("classifier.")}
    with pytest.raises(ValueError, match="no tensor for classifier.bias, classifier.weight"):
        ours.load_weights(weights.items())
