"""Phi-3 through the whole engine: greedy parity with transformers on tiny random
Phi3ForCausalLM checkpoints (fp32), with the torch and the native attention backend,
chunked prefill and prefix caching on. Token ids must be identical for every step and
each step's logprob of the chosen token within 1e-4.

Three configurations:

- ``window``: a sliding window (6 tokens) shorter than the prompts, full rotary;
- ``phi4``: Phi-4-mini's shape: ``partial_rotary_factor`` 0.75, LongRoPE and tied
  embeddings;
- ``longrope``: LongRoPE with full rotary (``original_max_position_embeddings`` 32,
  ``max_position_embeddings`` 256) and an explicit ``attention_factor``.

LongRoPE picks the short or long factors per sequence by the sequence's length after
each step. The tests compare with transformers' ``generate()`` where it computes the
same thing: sequences that stay on one side of the limit for their whole life (short
prompts in small chunks; long prompts, each prefilled in one step, beside short ones in
one batch). A sequence whose chunks or decode steps cross the limit is compared with
transformers' forward with a cache fed the same pieces (Phi-3's ``generate()`` also
recomputes the whole sequence once it first crosses; the engine does not).

The native backend's fused decode step serves ``window`` and ``longrope`` (it takes the
model's cos/sin, LongRoPE's included) and is declined for ``phi4`` (it rotates whole
heads).
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pyagent_framework import LLM, SamplingParams, registries  # noqa: E402
from tests.tiny_models import COMMON, EXACT, assert_same_greedy, engine_greedy, hf_greedy, hf_model, save_tokenizer  # noqa: E402

MAX_NEW = 16
ORIGINAL = 32  # original_max_position_embeddings of the LongRoPE configurations
KINDS = ("window", "phi4", "longrope")
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=0, ignore_eos=True)


def _factors(half: int, seed: int) -> tuple[list[float], list[float]]:
    """LongRoPE factors far apart (short near 1, long growing to ~12 over the
    dimensions), so a token rotated with the wrong set shows in the logits."""
    rng = random.Random(seed)
    short = [round(1.0 + 0.1 * i + 0.05 * rng.random(), 4) for i in range(half)]
    long = [round(1.0 + 11.0 * i / (half - 1) + 0.3 * rng.random(), 4) for i in range(half)]
    return short, long


def _config(kind: str):
    common = {**COMMON, "pad_token_id": None}  # Phi3Config's default pad id is outside the tiny vocabulary
    if kind == "window":
        return transformers.Phi3Config(**common, sliding_window=6, tie_word_embeddings=False)
    # head_dim 16: "phi4" rotates 12 values of each head (6 factors), "longrope" all 16 (8).
    partial = 0.75 if kind == "phi4" else 1.0
    short, long = _factors(int(16 * partial) // 2, seed={"phi4": 1, "longrope": 2}[kind])
    rope = dict(rope_type="longrope", rope_theta=10000.0, short_factor=short, long_factor=long)
    if kind == "longrope":
        rope["attention_factor"] = 1.3
    return transformers.Phi3Config(
        **common,
        original_max_position_embeddings=ORIGINAL,
        rope_parameters={**rope, "partial_rotary_factor": partial},
        tie_word_embeddings=kind == "phi4",
    )


def _checkpoint(kind: str, directory: Path) -> str:
    torch.manual_seed({"window": 21, "phi4": 22, "longrope": 23}[kind])
    model = transformers.AutoModelForCausalLM.from_config(_config(kind))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # away from 1, so a misplaced norm shows
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif param.dim() == 2:
                param.normal_(0.0, 0.1)
    model.save_pretrained(directory, safe_serialization=True)
    save_tokenizer(directory)
    return str(directory)


def _chunked_prompts(kind: str) -> list[list[int]]:
    """Two pairs sharing a 12-token prefix (whole blocks), and three strangers (one a
    single token). For LongRoPE every sequence stays within ORIGINAL tokens (prompt +
    16 new); the windowed model gets a 37-token stranger too."""
    rng = random.Random(7)
    prefix = [rng.randrange(2, 300) for _ in range(12)]
    tails = [[rng.randrange(2, 300) for _ in range(n)] for n in (1, 4)]
    others = [[rng.randrange(2, 300) for _ in range(n)] for n in (1, 6, 37 if kind == "window" else 15)]
    return [prefix + tails[0], prefix + tails[1], *others, prefix + tails[0][:3]]


def _long_prompts() -> list[list[int]]:
    """Prompts longer than ORIGINAL (two sharing a 36-token prefix) beside two that stay
    short for their whole life (prompt + 16 new <= ORIGINAL)."""
    rng = random.Random(8)
    prefix = [rng.randrange(2, 300) for _ in range(36)]
    longs = [prefix + [rng.randrange(2, 300) for _ in range(n)] for n in (2, 9)]
    longs += [[rng.randrange(2, 300) for _ in range(n)] for n in (33, 61)]
    shorts = [[rng.randrange(2, 300) for _ in range(n)] for n in (5, 16)]
    return [longs[0], shorts[0], longs[1], longs[2], shorts[1], longs[3]]


_REFERENCES: dict[str, tuple] = {}


def _reference(kind: str, tmp_path_factory) -> tuple:
    """(kind, checkpoint path, transformers model, prompts, expected) per prompt group,
    made once per kind for the module's tests."""
    if kind not in _REFERENCES:
        _REFERENCES[kind] = _make_reference(kind, tmp_path_factory)
    return _REFERENCES[kind]


