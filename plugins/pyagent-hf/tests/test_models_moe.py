"""Mixtral and Qwen3-MoE: greedy parity with transformers' own generate() on tiny random
checkpoints (fp32) through the whole engine, with the torch and the native attention
backend, chunked prefill and prefix caching on; routing equal to transformers' routers
(ties included); experts computed grouped by expert; both checkpoint layouts; GGUF
copies (float, and with Q8_0 experts kept packed) giving the same tokens.

Three checkpoints: Mixtral (always renormalised), Qwen3-MoE with ``norm_topk_prob``
true, and Qwen3-MoE with ``norm_topk_prob`` false, top-3 of 6 experts and a dense
layer (``mlp_only_layers``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pyagent_framework import LLM, SamplingParams, registries  # noqa: E402
from tests.tiny_models import COMMON, EXACT, assert_same_greedy, engine_greedy, hf_greedy, hf_model, parity_prompts, save_tokenizer  # noqa: E402

MAX_NEW = 16
CASES = ("mixtral", "qwen3moe-norm", "qwen3moe-dense")
ARCH_NAME = {"mixtral": "MixtralForCausalLM", "qwen3moe-norm": "Qwen3MoeForCausalLM", "qwen3moe-dense": "Qwen3MoeForCausalLM"}


def _config(case: str):
    if case == "mixtral":
        return transformers.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)
    if case == "qwen3moe-norm":
        return transformers.Qwen3MoeConfig(
            **COMMON, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
            norm_topk_prob=True, tie_word_embeddings=True,
        )
    return transformers.Qwen3MoeConfig(
        **{**COMMON, "num_hidden_layers": 3}, head_dim=16, num_experts=6, num_experts_per_tok=3,
        moe_intermediate_size=32, norm_topk_prob=False, mlp_only_layers=[1], tie_word_embeddings=False,
    )


def _randomize(model, seed: int) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # away from 1, so a misplaced norm shows
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith("gate.weight"):  # the routers: clear choices between experts
                param.normal_(0.0, 0.5)
            elif param.dim() >= 2:  # transformers 5 holds experts as 3-D parameters
                param.normal_(0.0, 0.1)


def _checkpoint(case: str, directory: Path) -> str:
    model = transformers.AutoModelForCausalLM.from_config(_config(case))
    _randomize(model, {"mixtral": 21, "qwen3moe-norm": 22, "qwen3moe-dense": 23}[case])
    model.save_pretrained(directory, safe_serialization=True)
    save_tokenizer(directory)
    return str(directory)



def _prompts() -> list[list[int]]:
    return parity_prompts(9)


@pytest.fixture(scope="module", params=CASES)
def reference(request, tmp_path_factory):
    case = request.param
    path = _checkpoint(case, tmp_path_factory.mktemp(f"tiny-{case}"))
    prompts = _prompts()
    model = hf_model(path)
    expected = [hf_greedy(model, p, MAX_NEW, eos_token_id=None) for p in prompts]
    for tokens, _ in expected:
        assert len(tokens) == MAX_NEW
    assert len({tuple(t) for t, _ in expected}) > 1  # not flat: parity is meaningful
    return case, path, prompts, expected


def _our_model(path: str, backend: str = "torch"):
    """Our architecture built from the checkpoint's config.json and loaded from its
    safetensors, outside the engine."""
    from pyagent_hf.safetensors_format import SafetensorsFormat

    config = json.loads((Path(path) / "config.json").read_text())
    cls = registries.model_architectures.load(config["architectures"][0])
    model = cls(config, registries.attention_backends.load(backend))
    SafetensorsFormat().load_into(model, path)
    return model


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=0, ignore_eos=True)


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_greedy_matches_transformers_chunked_and_prefix_cached(reference, backend):
    if backend == "native":
        pytest.importorskip("pyagent_native")
    from pyagent_hf.models.moe import SparseMoeBlock

    case, path, prompts, expected = reference
    # 7 tokens a step: every prompt but the single-token one is prefilled in chunks,
    # beside other sequences' decodes; block_size 4 files the shared prefix in blocks.
    llm = LLM(
        path, attention_backend=backend, max_num_batched_tokens=7, block_size=4,
        enable_prefix_caching=True, kv_cache_memory="64MiB",
    )
    model = llm.engine.core.model
    assert type(model).__name__ == ARCH_NAME[case]
    assert model.use_fused_decode is False and model._fused_decoder() is None
    sparse = [isinstance(layer.mlp, SparseMoeBlock) for layer in model.model.layers]
    assert sparse == ([True, False, True] if case == "qwen3moe-dense" else [True, True])
    attn = model.model.layers[0].self_attn.attn
    assert type(attn).__name__ == {"torch": "TorchAttention", "native": "NativeAttention"}[backend]
    # The native backend computes the experts in its grouped kernel, the torch one in
    # the block's own grouped torch path: both against transformers.
    fused = model.model.layers[0].mlp._fused_experts()
    assert type(fused).__name__ == {"torch": "NoneType", "native": "NativeExperts"}[backend]
    # One request first, so the others find its prefix filed; then all together, twice.
    assert_same_greedy(engine_greedy(llm, prompts[:1], GREEDY), expected[:1])
    assert_same_greedy(engine_greedy(llm, prompts, GREEDY), expected)
    assert_same_greedy(engine_greedy(llm, prompts, GREEDY), expected)
    stats = llm.engine.stats()
    assert stats["prefix_caching"] and stats["prefix_cache_hits"] > 0


def test_routers_choose_the_experts_transformers_chooses(reference):
    """Every MoE layer's router, given the same hidden states, picks the same experts in
    the same order with the same weights as the transformers module of that layer."""
    case, path, _, _ = reference
    ours, theirs = _our_model(path), hf_model(path)
    torch.manual_seed(0)
    x = torch.randn(200, COMMON["hidden_size"])
    compared = 0
    for mine, hf_layer in zip(ours.model.layers, theirs.model.layers, strict=True):
        if not hasattr(mine.mlp, "gate"):
            assert not hasattr(hf_layer.mlp, "gate")  # a dense layer on both sides
            continue
        _, hf_weights, hf_experts = hf_layer.mlp.gate(x)
        weights, experts = mine.mlp.gate(x)
        assert torch.equal(experts, hf_experts)
        assert torch.equal(weights, hf_weights)
        compared += 1
    assert compared == 2  # every case has two MoE layers


def test_engine_routes_prompt_tokens_as_transformers(reference):
    """In the running model: for every token of a prompt, every MoE layer's router
    (watched by a forward hook) picks the experts transformers' router picks in its
    own forward of the same prompt."""
    case, path, prompts, _ = reference
    prompt = prompts[-2]  # 37 tokens
    theirs = hf_model(path)
    hf_choice: dict[int, torch.Tensor] = {}
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda m, a, out, i=i: hf_choice.__setitem__(i, out[2]))
        for i, layer in enumerate(theirs.model.layers) if hasattr(layer.mlp, "gate")
    ]
    with torch.no_grad():
        theirs(torch.tensor([prompt]))
    for hook in hooks:
        hook.remove()
    llm = LLM(path, attention_backend="torch", max_num_batched_tokens=64, kv_cache_memory="64MiB")
    ours: dict[int, list[torch.Tensor]] = {}
    for i, layer in enumerate(llm.engine.core.model.model.layers):
        if hasattr(layer.mlp, "gate"):
            layer.mlp.gate.register_forward_hook(lambda m, a, out, i=i: ours.setdefault(i, []).append(out[1]))
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))
    assert sorted(ours) == sorted(hf_choice) and len(ours) == 2
    for i, choice in hf_choice.items():
        assert torch.equal(torch.cat(ours[i]), choice), f"layer {i}"


def test_expert_count_from_either_config_key():
    """Hub Qwen3-MoE configs name the count ``num_experts``, transformers 5 writes
    ``num_local_experts``; either works, and two different counts are an error."""
    from pyagent_hf.models.moe import Qwen3MoeForCausalLM

    backend = registries.attention_backends.load("torch")
    config = {**COMMON, "head_dim": 16, "moe_intermediate_size": 32, "num_experts_per_tok": 2}
    assert Qwen3MoeForCausalLM({**config, "num_experts": 5}, backend).num_experts == 5
    assert Qwen3MoeForCausalLM({**config, "num_local_experts": 3}, backend).num_experts == 3
    with pytest.raises(ValueError, match="num_local_experts and num_experts disagree"):
        Qwen3MoeForCausalLM({**config, "num_experts": 5, "num_local_experts": 3}, backend)
    with pytest.raises(ValueError, match=r"num_experts_per_tok \(6\) must be between 1 and the number of experts \(5\)"):
        Qwen3MoeForCausalLM({**config, "num_experts": 5, "num_experts_per_tok": 6}, backend)


def _tied_routers(kind: str, norm: bool = True):
    """A transformers router of 6 experts, top-3, whose weight rows come in equal
    pairs (experts 2k and 2k+1 always score the same), and ours with the same weight."""
    from pyagent_hf.models.moe import TopKRouter

    hidden = 16
    if kind == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

        hf = MixtralTopKRouter(transformers.MixtralConfig(hidden_size=hidden, num_local_experts=6, num_experts_per_tok=3))
    else:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

        hf = Qwen3MoeTopKRouter(
            transformers.Qwen3MoeConfig(hidden_size=hidden, num_experts=6, num_experts_per_tok=3, norm_topk_prob=norm)
        )
    torch.manual_seed(1)
    rows = torch.randn(3, hidden)
    weight = rows.repeat_interleave(2, dim=0)  # [a, a, b, b, c, c]
    with torch.no_grad():
        hf.weight.copy_(weight)
    ours = TopKRouter(hidden, 6, 3, renormalize=norm, weights_in_input_dtype=kind != "mixtral")
    with torch.no_grad():
        ours.weight.copy_(weight)
    return hf, ours


@pytest.mark.parametrize("kind,norm", [("mixtral", True), ("qwen3moe", True), ("qwen3moe", False)])
def test_tied_router_scores_resolve_as_transformers_resolves_them(kind, norm):
    """With equal pairs of experts and top-3, the third choice splits a tie on every
    token (and a zero hidden state ties all six): the same experts, in the same
    order, as transformers' router."""
    hf, ours = _tied_routers(kind, norm)
    torch.manual_seed(2)
    x = torch.cat([torch.randn(64, 16), torch.zeros(2, 16)])
    _, hf_weights, hf_experts = hf(x)
    weights, experts = ours(x)
    # The ties are real: each token's third choice has a twin that scores exactly the
    # same and is left out (for the zero rows, all six score the same).
    twins = experts[:, 2] ^ 1
    probs = torch.softmax(torch.nn.functional.linear(x, ours.weight), dim=-1)
    assert torch.equal(probs.gather(1, twins[:, None]), probs.gather(1, experts[:, 2:3]))
    assert not (experts[:64] == twins[:64, None]).any()
    assert (probs[64:] == probs[64:, :1]).all()
    assert torch.equal(experts, hf_experts)
    assert torch.equal(weights, hf_weights)


