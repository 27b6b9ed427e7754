"""The fused ops against their torch twins, and the twins against torch itself.

On CPU the kernels run in Triton's interpreter (see conftest.py), so shapes stay
small; half-precision and larger shapes run only on a GPU.
"""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from pyagent_triton import ops

from pyagent_framework.interfaces import apply_token_bitmask

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
needs_cuda = pytest.mark.skipif(not CUDA, reason="half precision and large shapes run on a GPU only")

FP32 = {"rtol": 1e-4, "atol": 1e-4}
RMS = {"rtol": 1e-5, "atol": 1e-5}
HALF = {"rtol": 2e-2, "atol": 2e-2}
TOKENS = (1, 3, 17)


def randn(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=DEVICE)


def random_bitmask(rows, vocab, seed=0):
    """int32 words with every bit pattern (the sign bit included)."""
    g = torch.Generator().manual_seed(seed)
    words = torch.randint(-(2**31), 2**31, (rows, (vocab + 31) // 32), generator=g, dtype=torch.int64)
    return words.to(torch.int32).to(DEVICE)


def structured_masked(logits, bitmask):
    """``interfaces.apply_token_bitmask`` (a CPU function) applied to a copy."""
    out = logits.to("cpu", copy=True)
    apply_token_bitmask(out, bitmask.cpu())
    return out.to(logits.device)


# --------------------------------------------------------------------------- reshape_and_cache


def kv_views(tokens, q_heads, kv_heads, head_dim, dtype=torch.float32):
    """k and v as strided views of one qkv projection, as the model hands them over."""
    q, kv = q_heads * head_dim, kv_heads * head_dim
    qkv = randn(tokens, q + 2 * kv, dtype=dtype)
    k = qkv[:, q : q + kv].view(tokens, kv_heads, head_dim)
    v = qkv[:, q + kv :].view(tokens, kv_heads, head_dim)
    return k, v


def random_slots(tokens, num_slots, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_slots, generator=g)[:tokens]
    slots[::3] = -1  # padding tokens, the first among them
    return slots.to(dtype=dtype, device=DEVICE)


def cache_pair(num_blocks, block_size, kv_heads, head_dim, dtype=torch.float32):
    cache = randn(2, num_blocks, block_size, kv_heads, head_dim, dtype=dtype, seed=1)
    return cache, cache.clone()


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("head_dim", [24, 80])
@pytest.mark.parametrize("tokens", TOKENS)
def test_reshape_and_cache_matches_twin(tokens, head_dim, slot_dtype):
    k, v = kv_views(tokens, 4, 2, head_dim)
    cache, expected = cache_pair(5, 4, 2, head_dim)
    slots = random_slots(tokens, 20, slot_dtype)
    ops.reshape_and_cache(k, v, cache, slots)
    ops.reshape_and_cache_reference(k, v, expected, slots)
    assert torch.equal(cache, expected)


def test_reshape_and_cache_many_heads_tile():
    """More heads than one program's tile holds: several programs a token."""
    k, v = kv_views(3, 0, 48, 128)
    cache, expected = cache_pair(2, 2, 48, 128)
    slots = torch.tensor([3, -1, 0], device=DEVICE)
    ops.reshape_and_cache(k, v, cache, slots)
    ops.reshape_and_cache_reference(k, v, expected, slots)
    assert torch.equal(cache, expected)


def test_reshape_and_cache_casts_to_cache_dtype():
    k, v = kv_views(3, 2, 2, 24)
    cache, expected = cache_pair(2, 4, 2, 24, dtype=torch.float16)
    slots = torch.tensor([7, 0, 2], dtype=torch.int32, device=DEVICE)
    ops.reshape_and_cache(k, v, cache, slots)
    ops.reshape_and_cache_reference(k, v, expected, slots)
    assert torch.equal(cache, expected)
    assert torch.equal(cache[1, 1, 3], v[0].half())


def test_reshape_and_cache_twin_matches_a_token_loop():
    block_size = 4
    k, v = kv_views(17, 4, 2, 80)
    cache, expected = cache_pair(5, block_size, 2, 80)
    slots = random_slots(17, 20, torch.int64)
    ops.reshape_and_cache_reference(k, v, cache, slots)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[0, slot // block_size, slot % block_size] = k[t]
            expected[1, slot // block_size, slot % block_size] = v[t]
    assert torch.equal(cache, expected)


def test_reshape_and_cache_all_padding_and_no_tokens():
    k, v = kv_views(3, 2, 2, 24)
    cache, before = cache_pair(2, 4, 2, 24)
    ops.reshape_and_cache(k, v, cache, torch.full((3,), -1, device=DEVICE))
    ops.reshape_and_cache(k[:0], v[:0], cache, torch.zeros(0, dtype=torch.int64, device=DEVICE))
    assert torch.equal(cache, before)


# --------------------------------------------------------------------------- rms_norm


def strided_rows(tokens, width, dtype=torch.float32, seed=0):
    """``[tokens, width]`` whose rows are ``width + 7`` apart."""
    return randn(tokens, width + 7, dtype=dtype, seed=seed)[:, 3 : 3 + width]


@pytest.mark.parametrize("width", [100, 576])
@pytest.mark.parametrize("tokens", TOKENS)
def test_rms_norm_matches_twin_and_torch(tokens, width):
    x = strided_rows(tokens, width)
    w = randn(width, seed=2)
    out = ops.rms_norm(x, w, 1e-6)
    torch.testing.assert_close(out, ops.rms_norm_reference(x, w, 1e-6), **RMS)
    torch.testing.assert_close(out, F.rms_norm(x, (width,), w, 1e-6), **RMS)


@pytest.mark.parametrize("width", [100, 576])
@pytest.mark.parametrize("tokens", TOKENS)
def test_rms_norm_with_residual_matches_twin(tokens, width):
    x = strided_rows(tokens, width)
    w = randn(width, seed=2)
    residual = strided_rows(tokens, width, seed=3)
    residual_twin = residual.clone()
    expected_sum = x + residual

    out, new_residual = ops.rms_norm(x, w, 1e-5, residual)
    out_twin, new_residual_twin = ops.rms_norm_reference(x, w, 1e-5, residual_twin)

    assert new_residual is residual and new_residual_twin is residual_twin
    assert torch.equal(residual, expected_sum) and torch.equal(residual_twin, expected_sum)
    torch.testing.assert_close(out, out_twin, **RMS)
    torch.testing.assert_close(out, F.rms_norm(expected_sum, (width,), w, 1e-5), **RMS)


def test_rms_norm_leaves_x_alone():
    x = strided_rows(3, 100)
    before = x.clone()
    ops.rms_norm(x, randn(100), 1e-6, randn(3, 100, seed=4))
    assert torch.equal(x, before)


# --------------------------------------------------------------------------- rotary_embedding_


def rope_model(x, cos, sin):
    """The model's rotation, verbatim."""
    x1, x2 = x.chunk(2, -1)
    cos, sin = cos[:, None], sin[:, None]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)


def qk_view(tokens, q_heads, kv_heads, head_dim, dtype=torch.float32):
    """q and k of a qkv projection as one ``[tokens, q_heads + kv_heads, head_dim]`` view."""
    qkv = randn(tokens, (q_heads + 2 * kv_heads) * head_dim, dtype=dtype)
    return qkv, qkv[:, : (q_heads + kv_heads) * head_dim].view(tokens, q_heads + kv_heads, head_dim)


def cos_sin(tokens, head_dim, dtype=torch.float32):
    pos = torch.arange(tokens, dtype=torch.float32)[:, None] * 3 + 1
    inv_freq = 10000.0 ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = pos * inv_freq
    return angles.cos().to(dtype=dtype, device=DEVICE), angles.sin().to(dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("head_dim", [24, 80])
@pytest.mark.parametrize("tokens", TOKENS)
def test_rotary_matches_twin_and_model(tokens, head_dim):
    qkv, qk = qk_view(tokens, 4, 2, head_dim)
    qkv_twin = qkv.clone()
    qk_twin = qkv_twin[:, : 6 * head_dim].view(tokens, 6, head_dim)
    cos, sin = cos_sin(tokens, head_dim)
    expected = rope_model(qk.clone(), cos, sin)

    assert ops.rotary_embedding_(qk, cos, sin) is qk
    assert ops.rotary_embedding_reference(qk_twin, cos, sin) is qk_twin

    assert torch.equal(qk_twin, expected)
    torch.testing.assert_close(qk, expected, **FP32)
    assert torch.equal(qkv[:, 6 * head_dim :], qkv_twin[:, 6 * head_dim :])  # v untouched


def test_rotary_strided_heads_and_cos_rows():
    """Every other head of a view, and cos/sin rows that are slices of a wider table."""
    tokens, head_dim = 3, 24
    base = randn(tokens, 8, head_dim)
    x = base[:, ::2]
    table_cos, table_sin = cos_sin(tokens, 2 * head_dim)
    cos, sin = table_cos[:, : head_dim // 2], table_sin[:, : head_dim // 2]
    expected = base.clone()
    expected[:, ::2] = rope_model(x.clone(), cos, sin)
    ops.rotary_embedding_(x, cos, sin)
    torch.testing.assert_close(base, expected, **FP32)


def test_rotary_many_heads_tile():
    _, qk = qk_view(2, 64, 8, 128)
    cos, sin = cos_sin(2, 128)
    expected = rope_model(qk.clone(), cos, sin)
    ops.rotary_embedding_(qk, cos, sin)
    torch.testing.assert_close(qk, expected, **FP32)


# --------------------------------------------------------------------------- silu_and_mul


@pytest.mark.parametrize("inter", [100, 1536])
@pytest.mark.parametrize("tokens", TOKENS)
def test_silu_and_mul_matches_twin_and_torch(tokens, inter):
    x = strided_rows(tokens, 2 * inter) * 4
    out = ops.silu_and_mul(x)
    twin = ops.silu_and_mul_reference(x)
    assert out.shape == (tokens, inter) and out.dtype == x.dtype
    torch.testing.assert_close(out, twin, **FP32)
    assert torch.equal(twin, F.silu(x[:, :inter]) * x[:, inter:])


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the interpreter's exp(1000) = inf
def test_silu_and_mul_several_column_tiles_and_extremes():
    inter = 5000  # wider than one program's tile
    x = randn(2, 2 * inter) * 30
    x[0, :4] = torch.tensor([-1000.0, 1000.0, 0.0, -88.0])
    torch.testing.assert_close(ops.silu_and_mul(x), ops.silu_and_mul_reference(x), **FP32)


# --------------------------------------------------------------------------- apply_token_bitmask_


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("vocab", [100, 1000, 4099])
def test_bitmask_matches_twin_and_structured(vocab, dtype):
    logits = randn(3, vocab, dtype=dtype)
    bitmask = random_bitmask(3, vocab)
    twin = logits.clone()
    structured = structured_masked(logits, bitmask)
    ops.apply_token_bitmask_(logits, bitmask)
    ops.apply_token_bitmask_reference(twin, bitmask)
    assert torch.equal(twin, structured)
    assert torch.equal(logits, twin)
    assert 0 < logits.isinf().sum() < logits.numel()


def test_bitmask_twin_matches_structured_torch_path():
    """interfaces.apply_token_bitmask's torch (non-numpy) path, on a strided view."""
    base = randn(3, 140)
    logits = base[:, 5:105]
    bitmask = random_bitmask(3, 100)
    expected = base.cpu().clone()[:, 5:105]
    apply_token_bitmask(expected, bitmask.cpu())  # not contiguous: the torch path
    ops.apply_token_bitmask_(logits, bitmask)
    assert torch.equal(logits.cpu(), expected)
    assert not base[:, :5].isinf().any() and not base[:, 105:].isinf().any()


def test_bitmask_with_indices():
    vocab = 100
    logits = randn(5, vocab)
    bitmask = random_bitmask(2, vocab)
    indices = torch.tensor([4, 1], dtype=torch.int32, device=DEVICE)
    twin = logits.clone()
    expected = logits.clone()
    expected[4:5] = structured_masked(logits[4:5], bitmask[0:1])
    expected[1:2] = structured_masked(logits[1:2], bitmask[1:2])

    ops.apply_token_bitmask_(logits, bitmask, indices)
    ops.apply_token_bitmask_reference(twin, bitmask, indices.long())
    assert torch.equal(twin, expected)
    assert torch.equal(logits, expected)


def test_bitmask_ignores_padding_bits_and_extra_words():
    vocab = 40
    logits = randn(1, vocab)
    bitmask = torch.tensor([[-1, 0xFF, 0]], dtype=torch.int32, device=DEVICE)  # tokens 32..39 allowed
    before = logits.clone()
    ops.apply_token_bitmask_(logits, bitmask)
    assert torch.equal(logits, before)
    bitmask[0, 1] = 0x7F  # token 39 forbidden
    ops.apply_token_bitmask_(logits, bitmask)
    assert logits[0, 39] == float("-inf") and torch.equal(logits[0, :39], before[0, :39])


@settings(max_examples=12, deadline=None)
@given(
    vocab=st.integers(1, 200),
    batch=st.integers(1, 4),
    data=st.data(),
)
def test_bitmask_property(vocab, batch, data):
    rows = data.draw(st.integers(1, batch))
    indices = data.draw(st.permutations(range(batch)))[:rows]
    seed = data.draw(st.integers(0, 2**16))
    logits = randn(batch, vocab, seed=seed)
    bitmask = random_bitmask(rows, vocab, seed=seed)
    index_tensor = torch.tensor(indices, dtype=torch.int64, device=DEVICE)
    twin = logits.clone()
    ops.apply_token_bitmask_(logits, bitmask, index_tensor)
    ops.apply_token_bitmask_reference(twin, bitmask, index_tensor)
    assert torch.equal(logits, twin)


# --------------------------------------------------------------------------- validation


def _bad_calls():
    x, w = randn(3, 100), randn(100)
    k, v = kv_views(3, 2, 2, 24)
    cache = randn(2, 2, 4, 2, 24)
    slots = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    qk = randn(3, 4, 24)
    cos, sin = cos_sin(3, 24)
    logits = randn(2, 100)
    bitmask = random_bitmask(2, 100)
    return [
        ("key", lambda: ops.reshape_and_cache(k[:, :, :, None], v, cache, slots)),
        ("value", lambda: ops.reshape_and_cache(k, v[:2], cache, slots)),
        ("kv_cache", lambda: ops.reshape_and_cache(k, v, cache[0], slots)),
        ("kv_cache", lambda: ops.reshape_and_cache(k, v, randn(2, 2, 4, 2, 32), slots)),
        ("kv_cache", lambda: ops.reshape_and_cache(k, v, cache.transpose(1, 2), slots)),
        ("slot_mapping", lambda: ops.reshape_and_cache(k, v, cache, slots.float())),
        ("slot_mapping", lambda: ops.reshape_and_cache(k, v, cache, slots[:2])),
        ("key", lambda: ops.reshape_and_cache(k.transpose(1, 2), v, cache, slots)),
        ("x", lambda: ops.rms_norm(x[0], w, 1e-6)),
        ("x", lambda: ops.rms_norm(x.int(), w, 1e-6)),
        ("x", lambda: ops.rms_norm(x.t(), w, 1e-6)),
        ("weight", lambda: ops.rms_norm(x, w[:50], 1e-6)),
        ("eps", lambda: ops.rms_norm(x, w, -1.0)),
        ("residual", lambda: ops.rms_norm(x, w, 1e-6, x[:2].clone())),
        ("residual", lambda: ops.rms_norm(x, w, 1e-6, x.double())),
        ("x", lambda: ops.rotary_embedding_(randn(3, 4, 25), cos, sin)),
        ("x", lambda: ops.rotary_embedding_(qk[0], cos, sin)),
        ("cos", lambda: ops.rotary_embedding_(qk, cos[:2], sin)),
        ("sin", lambda: ops.rotary_embedding_(qk, cos, sin[:, :6])),
        ("x", lambda: ops.silu_and_mul(randn(3, 101))),
        ("x", lambda: ops.silu_and_mul(randn(3, 4, 2))),
        ("logits", lambda: ops.apply_token_bitmask_(logits.long(), bitmask)),
        ("bitmask", lambda: ops.apply_token_bitmask_(logits, bitmask.long())),
        ("bitmask", lambda: ops.apply_token_bitmask_(logits, bitmask[:, :3])),
        ("bitmask", lambda: ops.apply_token_bitmask_(logits, bitmask[:1])),
        ("indices", lambda: ops.apply_token_bitmask_(logits, bitmask, torch.tensor([0], device=DEVICE))),
        ("indices", lambda: ops.apply_token_bitmask_(logits, bitmask, torch.tensor([0.0, 1.0], device=DEVICE))),
    ]


BAD_CALLS = _bad_calls()


@pytest.mark.parametrize(("name", "call"), BAD_CALLS, ids=[f"{i}-{name}" for i, (name, _) in enumerate(BAD_CALLS)])
def test_bad_input_raises_value_error_naming_it(name, call):
    with pytest.raises(ValueError, match=rf"^{name}:"):
        call()


# --------------------------------------------------------------------------- GPU: half precision, large shapes


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "head_dim"), [(17, 80), (257, 128)])
def test_cuda_reshape_and_cache_half(dtype, tokens, head_dim):
    k, v = kv_views(tokens, 32, 8, head_dim, dtype=dtype)
    cache, expected = cache_pair(64, 16, 8, head_dim, dtype=dtype)
    slots = random_slots(tokens, 64 * 16, torch.int32)
    ops.reshape_and_cache(k, v, cache, slots)
    ops.reshape_and_cache_reference(k, v, expected, slots)
    assert torch.equal(cache, expected)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "width"), [(17, 576), (257, 4096), (5, 8192)])
def test_cuda_rms_norm_half(dtype, tokens, width):
    x = strided_rows(tokens, width, dtype=dtype)
    w = randn(width, dtype=dtype, seed=2)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), ops.rms_norm_reference(x, w, 1e-6), **HALF)
    residual = randn(tokens, width, dtype=dtype, seed=3)
    residual_twin = residual.clone()
    out, res = ops.rms_norm(x, w, 1e-6, residual)
    out_twin, res_twin = ops.rms_norm_reference(x, w, 1e-6, residual_twin)
    torch.testing.assert_close(res, res_twin, **HALF)
    torch.testing.assert_close(out, out_twin, **HALF)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "head_dim"), [(17, 80), (257, 128)])