@pytest.fixture(scope="module", params=KINDS)
def reference(request, tmp_path_factory):
    return _reference(request.param, tmp_path_factory)


@pytest.fixture(scope="module", params=("phi4", "longrope"))
def longrope_reference(request, tmp_path_factory):
    return _reference(request.param, tmp_path_factory)


def _make_reference(kind: str, tmp_path_factory) -> tuple:
    path = _checkpoint(kind, tmp_path_factory.mktemp(f"tiny-phi3-{kind}"))
    model = hf_model(path)
    prompts = {"chunked": _chunked_prompts(kind)}
    if kind != "window":
        prompts["long"] = _long_prompts()
        # The chunked group never leaves the short factors (chunks end anywhere).
        assert all(len(p) + MAX_NEW <= ORIGINAL for p in prompts["chunked"])
    expected = {}
    for group, group_prompts in prompts.items():
        expected[group] = [hf_greedy(model, p, MAX_NEW, eos_token_id=None) for p in group_prompts]
        for tokens, _ in expected[group]:
            assert len(tokens) == MAX_NEW
        # Not flat: greedy choices differ between prompts (so parity is meaningful).
        assert len({tuple(t) for t, _ in expected[group]}) > 1
    return kind, path, model, prompts, expected


def _llm(path: str, backend: str, budget: int) -> LLM:
    return LLM(
        path, attention_backend=backend, max_num_batched_tokens=budget, block_size=4,
        enable_prefix_caching=True, kv_cache_memory="64MiB",
    )


def _count_fused_calls(model) -> list[int]:
    """Wraps the model's fused decode step (which must exist) so its calls are counted."""
    fused = model._fused_decoder()
    assert fused is not None
    calls: list[int] = []

    def counted(*args):
        taken = fused(*args)
        calls.append(int(taken))
        return taken

    model._fused = counted
    return calls


