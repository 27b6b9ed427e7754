"""The safetensors format on tiny random transformers checkpoints (single and sharded)."""

import json

import pytest
import torch

from pyagent_framework import registries
from pyagent_framework.interfaces import WeightFormat


def _tiny_llama(tie: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=128,
        tie_word_embeddings=tie,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms start at exactly 1.0: make every tensor distinctive
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("st")
    untied, tied = _tiny_llama(False), _tiny_llama(True)
    untied.save_pretrained(str(root / "single"))
    untied.save_pretrained(str(root / "sharded"), max_shard_size="20KB")
    tied.save_pretrained(str(root / "tied"))
    return root, untied, tied


@pytest.fixture
def fmt():
    return registries.weight_formats.load("safetensors")()


def _raw(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


def _assert_same(loaded: dict, state: dict):
    assert sorted(loaded) == sorted(state)
    for name, want in state.items():
        got = loaded[name]
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert torch.equal(_raw(got), _raw(want)), name


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_iter_weights_is_the_state_dict_bit_exact(checkpoints, fmt, layout):
    root, untied, _ = checkpoints
    path = root / layout
    if layout == "sharded":
        index = json.loads((path / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 2
        assert not (path / "model.safetensors").exists()
    assert isinstance(fmt, WeightFormat)
    assert fmt.matches(str(path))
    loaded = dict(fmt.iter_weights(str(path)))
    _assert_same(loaded, untied.state_dict())
    assert fmt.load_config(str(path)) == json.loads((path / "config.json").read_text())


def test_tied_checkpoint_yields_what_is_on_disk(checkpoints, fmt):
    from safetensors import safe_open

    root, _, tied = checkpoints
    with safe_open(str(root / "tied" / "model.safetensors"), framework="pt") as f:
        on_disk = set(f.keys())
    state = {k: v for k, v in tied.state_dict().items() if k in on_disk}
    assert "lm_head.weight" not in on_disk and set(state) == on_disk
    _assert_same(dict(fmt.iter_weights(str(root / "tied"))), state)
    assert fmt.load_config(str(root / "tied"))["tie_word_embeddings"] is True


def test_iter_weights_is_lazy(checkpoints, fmt):
    root, untied, _ = checkpoints
    it = fmt.iter_weights(str(root / "sharded"))
    name, tensor = next(it)
    assert torch.equal(tensor, untied.state_dict()[name])
    it.close()


def test_single_file_with_config_beside_it(checkpoints, fmt):
    root, untied, _ = checkpoints
    path = root / "single" / "model.safetensors"
    assert fmt.matches(str(path))
    _assert_same(dict(fmt.iter_weights(str(path))), untied.state_dict())
    assert fmt.load_config(str(path))["num_hidden_layers"] == 2


def test_matches_false_cases(tmp_path, fmt, smollm2_path):
    (tmp_path / "config_only").mkdir()
    (tmp_path / "config_only" / "config.json").write_text("{}")
    (tmp_path / "weights_only").mkdir()
    (tmp_path / "weights_only" / "model.safetensors").write_bytes(b"\0" * 16)
    (tmp_path / "lonely.safetensors").write_bytes(b"\0" * 16)
    for path in ("config_only", "weights_only", "weights_only/model.safetensors", "lonely.safetensors", "missing"):
        assert not fmt.matches(str(tmp_path / path)), path
    assert not fmt.matches(str(tmp_path / "config_only" / "config.json"))
    assert not fmt.matches(str(smollm2_path))


def test_bad_paths_raise_value_error_naming_the_path(tmp_path, fmt):
    missing = tmp_path / "no_such_ckpt"
    with pytest.raises(ValueError, match="no_such_ckpt"):
        fmt.load_config(str(missing))
    with pytest.raises(ValueError, match="no_such_ckpt"):
        fmt.iter_weights(str(missing))


def test_missing_shard_is_named_before_any_tensor_is_read(checkpoints, fmt, tmp_path):
    import shutil

    root, _, _ = checkpoints
    copy = tmp_path / "copy"
    shutil.copytree(root / "sharded", copy)
    index = json.loads((copy / "model.safetensors.index.json").read_text())
    last = sorted(set(index["weight_map"].values()))[-1]
    (copy / last).unlink()
    with pytest.raises(ValueError, match=last):
        fmt.iter_weights(str(copy))


def test_index_pointing_outside_the_directory_is_refused(checkpoints, fmt, tmp_path):
    import shutil

    root, _, _ = checkpoints
    copy = tmp_path / "copy"
    shutil.copytree(root / "sharded", copy)
    index = json.loads((copy / "model.safetensors.index.json").read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = "../elsewhere.safetensors"
    (copy / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="elsewhere"):
        fmt.iter_weights(str(copy))


def test_corrupt_file_raises_value_error_naming_it(checkpoints, fmt, tmp_path):
    import shutil

    root, _, _ = checkpoints
    copy = tmp_path / "copy"
    shutil.copytree(root / "single", copy)
    (copy / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(ValueError, match="model.safetensors"):
        list(fmt.iter_weights(str(copy)))