def test_experts_are_computed_grouped_by_expert(reference):
    """One MoE block on a batch of 50 tokens: each expert runs once, on all the
    (token, slot) pairs routed to it, and the result equals transformers' block."""
    case, path, _, _ = reference
    ours, theirs = _our_model(path), hf_model(path)
    block, hf_block = ours.model.layers[0].mlp, theirs.model.layers[0].mlp
    torch.manual_seed(3)
    x = torch.randn(50, COMMON["hidden_size"])
    calls: list[tuple[int, int]] = []
    hooks = [
        expert.register_forward_hook(lambda module, args, out, e=e: calls.append((e, args[0].shape[0])))
        for e, expert in enumerate(block.experts)
    ]
    try:
        got = block(x)
    finally:
        for hook in hooks:
            hook.remove()
    _, experts = block.gate(x)
    routed = torch.bincount(experts.reshape(-1), minlength=len(block.experts)).tolist()
    assert calls == [(e, n) for e, n in enumerate(routed) if n]
    assert max(n for _, n in calls) > 1
    with torch.no_grad():
        want = hf_block(x[None])[0]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_transformers_fused_expert_layout_loads_the_same(reference):
    """transformers 5 holds the experts as 3-D ``mlp.experts.gate_up_proj`` /
    ``down_proj`` parameters (its state_dict); loaded through those names, the model is
    the one loaded from the per-expert checkpoint."""
    case, path, _, _ = reference
    from pyagent_hf.models.moe import SparseMoeBlock

    state = hf_model(path).state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    classic = _our_model(path)
    config = json.loads((Path(path) / "config.json").read_text())
    fused = type(classic)(config, registries.attention_backends.load("torch"))
    fused.load_weights(state.items())
    for (name, a), (_, b) in zip(classic.state_dict().items(), fused.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert any(isinstance(layer.mlp, SparseMoeBlock) for layer in fused.model.layers)


def test_malformed_expert_tensors_are_clear_errors(reference):
    case, path, _, _ = reference
    model = _our_model(path)
    experts = model.num_experts
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.down_proj.*expected"):
        model.load_weights([("model.layers.0.mlp.experts.down_proj", torch.zeros(experts + 1, 64, 8))])
    with pytest.raises(ValueError, match=rf"unexpected weight 'model\.layers\.0\.mlp\.experts\.{experts}\.up_proj"):
        model.load_weights([(f"model.layers.0.mlp.experts.{experts}.up_proj.weight", torch.zeros(8, 64))])
    with pytest.raises(ValueError, match=r"gate\.weight' has shape"):
        model.load_weights([("model.layers.0.mlp.gate.weight", torch.zeros(experts + 1, 64))])


def test_sparse_layers_follow_decoder_sparse_step_and_mlp_only_layers():
    """Which layers are sparse, from ``decoder_sparse_step`` and ``mlp_only_layers``,
    as transformers builds them (every second layer of 6, but layer 3 dense-only)."""
    from pyagent_hf.models.moe import Qwen3MoeForCausalLM, SparseMoeBlock

    config = transformers.Qwen3MoeConfig(
        **{**COMMON, "num_hidden_layers": 6}, head_dim=16, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, decoder_sparse_step=2, mlp_only_layers=[3],
    )
    hf = transformers.AutoModelForCausalLM.from_config(config)
    want = [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in hf.model.layers]
    ours = Qwen3MoeForCausalLM(config.to_dict(), registries.attention_backends.load("torch"))
    got = [isinstance(layer.mlp, SparseMoeBlock) for layer in ours.model.layers]
    assert got == want == [False, True, False, False, False, True]


def test_int8_quantizes_the_experts_and_keeps_the_router_float(reference):
    case, path, prompts, _ = reference
    llm = LLM(path, quantization="int8", max_num_batched_tokens=64, kv_cache_memory="64MiB")
    model = llm.engine.core.model
    block = model.model.layers[0].mlp
    assert type(block.experts[0].gate_up_proj).__name__ == "PackedLinear"
    assert block.experts[0].gate_up_proj.packed.encoding == "I8"
    assert block.gate.weight.dtype == torch.float32
    (tokens, _), = engine_greedy(llm, prompts[:1], GREEDY)
    assert len(tokens) == MAX_NEW


# -- GGUF ---------------------------------------------------------------------------------


def _gguf(case: str, path: str, out: Path, types_for_experts: str | None = None) -> Path:
    """The checkpoint written as llama.cpp writes it: Mixtral as ``llama`` (Q/K rows
    permuted) with ``expert_count``, Qwen3-MoE as ``qwen3moe``; the experts as 3-D
    ``ffn_*_exps`` tensors, optionally in GGML type ``types_for_experts``."""
    import gguf

    from tests.tiny_gguf import hf_state, stack_experts, write_gguf

    config = _config(case)
    state = stack_experts(hf_state(path))
    if case == "mixtral":
        arch, arch_enum = "llama", gguf.MODEL_ARCH.LLAMA
        metadata = {"expert_count": config.num_local_experts, "expert_used_count": config.num_experts_per_tok}
    else:
        arch, arch_enum = "qwen3moe", gguf.MODEL_ARCH.QWEN3MOE
        metadata = {
            "expert_count": config.num_experts,
            "expert_used_count": config.num_experts_per_tok,
            "expert_feed_forward_length": config.moe_intermediate_size,
            "expert_weights_norm": config.norm_topk_prob,
        }
    # llama.cpp's qwen3moe has no dense-layer names; a dense layer takes the shared ones.
    names = {
        f"model.layers.{i}.mlp.{hf}.weight": f"blk.{i}.{ggml}.weight"
        for i in getattr(config, "mlp_only_layers", [])
        for hf, ggml in (("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"), ("down_proj", "ffn_down"))
    }
    types = None
    if types_for_experts is not None:
        name_map = gguf.get_tensor_name_map(arch_enum, config.num_hidden_layers)
        types = {
            name_map.get_name(name, try_suffixes=(".weight",)): types_for_experts for name in state if ".experts." in name
        }
    return write_gguf(
        out, arch, config, state, permute_qk=case == "mixtral", metadata=metadata, names=names, types=types
    )


def test_gguf_copy_gives_the_same_tokens(reference, tmp_path):
    """The checkpoint written to GGUF (gguf's own name map; experts stacked 3-D) reads
    back to the same model: the same tokens as transformers on the safetensors copy."""
    pytest.importorskip("gguf")
    case, path, prompts, expected = reference
    llm = LLM(
        str(_gguf(case, path, tmp_path / f"{case}.gguf")), tokenizer=path, max_num_batched_tokens=7,
        block_size=4, kv_cache_memory="64MiB",
    )
    model = llm.engine.core.model
    assert type(model).__name__ == ARCH_NAME[case]
    assert (model.num_experts, model.top_k, model.norm_topk_prob) == {
        "mixtral": (4, 2, True), "qwen3moe-norm": (8, 2, True), "qwen3moe-dense": (6, 3, False)
    }[case]
    assert_same_greedy(engine_greedy(llm, prompts, GREEDY), expected)


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_gguf_q8_0_experts_stay_packed(reference, tmp_path, backend):
    """Q8_0 expert tensors load as one packed linear per expert and projection (the
    router stays float), and with exact activations give the tokens of the same file
    dequantized: through
    the block's grouped torch path (torch backend) and the native grouped kernel."""
    pytest.importorskip("gguf")
    if backend == "native":
        pytest.importorskip("pyagent_native")
    case, path, prompts, _ = reference
    file = str(_gguf(case, path, tmp_path / f"{case}-q8.gguf", "Q8_0"))
    packed = LLM(
        file, tokenizer=path, attention_backend=backend, max_num_batched_tokens=7, block_size=4, kv_cache_memory="64MiB",
        quantization_config=EXACT,
    )
    block = packed.engine.core.model.model.layers[0].mlp
    for expert in block.experts:
        for linear in (expert.gate_up_proj, expert.down_proj):
            assert type(linear).__name__ == "PackedLinear" and linear.packed.encoding == "Q8_0"
    assert block.gate.weight.dtype == torch.float32
    assert (block._fused_experts() is not None) == (backend == "native")
    floats = LLM(
        file, tokenizer=path, attention_backend="torch", quantization="none", max_num_batched_tokens=7, block_size=4,
        kv_cache_memory="64MiB",
    )
    assert type(floats.engine.core.model.model.layers[0].mlp.experts[0].gate_up_proj).__name__ == "Linear"
    assert_same_greedy(engine_greedy(packed, prompts, GREEDY), engine_greedy(floats, prompts, GREEDY))


def test_a_3d_tensor_that_is_not_an_expert_tensor_is_a_clear_error(tmp_path):
    pytest.importorskip("gguf")
    from tests.tiny_gguf import write_gguf

    config = transformers.LlamaConfig(**{**COMMON, "num_hidden_layers": 1})
    state = {"model.layers.0.mlp.up_proj.weight": torch.zeros(2, 96, 64)}
    file = write_gguf(tmp_path / "bad.gguf", "llama", config, state)
    from pyagent_hf.gguf_format import GGUFFormat

    with pytest.raises(ValueError, match=r"blk\.0\.ffn_up\.weight.*3-D.*not an expert tensor"):
        list(GGUFFormat().iter_weights(str(file)))


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_gguf_q4_k_experts_stay_packed(tmp_path, backend):
    """A qwen3moe file whose experts are Q4_K (rows of 256: a wider tiny model) keeps
    each expert's gate/up and down packed in Q4_K, and with exact activations gives the
    tokens of the same file dequantized."""
    pytest.importorskip("gguf")
    if backend == "native":
        pytest.importorskip("pyagent_native")
    import gguf

    from tests.tiny_gguf import stack_experts, write_gguf

    config = transformers.Qwen3MoeConfig(
        **{**COMMON, "hidden_size": 256, "num_hidden_layers": 1}, head_dim=64, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=256, norm_topk_prob=True, tie_word_embeddings=False,
    )
    model = transformers.AutoModelForCausalLM.from_config(config)
    _randomize(model, 24)
    state = stack_experts({name: t.detach() for name, t in model.state_dict().items() if ".experts." not in name})
    # transformers' own 3-D layout, split into the converter's gate/up/down stacks.
    for name, t in model.state_dict().items():
        if name.endswith("experts.gate_up_proj"):
            prefix = name.rsplit(".", 1)[0]
            state[f"{prefix}.gate_proj.weight"], state[f"{prefix}.up_proj.weight"] = t.detach().chunk(2, dim=1)
        elif name.endswith("experts.down_proj"):
            state[f"{name}.weight"] = t.detach()
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3MOE, 1)
    types = {name_map.get_name(n, try_suffixes=(".weight",)): "Q4_K" for n in state if ".experts." in n}
    assert len(types) == 3
    metadata = {"expert_count": 4, "expert_used_count": 2, "expert_feed_forward_length": 256}
    file = str(write_gguf(tmp_path / "q4k.gguf", "qwen3moe", config, state, metadata=metadata, types=types))
    tokenizer = tmp_path / "tokenizer"
    save_tokenizer(tokenizer)
    packed = LLM(file, tokenizer=str(tokenizer), attention_backend=backend, max_num_batched_tokens=7, kv_cache_memory="64MiB",
                 quantization_config=EXACT)
    for expert in packed.engine.core.model.model.layers[0].mlp.experts:
        assert [expert.gate_up_proj.packed.encoding, expert.down_proj.packed.encoding] == ["Q4_K", "Q4_K"]
    floats = LLM(
        file, tokenizer=str(tokenizer), attention_backend="torch", quantization="none", max_num_batched_tokens=7,
        kv_cache_memory="64MiB",
    )
    prompts = _prompts()[:4]
    got, want = engine_greedy(packed, prompts, GREEDY), engine_greedy(floats, prompts, GREEDY)
    assert len({tuple(t) for t, _ in want}) > 1
    assert_same_greedy(got, want)