def _check_model(llm: LLM, kind: str, backend: str):
    """Checks the engine's model was built as ``kind`` says; on the native backend with
    full rotary, returns the list the fused decode step's calls are counted in."""
    model = llm.engine.core.model
    assert type(model).__name__ == "Phi3ForCausalLM"
    attn = model.model.layers[0].self_attn.attn
    assert type(attn).__name__ == {"torch": "TorchAttention", "native": "NativeAttention"}[backend]
    assert model.rotary_emb.rotary_dim == (12 if kind == "phi4" else 16)
    assert model.rotary_emb.rope_type == ("default" if kind == "window" else "longrope")
    assert model.layer_windows == [6 if kind == "window" else None] * 2
    calls = None
    if kind == "phi4":
        assert model.use_fused_decode is False and model._fused_decoder() is None
    elif backend == "native":
        calls = _count_fused_calls(model)
    return calls


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_greedy_matches_transformers_chunked_and_prefix_cached(reference, backend):
    if backend == "native":
        pytest.importorskip("pyagent_native")
    kind, path, _, prompts, expected = reference
    prompts, expected = prompts["chunked"], expected["chunked"]
    # 7 tokens a step: every prompt but the single-token one is prefilled in chunks,
    # beside other sequences' decodes; block_size 4 files the shared prefix in blocks.
    llm = _llm(path, backend, 7)
    calls = _check_model(llm, kind, backend)
    # One request first, so the others find its prefix filed; then all together, twice.
    assert_same_greedy(engine_greedy(llm, prompts[:1], GREEDY), expected[:1])
    assert_same_greedy(engine_greedy(llm, prompts, GREEDY), expected)
    assert_same_greedy(engine_greedy(llm, prompts, GREEDY), expected)
    stats = llm.engine.stats()
    assert stats["prefix_caching"] and stats["prefix_cache_hits"] > 0
    if calls is not None:  # the decodes went through the fused step
        assert sum(calls) > 0


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_longrope_per_sequence_in_one_batch(longrope_reference, backend):
    """Prompts longer than original_max_position_embeddings use the long factors from
    their first token, in the same batches as short sequences that keep the short
    ones: each equals transformers' generate() on that sequence alone. The budget lets
    every prompt be prefilled in one step; the long pair shares a 36-token prefix,
    filed by the first request."""
    if backend == "native":
        pytest.importorskip("pyagent_native")
    kind, path, _, prompts, expected = longrope_reference
    prompts, expected = prompts["long"], expected["long"]
    assert [len(p) > ORIGINAL for p in prompts] == [True, False, True, True, False, True]
    llm = _llm(path, backend, 512)
    calls = _check_model(llm, kind, backend)
    assert_same_greedy(engine_greedy(llm, prompts[:1], GREEDY), expected[:1])
    assert_same_greedy(engine_greedy(llm, prompts, GREEDY), expected)
    assert llm.engine.stats()["prefix_cache_hits"] > 0
    if calls is not None:
        assert sum(calls) > 0


def _hf_cached_greedy(model, pieces: list[list[int]], max_new: int):
    """Greedy decoding by transformers' forward with a cache, the prompt fed in
    ``pieces`` and then one token a step (no recomputation when the length crosses
    original_max_position_embeddings); the tokens and each one's logprob."""
    cache = transformers.DynamicCache(config=model.config)
    done = 0

    def forward(ids):
        nonlocal done
        with torch.no_grad():
            out = model(
                torch.tensor([ids]), cache=cache, use_cache=True,
                position_ids=torch.arange(done, done + len(ids))[None],
            )
        done += len(ids)
        return out.logits[0, -1].float()

    for piece in pieces:
        logits = forward(piece)
    tokens, logprobs = [], []
    for _ in range(max_new):
        token = int(logits.argmax())
        tokens.append(token)
        logprobs.append(float(torch.log_softmax(logits, -1)[token]))
        logits = forward([token])
    return tokens, logprobs


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_longrope_crossing_the_limit_in_chunks_and_while_decoding(longrope_reference, backend):
    """A 40-token prompt prefilled 16 tokens a step (chunks ending at 16 and 32 use the
    short factors, the last the long ones) and a 24-token prompt whose decoding crosses
    32 tokens: each token uses the factors of its sequence's length after its step, and
    cached keys keep theirs, as in transformers' forward with a cache fed the same
    pieces. One request at a time, so the chunks are known."""
    if backend == "native":
        pytest.importorskip("pyagent_native")
    kind, path, model, _, _ = longrope_reference
    rng = random.Random(9)
    long_prompt = [rng.randrange(2, 300) for _ in range(40)]
    short_prompt = [rng.randrange(2, 300) for _ in range(24)]
    want = [
        _hf_cached_greedy(model, [long_prompt[:16], long_prompt[16:32], long_prompt[32:]], MAX_NEW),
        _hf_cached_greedy(model, [short_prompt[:16], short_prompt[16:]], MAX_NEW),
    ]
    llm = _llm(path, backend, 16)
    calls = _check_model(llm, kind, backend)
    got = [engine_greedy(llm, [p], GREEDY)[0] for p in (long_prompt, short_prompt)]
    assert_same_greedy(got, want)
    if calls is not None:
        assert sum(calls) > 0
    # Phi-3's generate() recomputes the 24-token sequence when it crosses: its steps
    # after the crossing differ from the cached forward's (the factors matter).
    regenerated = hf_greedy(model, short_prompt, MAX_NEW, eos_token_id=None)
    crossing = ORIGINAL + 1 - len(short_prompt)  # the first step whose sequence exceeds the limit
    assert regenerated[1][:crossing] == pytest.approx(want[1][1][:crossing], abs=1e-4)
    assert regenerated[1][crossing:] != pytest.approx(want[1][1][crossing:], abs=1e-4)


