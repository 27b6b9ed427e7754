"""The BERT family encoders against transformers on the same random weights: every
token's hidden state, for a batch of sequences of different lengths (transformers pads
them and masks the padding)."""

from __future__ import annotations

import pytest
import torch

from pyagent_framework import registries
from pyagent_framework.errors import ConfigError
from pyagent_framework.interfaces import EncoderArchitecture

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=120, hidden_size=48, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
             max_position_embeddings=64)
CASES = {
    "BertModel": lambda: transformers.BertConfig(**SMALL, hidden_act="gelu", type_vocab_size=2),
    "RobertaModel": lambda: transformers.RobertaConfig(**{**SMALL, "max_position_embeddings": 70}, pad_token_id=1, type_vocab_size=1,
                                                       layer_norm_eps=1e-5),
    "XLMRobertaModel": lambda: transformers.XLMRobertaConfig(**{**SMALL, "max_position_embeddings": 70}, pad_token_id=1,
                                                             type_vocab_size=1, hidden_act="gelu_new"),
}
LENGTHS = (7, 1, 13, 13, 4)


def make_pair(name: str, seed: int = 0):
    torch.manual_seed(seed)
    config = CASES[name]()
    reference = getattr(transformers, name)(config, add_pooling_layer=True).eval()
    ours = registries.model_architectures.load(name)(config.to_dict()).eval()
    assert isinstance(ours, EncoderArchitecture)
    assert ours.load_weights(reference.state_dict().items())
    return reference, ours


def batch(lengths, vocab: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g) for n in lengths]


def ours_states(ours, seqs, token_types=None):
    ids = torch.cat(seqs)
    positions = torch.cat([torch.arange(len(s)) for s in seqs])
    starts = torch.tensor([0, *torch.tensor([len(s) for s in seqs]).cumsum(0).tolist()])
    types = torch.cat(token_types) if token_types is not None else None
    with torch.no_grad():
        return ours(ids, positions, starts, types).split([len(s) for s in seqs])


def reference_states(reference, seqs, pad_id: int, token_types=None):
    longest = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), longest), pad_id)
    mask = torch.zeros(len(seqs), longest, dtype=torch.long)
    types = torch.zeros(len(seqs), longest, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)] = s, 1
        if token_types is not None:
            types[i, : len(s)] = token_types[i]
    with torch.no_grad():
        out = reference(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state
    return [out[i, : len(s)] for i, s in enumerate(seqs)]


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_tokens_state_matches_transformers_in_a_batch_of_mixed_lengths(name):
    reference, ours = make_pair(name)
    pad = reference.config.pad_token_id or 0
    seqs = batch(LENGTHS, reference.config.vocab_size)
    for got, want in zip(ours_states(ours, seqs), reference_states(reference, seqs, pad)):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    # Batch-invariant: each sequence alone gives what it gave in the batch.
    alone = ours_states(ours, seqs[2:3])[0]
    torch.testing.assert_close(alone, ours_states(ours, seqs)[2], atol=1e-5, rtol=1e-5)


def test_equal_lengths_take_the_unpadded_path_and_agree():
    reference, ours = make_pair("BertModel", seed=3)
    seqs = batch((9, 9, 9), reference.config.vocab_size, seed=4)
    for got, want in zip(ours_states(ours, seqs), reference_states(reference, seqs, 0)):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_token_types_are_read():
    reference, ours = make_pair("BertModel", seed=5)
    seqs = batch((6, 10), reference.config.vocab_size, seed=6)
    types = [torch.tensor([0, 0, 0, 1, 1, 1]), torch.tensor([0] * 4 + [1] * 6)]
    got = ours_states(ours, seqs, types)
    for g, want in zip(got, reference_states(reference, seqs, 0, types)):
        torch.testing.assert_close(g, want, atol=2e-5, rtol=1e-4)
    assert not torch.allclose(got[0], ours_states(ours, seqs)[0], atol=1e-3)  # the types changed something


def test_checkpoint_names_with_a_prefix_and_old_norm_names_load():
    reference, _ = make_pair("BertModel")
    renamed = {("bert." + k).replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
               for k, v in reference.state_dict().items()}
    ours = registries.model_architectures.load("BertModel")(reference.config.to_dict())
    ours.load_weights(renamed.items())
    seqs = batch((5,), reference.config.vocab_size)
    torch.testing.assert_close(ours_states(ours, seqs)[0], reference_states(reference, seqs, 0)[0], atol=2e-5, rtol=1e-4)


def test_wrong_checkpoints_and_configs_are_named():
    reference, _ = make_pair("BertModel")
    cls = registries.model_architectures.load("BertModel")
    state = dict(reference.state_dict())
    with pytest.raises(ValueError, match="unexpected checkpoint tensor 'encoder.layer.9.output.dense.weight'"):
        cls(reference.config.to_dict()).load_weights([*state.items(), ("encoder.layer.9.output.dense.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="has shape"):
        cls(reference.config.to_dict()).load_weights([("embeddings.word_embeddings.weight", torch.zeros(3, 3))])
    del state["encoder.layer.1.output.LayerNorm.bias"]
    with pytest.raises(ValueError, match="no tensor for encoder.layer.1.output.LayerNorm.bias"):
        cls(reference.config.to_dict()).load_weights(state.items())
    with pytest.raises(ConfigError, match="hidden_act 'quick_gelu'") as caught:
        cls({**reference.config.to_dict(), "hidden_act": "quick_gelu"})
    assert caught.value.field == "hidden_act"
    with pytest.raises(ConfigError, match="position_embedding_type 'relative_key'"):
        cls({**reference.config.to_dict(), "position_embedding_type": "relative_key"})
    ours = cls(reference.config.to_dict())
    too_long = SMALL["max_position_embeddings"] + 1
    with pytest.raises(ValueError, match="longer than the model's 64 positions"):
        ours(torch.zeros(too_long, dtype=torch.long), torch.arange(too_long), torch.tensor([0, too_long]))


def test_roberta_positions_start_after_the_padding_id():
    _, ours = make_pair("RobertaModel")
    assert ours.embeddings.position_offset == 2 and ours.max_positions == 68
