"""The gguf format: the SmolLM2 GGUF against transformers' own GGUF loader, and tiny GGUF
files written here with gguf.GGUFWriter from transformers models (exact round trips)."""

import shutil

import numpy as np
import pytest
import torch

from pyagent_framework import registries
from pyagent_framework.interfaces import WeightFormat
from tests.tiny_gguf import llama_cpp_permute

CONFIG_FIELDS = [
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "rms_norm_eps",
    "max_position_embeddings",
    "vocab_size",
    "tie_word_embeddings",
    "head_dim",
    "bos_token_id",
    "eos_token_id",
]


@pytest.fixture(scope="module")
def fmt():
    return registries.weight_formats.load("gguf")()


@pytest.fixture(scope="module")
def hf_reference(smollm2_path, fmt):
    """What transformers itself makes of the GGUF: its config and its tensors (dequantized,
    unpermuted). One parse: ``AutoConfig.from_pretrained(..., gguf_file=...)`` builds its
    config from this same ``load_gguf_checkpoint(...)["config"]``."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # The skeleton only lends its parameter names, to map GGUF names; transformers
    # unpermutes and dequantizes from the GGUF metadata alone.
    ours = fmt.load_config(str(smollm2_path))
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.for_model(ours["model_type"], num_hidden_layers=ours["num_hidden_layers"], tie_word_embeddings=ours["tie_word_embeddings"]))
    parsed = load_gguf_checkpoint(str(smollm2_path), return_tensors=True, model_to_load=skeleton)
    config = parsed["config"]
    return AutoConfig.for_model(config.pop("model_type"), **config), parsed["tensors"]


@pytest.fixture(scope="module")
def hf_config(hf_reference):
    return hf_reference[0]


@pytest.fixture(scope="module")
def hf_tensors(hf_reference):
    return hf_reference[1]


@pytest.fixture(scope="module")
def our_weights(fmt, smollm2_path):
    return dict(fmt.iter_weights(str(smollm2_path)))


# -- SmolLM2 (Q4_1 / Q8_0 / F32) against transformers -------------------------------------


def test_header_reader_agrees_with_gguf_reader(smollm2_path, smollm2_reader):
    from pyagent_hf._gguf import read_header

    header = read_header(smollm2_path)
    reader_fields = {k: f for k, f in smollm2_reader.fields.items() if not k.startswith("GGUF.")}
    assert list(header.fields) == list(reader_fields)
    for key, field in reader_fields.items():
        assert header.fields[key] == field.contents(), key
    assert [t.name for t in header.tensors] == [t.name for t in smollm2_reader.tensors]
    for ours, theirs in zip(header.tensors, smollm2_reader.tensors):
        assert ours.dims == tuple(int(d) for d in theirs.shape), ours.name
        assert ours.ggml_type == int(theirs.tensor_type), ours.name
        assert (ours.offset, ours.nbytes) == (theirs.data_offset, theirs.n_bytes), ours.name
    assert header.data_offset == smollm2_reader.data_offset


def test_load_config_matches_transformers(fmt, smollm2_path, hf_config):
    config = fmt.load_config(str(smollm2_path))
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == hf_config.model_type
    for field in CONFIG_FIELDS:
        assert config[field] == getattr(hf_config, field), field
    rope = getattr(hf_config, "rope_parameters", None) or {"rope_theta": hf_config.rope_theta}
    assert config["rope_theta"] == rope["rope_theta"] == 100000.0
    assert config["torch_dtype"] == "float32"
    assert "rope_scaling" not in config  # the file has no rope scaling


def test_iter_weights_match_transformers(fmt, smollm2_path, smollm2_reader, hf_tensors, our_weights):
    types = {t.name: t.tensor_type.name for t in smollm2_reader.tensors}
    assert {"Q4_1", "Q8_0", "F32"} <= set(types.values())
    it = fmt.iter_weights(str(smollm2_path))
    first, _ = next(it)
    assert first == "model.embed_tokens.weight"  # lazy: one tensor at a time
    it.close()
    ours = our_weights
    assert "lm_head.weight" not in ours  # tied: the file has no output.weight
    assert sorted(ours) == sorted(hf_tensors)
    for name, want in hf_tensors.items():
        got = ours[name]
        assert got.dtype == torch.float32 and got.shape == want.shape, name
        if not torch.equal(got, want):  # (the same arithmetic gives identical bits; NaN fails both)
            diff = (got - want.to(torch.float32)).abs().max().item()
            assert diff <= 1e-6, (name, diff)
    q = ours["model.layers.0.self_attn.q_proj.weight"]
    k = ours["model.layers.0.self_attn.k_proj.weight"]
    assert q.shape == (576, 576) and k.shape == (192, 576)


def test_q4_1_dequantization_by_hand(smollm2_reader, our_weights):
    """One Q4_1 block decoded from its bytes: 32 weights = d * nibble + m (fp16 d, m)."""
    tensor = next(t for t in smollm2_reader.tensors if t.name == "blk.0.attn_v.weight")
    assert tensor.tensor_type.name == "Q4_1"
    block = np.asarray(tensor.data[0, :20], dtype=np.uint8).tobytes()
    d, m = np.frombuffer(block[:4], dtype=np.float16).astype(np.float32)
    qs = np.frombuffer(block[4:], dtype=np.uint8)
    expected = np.concatenate([qs & 0x0F, qs >> 4]).astype(np.float32) * d + m
    np.testing.assert_allclose(our_weights["model.layers.0.self_attn.v_proj.weight"][0, :32].numpy(), expected, rtol=0, atol=1e-6)


# -- tiny GGUFs written here --------------------------------------------------------------


def _write_gguf(path, arch, config, tensors, *, tokens=None, extra=None):
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(config.num_hidden_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    w.add_rope_dimension_count(head_dim)
    if arch == "qwen3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens if tokens is not None else [f"t{i}" for i in range(config.vocab_size)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for key, value in (extra or {}).items():
        getattr(w, key)(value)
    for name, array in tensors.items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _gguf_tensors(state, config, *, permute):
    """HF state dict -> GGUF tensors as llama.cpp's converter writes them."""
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    per_layer = {
        "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_o", "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    }
    per_layer["self_attn.o_proj"] = "attn_output"
    out = {}
    for name, tensor in state.items():
        array = tensor.detach().numpy().copy()
        if name in names:
            gname = names[name]
        else:
            _, _, layer, rest = name.split(".", 3)
            module, suffix = rest.rsplit(".", 1)
            gname = f"blk.{layer}.{per_layer[module]}.{suffix}"
            if permute and module == "self_attn.q_proj":
                array = llama_cpp_permute(array, config.num_attention_heads, config.num_attention_heads)
            elif permute and module == "self_attn.k_proj":
                array = llama_cpp_permute(array, config.num_attention_heads, config.num_key_value_heads)
        if gname == "output.weight":
            array = array.astype(np.float16)  # exercise F16 too
        out[gname] = array
    return out


def _tiny(model_cls, config_cls, **kw):
    torch.manual_seed(0)
    config = config_cls(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, max_position_embeddings=256, **kw,
    )
    model = model_cls(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    return config, model.state_dict()


@pytest.fixture(scope="module")
def tiny_llama_gguf(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    config, state = _tiny(LlamaForCausalLM, LlamaConfig, tie_word_embeddings=False)
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    extra = {"add_rope_scaling_type": gguf_rope_linear(), "add_rope_scaling_factor": 2.0}
    _write_gguf(path, "llama", config, _gguf_tensors(state, config, permute=True), extra=extra)
    return path, config, state


def gguf_rope_linear():
    import gguf

    return gguf.RopeScalingType.LINEAR


def test_tiny_llama_round_trip_undoes_the_permutation(fmt, tiny_llama_gguf):
    path, config, state = tiny_llama_gguf
    assert fmt.matches(str(path))
    loaded = dict(fmt.iter_weights(str(path)))
    assert sorted(loaded) == sorted(state)
    for name, want in state.items():
        if name == "lm_head.weight":
            want = want.to(torch.float16).to(torch.float32)
        assert torch.equal(loaded[name], want), name
    # The permutation is not the identity, so the test above means something.
    q = state["model.layers.0.self_attn.q_proj.weight"].numpy()
    assert not np.array_equal(llama_cpp_permute(q, 4, 4), q)


def test_tiny_llama_config(fmt, tiny_llama_gguf):
    path, config, _ = tiny_llama_gguf
    got = fmt.load_config(str(path))
    assert got["architectures"] == ["LlamaForCausalLM"]
    for field in CONFIG_FIELDS[:-2]:
        assert got[field] == pytest.approx(getattr(config, field)), field
    assert got["tie_word_embeddings"] is False
    assert (got["bos_token_id"], got["eos_token_id"]) == (1, 2)
    assert got["rope_scaling"]["rope_type"] == "linear" and got["rope_scaling"]["factor"] == 2.0
    assert got["rope_parameters"] == {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}


def test_tiny_qwen3_round_trip_without_permutation(fmt, tmp_path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config, state = _tiny(Qwen3ForCausalLM, Qwen3Config, tie_word_embeddings=True, head_dim=32)
    state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    path = _write_gguf(tmp_path / "tiny-qwen3.gguf", "qwen3", config, _gguf_tensors(state, config, permute=False))
    loaded = dict(fmt.iter_weights(str(path)))
    assert "model.layers.1.self_attn.q_norm.weight" in loaded
    assert sorted(loaded) == sorted(state)
    for name, want in state.items():
        assert torch.equal(loaded[name], want), name
    got = fmt.load_config(str(path))
    assert got["architectures"] == ["Qwen3ForCausalLM"] and got["head_dim"] == 32
    assert got["tie_word_embeddings"] is True and got["num_key_value_heads"] == 2


# -- matching and errors ------------------------------------------------------------------


def test_matches(fmt, smollm2_path, tmp_path):
    assert isinstance(fmt, WeightFormat)
    assert fmt.matches(str(smollm2_path))
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"GGML" + b"\0" * 60)
    (tmp_path / "empty.gguf").write_bytes(b"")
    (tmp_path / "config.json").write_text("{}")
    for path in (fake, tmp_path / "empty.gguf", tmp_path, tmp_path / "config.json", tmp_path / "missing.gguf"):
        assert not fmt.matches(str(path)), path


def test_bad_paths_raise_value_error_naming_the_path(fmt, tmp_path):
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"GGML" + b"\0" * 60)
    for path in (tmp_path / "missing.gguf", fake, tmp_path):
        with pytest.raises(ValueError, match=path.name):
            fmt.load_config(str(path))
        with pytest.raises(ValueError, match=path.name):
            fmt.iter_weights(str(path))


def test_truncated_files_raise_value_error(fmt, smollm2_path, tiny_llama_gguf, tmp_path):
    head = tmp_path / "head.gguf"
    head.write_bytes(smollm2_path.read_bytes()[:100_000])  # cut inside the vocabulary
    with pytest.raises(ValueError, match="head.gguf.*truncated"):
        fmt.load_config(str(head))
    path, _, _ = tiny_llama_gguf
    short = tmp_path / "short.gguf"
    short.write_bytes(path.read_bytes()[:-10])  # the last tensor's bytes run past the end
    with pytest.raises(ValueError, match="short.gguf.*outside the file"):
        fmt.iter_weights(str(short))


def test_unsupported_architecture_is_named(fmt, tiny_llama_gguf, tmp_path):
    _, config, _ = tiny_llama_gguf
    path = _write_gguf(tmp_path / "gpt2.gguf", "gpt2", config, {"token_embd.weight": np.zeros((128, 64), np.float32)})
    with pytest.raises(ValueError, match="'gpt2'"):
        fmt.load_config(str(path))


def test_unsupported_tensor_type_names_tensor_and_type(fmt, tiny_llama_gguf, tmp_path):
    _, config, _ = tiny_llama_gguf
    tensors = {"token_embd.weight": np.zeros((128, 64), np.float32), "blk.0.attn_norm.weight": np.arange(64, dtype=np.int32)}
    path = _write_gguf(tmp_path / "ints.gguf", "llama", config, tensors)
    weights = fmt.iter_weights(str(path))
    assert next(weights)[0] == "model.embed_tokens.weight"
    with pytest.raises(ValueError, match=r"'blk\.0\.attn_norm\.weight'.*I32"):
        next(weights)


def test_unknown_tensor_is_refused(fmt, tiny_llama_gguf, tmp_path):
    _, config, _ = tiny_llama_gguf
    path = _write_gguf(tmp_path / "odd.gguf", "llama", config, {"blk.0.mystery.weight": np.zeros(4, np.float32)})
    with pytest.raises(ValueError, match="mystery"):
        fmt.iter_weights(str(path))


def test_copy_is_reread_after_change(fmt, tiny_llama_gguf, tmp_path):
    """The header cache is keyed on the file's identity: a rewritten file is parsed again."""
    path, config, state = tiny_llama_gguf
    copy = tmp_path / "copy.gguf"
    shutil.copy(path, copy)
    assert fmt.load_config(str(copy))["tie_word_embeddings"] is False
    tensors = _gguf_tensors({k: v for k, v in state.items() if k != "lm_head.weight"}, config, permute=True)
    _write_gguf(copy, "llama", config, tensors)
    assert fmt.load_config(str(copy))["tie_word_embeddings"] is True