def test_native_backend_fused_decoder_declined_for_partial_rotary(reference, monkeypatch):
    """The native backend offers ``fuse_decoder``; Phi-3 asks for it with full rotary
    and never with partial rotary (the fused step rotates whole heads)."""
    pytest.importorskip("pyagent_native")
    kind, path, _, _, _ = reference
    backend = registries.attention_backends.load("native")
    cls = registries.model_architectures.load("Phi3ForCausalLM")
    model = cls(json.loads((Path(path) / "config.json").read_text()), backend)
    called = []
    monkeypatch.setattr(backend, "fuse_decoder", classmethod(lambda c, layers, shape: called.append(shape) or None))
    assert model._fused_decoder() is None
    if kind == "phi4":
        assert model.use_fused_decode is False and not called
    else:
        assert model.use_fused_decode is True and len(called) == 1 and called[0]["head_dim"] == 16


def _gguf_copy(kind: str, path: str, directory: Path, encoding: str | None = None) -> Path:
    """The checkpoint as llama.cpp's converter writes a ``phi3`` GGUF: gguf's own name map
    (``attn_qkv``, ``ffn_up`` = gate | up), the rope factors as top-level tensors and the
    metadata Phi3MiniModel writes."""
    from tests.tiny_gguf import hf_state, write_gguf

    config = _config(kind)
    state = hf_state(path)
    metadata = {"attention.sliding_window": config.sliding_window or 0}
    names = {}
    rope = config.rope_parameters
    if rope["rope_type"] == "longrope":
        scale = config.max_position_embeddings / ORIGINAL
        attn_factor = rope.get("attention_factor") or math.sqrt(1 + math.log(scale) / math.log(ORIGINAL))
        metadata.update({"rope.scaling.original_context_length": ORIGINAL, "rope.scaling.attn_factor": attn_factor})
        for key in ("long", "short"):
            state[f"rope_{key}"] = torch.tensor(rope[f"{key}_factor"], dtype=torch.float32)
            names[f"rope_{key}"] = f"rope_factors_{key}.weight"
    types = None
    if encoding is not None:  # the layers' four linears, as a quantized file stores them
        types = {
            f"blk.{i}.{t}.weight": encoding
            for i in range(config.num_hidden_layers)
            for t in ("attn_qkv", "attn_output", "ffn_up", "ffn_down")
        }
    return write_gguf(
        directory / f"phi3-{kind}-{encoding or 'f32'}.gguf", "phi3", config, state,
        metadata=metadata, names=names, types=types,
    )


