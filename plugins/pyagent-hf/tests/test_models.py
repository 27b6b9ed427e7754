"""pyagent-hf's architectures against transformers on tiny random models (fp32).

Each model runs on a small paged KV cache through the built-in "torch" attention
backend: a full prefill, a chunked prefill, single-token decodes and a batch of
sequences decoded together; its logits must match transformers' forward on the whole
sequence.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pyagent_framework import registries  # noqa: E402
from pyagent_framework.interfaces import ModelArchitecture  # noqa: E402
from pyagent_framework.testing import check_registration  # noqa: E402
from pyagent_framework.types import AttentionMetadata, ForwardContext  # noqa: E402

ATOL = RTOL = 1e-4
VOCAB = 128

BASE = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=256,
)

# (id, architecture, transformers config class, config kwargs)
CASES = [
    ("llama", "LlamaForCausalLM", "LlamaConfig", dict(tie_word_embeddings=False)),
    (
        "llama-bias-tied-llama3",
        "LlamaForCausalLM",
        "LlamaConfig",
        dict(
            attention_bias=True,
            mlp_bias=True,
            tie_word_embeddings=True,
            num_key_value_heads=1,
            rope_parameters=dict(
                rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                high_freq_factor=4.0, original_max_position_embeddings=16,
            ),
        ),
    ),
    (
        "llama-linear-headdim",
        "LlamaForCausalLM",
        "LlamaConfig",
        dict(head_dim=24, num_attention_heads=8, rope_parameters=dict(rope_type="linear", rope_theta=1000.0, factor=2.0)),
    ),
    ("mistral", "MistralForCausalLM", "MistralConfig", dict(sliding_window=None, tie_word_embeddings=True)),
    # Sliding windows shorter than the test sequences: every layer (Mistral), and only the
    # layers from max_window_layers on (Qwen2, through the config's layer_types).
    ("mistral-window", "MistralForCausalLM", "MistralConfig", dict(sliding_window=5, tie_word_embeddings=False)),
    (
        "qwen2-window",
        "Qwen2ForCausalLM",
        "Qwen2Config",
        dict(use_sliding_window=True, sliding_window=6, max_window_layers=1, tie_word_embeddings=True),
    ),
    (
        "qwen2-yarn",
        "Qwen2ForCausalLM",
        "Qwen2Config",
        dict(
            tie_word_embeddings=True,
            rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64),
        ),
    ),
    ("qwen2-untied", "Qwen2ForCausalLM", "Qwen2Config", dict(tie_word_embeddings=False, rope_parameters=dict(rope_type="default", rope_theta=1e6))),
    ("qwen3", "Qwen3ForCausalLM", "Qwen3Config", dict(head_dim=32, tie_word_embeddings=True)),
    ("qwen3-bias", "Qwen3ForCausalLM", "Qwen3Config", dict(head_dim=16, attention_bias=True, tie_word_embeddings=False)),
    (
        "qwen3-dynamic",
        "Qwen3ForCausalLM",
        "Qwen3Config",
        dict(head_dim=16, max_position_embeddings=256, rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0)),
    ),
    (
        "granite",
        "GraniteForCausalLM",
        "GraniteConfig",
        dict(
            embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0078, logits_scaling=8.0,
            tie_word_embeddings=True,
        ),
    ),
    (
        "granite-scale-bias",
        "GraniteForCausalLM",
        "GraniteConfig",
        # An attention scale far from 1/sqrt(head_dim), so a wrong softmax scale shows.
        dict(
            embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.9, logits_scaling=0.5,
            attention_bias=True, mlp_bias=True, tie_word_embeddings=False,
        ),
    ),
    ("olmo2", "Olmo2ForCausalLM", "Olmo2Config", dict(tie_word_embeddings=False, eos_token_id=1, pad_token_id=None)),
    (
        "olmo2-bias-tied-gqa1",
        "Olmo2ForCausalLM",
        "Olmo2Config",
        dict(
            attention_bias=True, tie_word_embeddings=True, num_key_value_heads=1, eos_token_id=1, pad_token_id=None,
            rope_parameters=dict(rope_type="default", rope_theta=1000.0),
        ),
    ),
]

ARCHITECTURES = (
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "GraniteForCausalLM", "Olmo2ForCausalLM",
)


def load_architecture(name: str):
    """Through the registry (the entry point of the installed pyagent-hf)."""
    return registries.model_architectures.load(name)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Move every parameter away from its init (norm weights 1, biases 0) so that a
    misplaced norm, bias or projection shows in the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=g))
            elif name.endswith("bias"):
                param.copy_(0.1 * torch.randn(param.shape, generator=g))
            else:
                param.copy_(0.15 * torch.randn(param.shape, generator=g))


def make_pair(case, seed=0):
    """(transformers model, our model) with the same random weights."""
    _, arch, config_cls, overrides = case
    hf_config = getattr(transformers, config_cls)(**{**BASE, **overrides})
    hf_config._attn_implementation = "eager"
    hf = getattr(transformers, arch)(hf_config).eval()
    _randomize(hf, seed)
    config = hf_config.to_dict()  # what config.json holds
    ours = load_architecture(arch)(config, registries.attention_backends.load("torch"))
    assert isinstance(ours, ModelArchitecture) and isinstance(ours, torch.nn.Module)
    state = hf.state_dict()
    loaded = ours.load_weights(state.items())
    assert loaded == {k for k in state if "rotary_emb" not in k}
    if hf_config.tie_word_embeddings:
        assert ours.lm_head.weight is ours.model.embed_tokens.weight
    else:
        assert not torch.equal(ours.lm_head.weight, ours.model.embed_tokens.weight)
    return hf, ours.eval()


class PagedRunner:
    """A tiny stand-in for the engine: block tables over a shuffled pool of blocks,
    slot mapping and metadata for each step."""

    def __init__(self, model, num_blocks=64, block_size=4, seed=0):
        self.model = model
        self.block_size = block_size
        shape = model.kv_cache_shape(num_blocks, block_size)
        caches = torch.zeros(shape)
        self.kv_caches = list(caches.unbind(0))
        g = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(num_blocks, generator=g).tolist()
        self.tokens: dict[int, list[int]] = {}
        self.blocks: dict[int, list[int]] = {}

    def step(self, work: list[tuple[int, list[int]]]) -> dict[int, torch.Tensor]:
        """``work``: (sequence id, new tokens) in batch order -> logits of the new tokens per sequence."""
        ids, positions, slots, starts, seq_lens = [], [], [], [0], []
        for seq, new in work:
            cached = self.tokens.setdefault(seq, [])
            blocks = self.blocks.setdefault(seq, [])
            context = len(cached)
            seq_len = context + len(new)
            while len(blocks) * self.block_size < seq_len:
                blocks.append(self.free.pop())
            for pos in range(context, seq_len):
                slots.append(blocks[pos // self.block_size] * self.block_size + pos % self.block_size)
            ids += new
            positions += range(context, seq_len)
            starts.append(starts[-1] + len(new))
            seq_lens.append(seq_len)
            cached += new
        max_blocks = max(len(self.blocks[seq]) for seq, _ in work)
        tables = torch.full((len(work), max_blocks), -1, dtype=torch.int32)
        for i, (seq, _) in enumerate(work):
            tables[i, : len(self.blocks[seq])] = torch.tensor(self.blocks[seq], dtype=torch.int32)
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=tables,
            block_size=self.block_size,
            max_query_len=max(len(new) for _, new in work),
            max_seq_len=max(seq_lens),
        )
        with torch.no_grad():
            hidden = self.model(torch.tensor(ids), torch.tensor(positions), ForwardContext(metadata, self.kv_caches))
            logits = self.model.compute_logits(hidden)
        assert logits.dtype == torch.float32 and logits.shape == (len(ids), self.model.vocab_size)
        return {seq: logits[starts[i] : starts[i + 1]] for i, (seq, _) in enumerate(work)}


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def _tokens(n, seed):
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_prefill_chunked_prefill_and_decode_match_transformers(case):
    hf, ours = make_pair(case)
    runner = PagedRunner(ours, block_size=4)

    # Sequence 0: one full prefill, then decodes.
    seq0 = _tokens(11, 1)
    got = [runner.step([(0, seq0)])[0]]
    # Sequence 1: a prefill in two chunks, then decodes.
    seq1 = _tokens(13, 2)
    got1 = [runner.step([(1, seq1[:6])])[1], runner.step([(1, seq1[6:])])[1]]
    for t in _tokens(5, 3):
        seq0.append(t)
        got.append(runner.step([(0, [t])])[0])
    for t in _tokens(4, 4):
        seq1.append(t)
        got1.append(runner.step([(1, [t])])[1])

    torch.testing.assert_close(torch.cat(got), hf_logits(hf, seq0), atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(torch.cat(got1), hf_logits(hf, seq1), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_batch_of_three_sequences(case):
    hf, ours = make_pair(case, seed=5)
    runner = PagedRunner(ours, block_size=16 if "qwen3" in case[0] else 4, seed=3)
    seqs = {0: _tokens(3, 10), 1: _tokens(17, 11), 2: _tokens(8, 12)}
    # Prefill all three in one batch (the middle one as a first chunk), finish the chunk
    # together with decodes of the others, then decode all three together.
    got = {s: [] for s in seqs}
    out = runner.step([(0, seqs[0]), (1, seqs[1][:9]), (2, seqs[2])])
    for s in seqs:
        got[s].append(out[s])
    n0, n2 = _tokens(1, 13), _tokens(1, 14)
    seqs[0] += n0
    seqs[2] += n2
    out = runner.step([(0, n0), (1, seqs[1][9:]), (2, n2)])
    for s in seqs:
        got[s].append(out[s])
    for step in range(6):
        new = {s: _tokens(1, 100 + 3 * step + s) for s in seqs}
        for s in seqs:
            seqs[s] += new[s]
        out = runner.step([(s, new[s]) for s in (2, 0, 1)])  # batch order differs from seq ids
        for s in seqs:
            got[s].append(out[s])
    for s, tokens in seqs.items():
        torch.testing.assert_close(torch.cat(got[s]), hf_logits(hf, tokens), atol=ATOL, rtol=RTOL)


def test_dynamic_rope_past_max_position_embeddings():
    """Dynamic NTK RoPE rescales once a sequence outgrows max_position_embeddings; like
    transformers (which keeps the keys it cached), each step uses the base for the
    sequence's current length. Compared with transformers run incrementally."""
    case = ("dyn", "LlamaForCausalLM", "LlamaConfig",
            dict(max_position_embeddings=16, rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0)))
    hf, ours = make_pair(case, seed=9)
    tokens = _tokens(30, 20)
    # (transformers' rotary module is stateful: take the full-sequence references first;
    # the incremental run below starts short, which resets it.)
    ref24, ref28 = hf_logits(hf, tokens[:24]), hf_logits(hf, tokens[:28])
    # A single prefill past the limit equals transformers' full forward.
    full = PagedRunner(ours).step([(0, tokens[:24])])[0]
    torch.testing.assert_close(full, ref24, atol=ATOL, rtol=RTOL)

    runner = PagedRunner(ours)
    chunks = [tokens[:10], tokens[10:20]] + [[t] for t in tokens[20:]]
    cache = transformers.DynamicCache(config=hf.config)
    done = 0
    for chunk in chunks:
        ours_out = runner.step([(0, chunk)])[0]
        with torch.no_grad():
            ref = hf(
                torch.tensor([chunk]), past_key_values=cache, use_cache=True,
                position_ids=torch.arange(done, done + len(chunk))[None],
            ).logits[0]
        done += len(chunk)
        torch.testing.assert_close(ours_out, ref, atol=ATOL, rtol=RTOL)

    # Batch-invariant: a short sequence's frequencies do not follow a long neighbour's.
    solo = PagedRunner(ours).step([(0, tokens[:12])])[0]
    both = PagedRunner(ours).step([(1, tokens[:28]), (0, tokens[:12])])
    torch.testing.assert_close(both[0], solo, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(both[1], ref28, atol=ATOL, rtol=RTOL)


def test_registered_by_pyagent_hf():
    for name in ARCHITECTURES:
        check_registration("model_architecture", name, "pyagent-hf")


def test_kv_cache_shape():
    hf, ours = make_pair(CASES[2])
    assert ours.kv_cache_shape(10, 16) == (2, 2, 10, 16, 2, 24)


def test_linear_layers_are_plain_and_fused():
    _, ours = make_pair(CASES[0])
    attn = ours.model.layers[0].self_attn
    assert type(attn.qkv_proj) is torch.nn.Linear and attn.qkv_proj.weight.shape == ((4 + 2 + 2) * 16, 64)
    assert type(ours.model.layers[0].mlp.gate_up_proj) is torch.nn.Linear
    assert ours.model.layers[0].mlp.gate_up_proj.weight.shape == (2 * 96, 64)
    assert type(ours.lm_head) is torch.nn.Linear


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_unknown_or_misshapen_weight_raises(arch):
    model = load_architecture(arch)({**BASE, "head_dim": 16}, registries.attention_backends.load("torch"))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.rope_scale\.weight"):
        model.load_weights([("model.layers.0.self_attn.rope_scale.weight", torch.zeros(3))])
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight"):
        model.load_weights([("model.layers.1.self_attn.k_proj.weight", torch.zeros(64, 64))])
    with pytest.raises(ValueError, match=r"model\.layers\.7\.mlp\.up_proj\.weight"):
        model.load_weights([("model.layers.7.mlp.up_proj.weight", torch.zeros(96, 64))])
    # rotary buffers of old checkpoints are skipped, not loaded
    assert model.load_weights([("model.layers.0.self_attn.rotary_emb.inv_freq", torch.zeros(8))]) == set()
    assert model.load_weights([("model.layers.1.mlp.up_proj.weight", torch.ones(96, 64))]) == {
        "model.layers.1.mlp.up_proj.weight"
    }
    gate_up = model.model.layers[1].mlp.gate_up_proj.weight
    assert torch.all(gate_up[96:] == 1) and not torch.all(gate_up[:96] == 1)


def test_bfloat16_runs_close_to_float32():
    hf, ours = make_pair(CASES[6])  # qwen3: q/k norms too
    tokens = _tokens(12, 30)
    ref = PagedRunner(ours).step([(0, tokens)])[0]
    ours = ours.to(torch.bfloat16)
    runner = PagedRunner(ours)
    runner.kv_caches = [c.to(torch.bfloat16) for c in runner.kv_caches]  # a bf16 cache too
    got = torch.cat([runner.step([(0, tokens[:8])])[0]] + [runner.step([(0, [t])])[0] for t in tokens[8:]])
    assert got.dtype == torch.float32
    assert (got - ref).abs().max() < 0.1 * ref.abs().max()