def test_cuda_rotary_half(dtype, tokens, head_dim):
    _, qk = qk_view(tokens, 32, 8, head_dim, dtype=dtype)
    twin = qk.clone()
    cos, sin = cos_sin(tokens, head_dim)
    ops.rotary_embedding_(qk, cos, sin)
    ops.rotary_embedding_reference(twin, cos, sin)
    torch.testing.assert_close(qk, twin, **HALF)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "inter"), [(17, 100), (257, 14336)])
def test_cuda_silu_and_mul_half(dtype, tokens, inter):
    x = randn(tokens, 2 * inter, dtype=dtype)
    torch.testing.assert_close(ops.silu_and_mul(x), ops.silu_and_mul_reference(x), **HALF)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("vocab", [32000, 151936, 151937])
def test_cuda_bitmask_half(dtype, vocab):
    logits = randn(8, vocab, dtype=dtype)
    bitmask = random_bitmask(4, vocab)
    indices = torch.tensor([7, 0, 3, 5], device=DEVICE)
    twin = logits.clone()
    ops.apply_token_bitmask_(logits, bitmask, indices)
    ops.apply_token_bitmask_reference(twin, bitmask, indices)
    assert torch.equal(logits, twin)


# --------------------------------------------------------------------------- add_lora_


def lora_case(tokens, in_features, out_features, rank, slots=3, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = randn(tokens, in_features, dtype=dtype, seed=seed)
    out = randn(tokens, out_features, dtype=dtype, seed=seed + 1)
    a = randn(slots, rank, in_features, dtype=dtype, seed=seed + 2)
    b = randn(slots, out_features, rank, dtype=dtype, seed=seed + 3)
    row_slots = torch.randint(-1, slots, (tokens,), generator=g, dtype=torch.int32).to(DEVICE)
    return out, x, a, b, row_slots


@pytest.mark.parametrize("tokens,in_features,out_features,rank", [(1, 16, 24, 4), (7, 40, 96, 8), (17, 64, 48, 24), (5, 32, 8, 16)])
def test_add_lora_matches_its_twin_and_the_layer_ops_grouping(tokens, in_features, out_features, rank):
    out, x, a, b, row_slots = lora_case(tokens, in_features, out_features, rank)
    want = out.clone()
    ops.add_lora_reference(want, x, a, b, row_slots)
    got = out.clone()
    ops.add_lora_(got, x, a, b, row_slots)
    torch.testing.assert_close(got, want, **FP32)
    # and the plain-torch LayerOps.add_lora, which batches by adapter
    from pyagent_framework.interfaces import LayerOps

    groups = [(s, torch.nonzero(row_slots == s).flatten()) for s in range(a.shape[0]) if (row_slots == s).any()]
    torch_out = out.clone()
    LayerOps().add_lora(torch_out, x, a, b, groups, row_slots)
    torch.testing.assert_close(torch_out, want, **FP32)
    untouched = row_slots == -1
    torch.testing.assert_close(got[untouched], out[untouched], rtol=0, atol=0)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_add_lora_half_precision_and_model_shapes(dtype):
    out, x, a, b, row_slots = lora_case(64, 4096, 6144, 48, slots=4, dtype=dtype)
    want = out.clone()
    ops.add_lora_reference(want, x, a, b, row_slots)
    got = out.clone()
    ops.add_lora_(got, x, a, b, row_slots)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=0.5)