def test_gguf_copy_gives_the_same_tokens(reference, tmp_path):
    """The checkpoint written to GGUF (fused qkv and gate|up, rope factor tensors,
    sliding window and rotary dimension in the metadata) reads back to the same model:
    the same tokens as transformers on the safetensors copy."""
    pytest.importorskip("gguf")
    kind, path, _, prompts, expected = reference
    gguf_path = _gguf_copy(kind, path, tmp_path)
    from pyagent_hf.gguf_format import GGUFFormat

    config = GGUFFormat().load_config(str(gguf_path))
    assert config["architectures"] == ["Phi3ForCausalLM"]
    assert config["sliding_window"] == (6 if kind == "window" else None)
    if kind != "window":
        rope = config["rope_parameters"]
        want = _config(kind).rope_parameters
        assert rope["rope_type"] == "longrope" and config["original_max_position_embeddings"] == ORIGINAL
        assert rope["short_factor"] == pytest.approx(want["short_factor"], rel=1e-6)
        assert rope["long_factor"] == pytest.approx(want["long_factor"], rel=1e-6)
        assert rope.get("partial_rotary_factor", 1.0) == want["partial_rotary_factor"]
    group = "chunked" if kind == "window" else "long"
    llm = LLM(str(gguf_path), tokenizer=path, max_num_batched_tokens=7 if kind == "window" else 512,
              block_size=4, kv_cache_memory="64MiB")
    model = llm.engine.core.model
    assert type(model).__name__ == "Phi3ForCausalLM"
    assert model.rotary_emb.rotary_dim == (12 if kind == "phi4" else 16)
    assert_same_greedy(engine_greedy(llm, prompts[group], GREEDY), expected[group])


def test_rotary_embedding_longrope_per_token_as_transformers():
    """rope.py's LongRoPE on one flattened batch of a 20-token and a 40-token sequence
    (original_max_position_embeddings 32): each token's cos/sin are what transformers'
    Phi3RotaryEmbedding gives a forward over its sequence alone (short factors for the
    first, long for the second), bit for bit; partial rotary gives rotary_dim // 2
    columns."""
    from pyagent_hf.models.rope import RotaryEmbedding, rope_parameters

    for kind in ("phi4", "longrope"):
        config = _config(kind)
        hf_rope = transformers.models.phi3.modeling_phi3.Phi3RotaryEmbedding(config)
        ours_config = registries.model_architectures.load("Phi3ForCausalLM")._normalized(config.to_dict())
        ours = RotaryEmbedding(16, config.max_position_embeddings, rope_parameters(ours_config), partial=True)
        assert ours.rotary_dim == (12 if kind == "phi4" else 16)
        lengths = (20, 40)
        positions = torch.cat([torch.arange(n) for n in lengths])
        seq_lens = torch.cat([torch.full((n,), n) for n in lengths])
        cos, sin = ours.cos_sin(positions, seq_lens)
        assert cos.shape == (60, ours.rotary_dim // 2)
        start = 0
        for n in lengths:
            want_cos, want_sin = hf_rope(torch.zeros(1, dtype=torch.float32), torch.arange(n)[None])
            half = ours.rotary_dim // 2
            assert torch.equal(cos[start : start + n], want_cos[0, :, :half])
            assert torch.equal(sin[start : start + n], want_sin[0, :, :half])
            start += n
        # The two sets differ (the second sequence is not rotated as the first).
        short_cos, _ = ours.cos_sin(torch.arange(40), torch.full((40,), 20))
        assert not torch.allclose(short_cos, cos[20:], atol=1e-3)


def test_gguf_q8_0_fused_tensors_stay_packed(longrope_reference, tmp_path):
    """Q8_0 ``attn_qkv`` and ``ffn_up`` (gate | up) load as one packed linear each, on
    the native backend (whose fused decode step reads them packed where rotary is
    full), and with exact activations give the tokens of the same file dequantized."""
    pytest.importorskip("gguf")
    pytest.importorskip("pyagent_native")
    kind, path, _, prompts, _ = longrope_reference
    file = str(_gguf_copy(kind, path, tmp_path, "Q8_0"))
    options = dict(tokenizer=path, attention_backend="native", max_num_batched_tokens=512, block_size=4,
                   kv_cache_memory="64MiB")
    packed = LLM(file, quantization_config=EXACT, **options)
    layer = packed.engine.core.model.model.layers[0]
    for linear in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj):
        assert type(linear).__name__ == "PackedLinear" and linear.packed.encoding == "Q8_0"
    calls = _check_model(packed, kind, "native")
    floats = LLM(file, quantization="none", **options)
    assert type(floats.engine.core.model.model.layers[0].self_attn.qkv_proj).__name__ == "Linear"
    assert_same_greedy(engine_greedy(packed, prompts["long"], GREEDY), engine_greedy(floats, prompts["long"], GREEDY))
    if calls is not None:
        assert sum(calls) > 0


def test_fused_and_separate_projection_names_load_the_same_parameters():
    """The checkpoint's fused ``qkv_proj``/``gate_up_proj`` fill the fused linears whole;
    the same rows given as separate ``q_proj``/``k_proj``/``v_proj`` and
    ``gate_proj``/``up_proj`` tensors load into the same places."""
    cls = registries.model_architectures.load("Phi3ForCausalLM")
    torch.manual_seed(3)
    hf = transformers.AutoModelForCausalLM.from_config(_config("window"))
    state = hf.state_dict()
    split = {}
    for name, tensor in state.items():
        if name.endswith("self_attn.qkv_proj.weight"):
            base = name.removesuffix("qkv_proj.weight")
            for part, rows in zip(("q_proj", "k_proj", "v_proj"), tensor.split([64, 32, 32]), strict=True):
                split[f"{base}{part}.weight"] = rows
        elif name.endswith("mlp.gate_up_proj.weight"):
            base = name.removesuffix("gate_up_proj.weight")
            for part, rows in zip(("gate_proj", "up_proj"), tensor.chunk(2), strict=True):
                split[f"{base}{part}.weight"] = rows
        else:
            split[name] = tensor
    backend = registries.attention_backends.load("torch")
    fused, separate = cls(hf.config.to_dict(), backend), cls(hf.config.to_dict(), backend)
    assert fused.load_weights(state.items()) == set(state)
    assert separate.load_weights(split.items()) == set(split)
    for (name, a), (_, b) in zip(fused.state_dict().items(), separate.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    qkv = "model.layers.1.self_attn.qkv_proj.weight"
    assert torch.equal(fused.state_dict()[qkv], state[qkv])
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.qkv_proj\.weight.*shape \(96, 64\)"):
        fused.load_weights([("model.layers.0.self_attn.qkv_proj.weight", torch.zeros(96, 64))])


# ---------------------------------------------------------------------------- bad input


def _tiny_config(**overrides) -> dict:
    config = _config("longrope").to_dict()
    config.update(overrides)
    return config


def test_longrope_factor_of_the_wrong_length_is_named():
    cls = registries.model_architectures.load("Phi3ForCausalLM")
    config = _tiny_config()
    config["rope_parameters"] = {**config["rope_parameters"], "short_factor": [1.0] * 5}
    with pytest.raises(ValueError, match=r"short_factor.*8 numbers.*got 5 values"):
        cls(config, registries.attention_backends.load("torch"))


def test_unsupported_rope_type_is_named():
    cls = registries.model_architectures.load("Phi3ForCausalLM")
    config = _tiny_config(rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0})
    with pytest.raises(ValueError, match="rope type 'llama3' is not supported"):
        cls(config, registries.attention_backends.load("torch"))


def test_old_rope_type_names_read_as_longrope():
    """Phi3Config reads ``rope_scaling`` type ``su`` (and ``yarn``) as ``longrope``."""
    cls = registries.model_architectures.load("Phi3ForCausalLM")
    config = _tiny_config()
    params = config.pop("rope_parameters")
    for old in ("su", "yarn"):
        scaling = {"type": old, "short_factor": params["short_factor"], "long_factor": params["long_factor"]}
        model = cls({**config, "rope_scaling": scaling}, registries.attention_backends.load("torch"))
        assert model.rotary_emb.rope_type == "longrope"
        assert model.rotary_emb.original_max_position_embeddings == ORIGINAL


def test_gguf_with_one_rope_factor_tensor_is_an_error(tmp_path):
    pytest.importorskip("gguf")
    from pyagent_hf.gguf_format import GGUFFormat
    from tests.tiny_gguf import write_gguf

    config = _config("window")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    state = {**model.state_dict(), "rope_long": torch.ones(8)}
    path = write_gguf(
        tmp_path / "half.gguf", "phi3", config, state,
        metadata={"rope.scaling.original_context_length": ORIGINAL}, names={"rope_long": "rope_factors_long.weight"},
    )
    with pytest.raises(ValueError, match="rope_factors_short.weight"):
        GGUFFormat().load_config(str(path))
