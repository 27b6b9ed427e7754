"""The quantized KV cache (``--kv-cache-dtype int8|fp8``) and the KV cache sized from the
device (``--kv-cache-memory auto``).

- The row format against its definition (``pyagent_framework.kv_cache_format``): byte
  layout, error bounds, zero rows.
- The torch backend over a quantized cache equals the same backend over a float cache
  holding the dequantized rows, for decodes, fresh prompts, chunked prefill over cached
  context and mixed batches.
- End to end: greedy tokens equal the float cache's on tiny models and on the embedded
  SmolLM2 for 32 tokens; the logprob drift is printed and bounded.
- Auto sizing with mocked memory probes (CPU and GPU rules), and the errors that name
  the option.
"""

from __future__ import annotations

import pytest
import torch

from pyagent_framework import LLM, SamplingParams
from pyagent_framework import kv_cache_format as kv_format
from pyagent_framework.engine import kv_sizing
from pyagent_framework.engine.config import make_config
from pyagent_framework.engine.errors import ConfigError
from pyagent_framework.paged_attention import TorchAttention
from pyagent_framework.types import AttentionMetadata
from tests.tiny_models import parity_prompts, tiny_checkpoint

QUANTIZED = [torch.int8, torch.float8_e4m3fn]
NAMES = {torch.int8: "int8", torch.float8_e4m3fn: "fp8"}


# ----------------------------------------------------------------------------- format


@pytest.mark.parametrize("dtype", QUANTIZED, ids=["int8", "fp8"])
@pytest.mark.parametrize("head_dim, group", [(64, 32), (128, 32), (80, 16), (13, 13)])
def test_rows_hold_codes_then_a_float16_scale_per_group(dtype, head_dim, group):
    torch.manual_seed(0)
    x = torch.randn(7, 3, head_dim) * torch.logspace(-3, 2, 7)[:, None, None]
    x[:, :, 0] *= 30  # an outlier channel, as many models' keys have: it coarsens only its group
    rows = kv_format.quantize(x, dtype)
    groups = head_dim // group
    assert kv_format.group_size(head_dim) == group
    assert rows.dtype == dtype and rows.shape == (7, 3, head_dim + 2 * groups)
    amax = x.reshape(7, 3, groups, group).abs().amax(-1)
    qmax = kv_format.QMAX[dtype]
    # The scales: the bytes after the codes, little-endian float16, amax / QMAX rounded.
    raw = rows.view(torch.uint8)[..., head_dim:].contiguous().view(torch.float16)
    assert torch.equal(raw, (amax / qmax).to(torch.float16))
    assert torch.equal(kv_format.scales(rows, head_dim), raw.float())
    codes = rows[..., :head_dim].to(torch.float32).reshape(7, 3, groups, group)
    # Codes come from the rounded scale: each group reaches (about) the top of its range.
    assert (codes.abs().amax(-1) >= qmax * (1 - 2**-10) - (0.5 if dtype == torch.int8 else 16)).all()
    back = kv_format.dequantize(rows, head_dim)
    error = (back - x).abs().reshape(7, 3, groups, group)
    scale = raw.float()[..., None]
    if dtype == torch.int8:  # half a step, plus float rounding
        assert (error <= scale / 2 * (1 + 1e-5) + 1e-12).all()
    else:  # e4m3: 3 mantissa bits, relative error at most 2^-4 (subnormals: absolute)
        bound = torch.maximum(x.abs().reshape(error.shape) / 16, scale * 2**-10) * (1 + 1e-5)
        assert (error <= bound).all()
    with pytest.raises(ValueError, match="not rows of head_dim"):
        kv_format.dequantize(rows, head_dim + 1)


@pytest.mark.parametrize("dtype", QUANTIZED, ids=["int8", "fp8"])
def test_zero_and_tiny_rows_are_stored_as_zeros(dtype):
    x = torch.zeros(2, 16)
    x[1, 3] = 1e-31
    rows = kv_format.quantize(x, dtype)
    assert rows.view(torch.uint8).eq(0).all()
    assert kv_format.dequantize(rows, 16).eq(0).all()


def test_an_odd_head_dim_reads_back():
    # One row of 13: its scale starts at byte 13, which no float16 view may start at.
    x = torch.randn(1, 1, 13)
    for dtype in QUANTIZED:
        rows = kv_format.quantize(x, dtype)
        assert rows.shape[-1] == 15
        torch.testing.assert_close(kv_format.dequantize(rows[0, 0], 13), x[0, 0], rtol=0.07, atol=float(x.abs().max()) / 200)


def test_int8_rounds_half_to_even():
    # amax 127 makes the scale, and inv, exactly 1: the codes are the inputs rounded half to even.
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, 3.49, -126.5] * 2])
    codes = kv_format.quantize(x, torch.int8)[0, :16].tolist()
    assert codes == [127, 0, 2, 2, 0, -2, 3, -126] * 2


def test_names_and_widths():
    assert kv_format.cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_format.cache_dtype("fp8_e4m3", torch.float32) == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="unknown KV cache dtype 'int4'"):
        kv_format.cache_dtype("int4", torch.float32)
    assert kv_format.bytes_per_row(64, torch.int8) == 68  # llama.cpp's q8_0 size
    assert kv_format.bytes_per_row(128, torch.float8_e4m3fn) == 136
    assert kv_format.bytes_per_row(64, torch.float32) == 256
    assert kv_format.bytes_per_row(64, torch.bfloat16) == 128


# ----------------------------------------------------------------------------- torch backend


def _metadata(query_lens, seq_lens, block_size, tables, slots):
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    width = max(len(t) for t in tables)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32),
        block_size=block_size,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )


@pytest.mark.parametrize("dtype", QUANTIZED, ids=["int8", "fp8"])
@pytest.mark.parametrize("window", [None, 5])
def test_torch_backend_reads_the_rows_it_wrote(dtype, window):
    """A quantized cache and a float cache holding its dequantized rows give the same
    attention, batch shape for batch shape (one backend, two caches)."""
    torch.manual_seed(1)
    heads, kv_heads, d, bs, blocks = 6, 2, 16, 4, 12
    backend = TorchAttention(heads, d, kv_heads, sliding_window=window)
    qcache = torch.zeros(2, blocks, bs, kv_heads, kv_format.row_width(d, dtype), dtype=dtype)
    # Three sequences: blocks [0, 1, 2], [3, 4, 8], [5, 6, 7]; contexts of 9, 6 and 10 tokens.
    tables = [[0, 1, 2], [3, 4, 8], [5, 6, 7]]

    def slots(seq, positions):
        return [tables[seq][p // bs] * bs + p % bs for p in positions]

    # Step 1: fresh prompts (written quantized).
    lens = [9, 6, 10]
    meta = _metadata(lens, lens, bs, tables, sum((slots(i, range(n)) for i, n in enumerate(lens)), []))
    n = sum(lens)
    q, k, v = torch.randn(n, heads, d), torch.randn(n, kv_heads, d), torch.randn(n, kv_heads, d)
    backend.forward(q, k, v, qcache, meta)
    written = kv_format.dequantize(kv_format.quantize(k, dtype), d)
    flat_keys = kv_format.dequantize(qcache[0], d).view(-1, kv_heads, d)
    assert torch.equal(flat_keys[meta.slot_mapping], written)
    # Step 2: a mixed batch (a decode, a chunk of 2 over cached context, another decode)
    # and step 3: pure decode; each against the float cache of the dequantized rows.
    for query_lens in ([1, 2, 1], [1, 1, 1]):
        new_lens = [a + b for a, b in zip(lens, query_lens)]
        slot_list = sum((slots(i, range(lens[i], new_lens[i])) for i in range(3)), [])
        meta = _metadata(query_lens, new_lens, bs, tables, slot_list)
        n = sum(query_lens)
        q, k, v = torch.randn(n, heads, d), torch.randn(n, kv_heads, d), torch.randn(n, kv_heads, d)
        fcache = kv_format.dequantize(qcache, d)
        kq, vq = (kv_format.dequantize(kv_format.quantize(t, dtype), d) for t in (k, v))
        want = backend.forward(q, kq, vq, fcache, meta)
        got = backend.forward(q, k, v, qcache, meta)
        assert torch.equal(kv_format.dequantize(qcache, d), fcache)  # the same rows were written
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        lens = new_lens


def test_bfloat16_queries_read_a_quantized_cache():
    torch.manual_seed(2)
    backend = TorchAttention(4, 16, 2)
    qcache = kv_format.quantize(torch.randn(2, 3, 4, 2, 16), torch.int8)
    meta = _metadata([1, 1], [5, 9], 4, [[0, 1], [1, 2, 0]], [4 * 1 + 0, 4 * 0 + 0])
    q = torch.randn(2, 4, 16).to(torch.bfloat16)
    kv = torch.randn(2, 2, 16).to(torch.bfloat16)
    got = backend.forward(q, kv, kv, qcache, meta)
    # The float reference: a bfloat16 cache holding the rows the quantized one holds now.
    fcache = kv_format.dequantize(qcache, 16, torch.bfloat16)
    kvq = kv_format.dequantize(kv_format.quantize(kv, torch.int8), 16, torch.bfloat16)
    want = backend.forward(q, kvq, kvq, fcache, meta)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want)


# ----------------------------------------------------------------------------- end to end


def _runs(model, prompts, max_tokens, **options):
    """Greedy tokens with each chosen token's logprob and the float run's top-2 margin
    per position, for each cache dtype."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=2, ignore_eos=True)
    runs = {}
    for name in ("auto", "int8", "fp8"):
        with LLM(model, engine_process=False, kv_cache_dtype=name, **options) as llm:
            runs[name] = []
            for out in llm.generate(prompts, params):
                done = out.outputs[0]
                tops = [sorted((e.logprob for e in entry.values()), reverse=True) for entry in done.logprobs]
                runs[name].append((list(done.token_ids), [entry[t].logprob for entry, t in zip(done.logprobs, done.token_ids)],
                                   [top[0] - top[1] for top in tops]))
    return runs


def _compare(runs, name):
    """(tokens equal before each prompt's first difference, summed; the largest logprob
    difference over them; the float run's top-2 margins where the tokens first differ)."""
    equal, drift, flips = 0, 0.0, []
    for (tokens, logprobs, margins), (got, got_logprobs, _) in zip(runs["auto"], runs[name], strict=True):
        for i, (t, lp, g, glp) in enumerate(zip(tokens, logprobs, got, got_logprobs)):
            if t != g:
                flips.append(margins[i])
                break
            equal += 1
            drift = max(drift, abs(lp - glp))
    return equal, drift, flips


# The largest logprob drift each cache dtype may bring (int8: half a step of 1/127 of
# each row's largest value; fp8: 3 mantissa bits), measured inside on every model below
# (SmolLM2's keys have outlier channels, and drift most). Greedy may pick another token
# only where the float run's top two were closer than NEAR_TIE.
DRIFT = {"int8": 0.1, "fp8": 0.4}
NEAR_TIE = {"int8": 0.05, "fp8": 0.3}


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
def test_tiny_models_drift_little_and_flip_only_near_ties(arch, tmp_path_factory):
    """Tiny random-weight models put their top two tokens within 0.001-0.05 nats of each
    other at many steps, below fp8's noise, so exact equality over 40 tokens is not what
    they can show; what they show is that the quantized cache moves logprobs by less
    than its bound and that every different token is a near tie of the float run."""
    path = tiny_checkpoint(arch, tmp_path_factory.getbasetemp() / "tiny")
    prompts = parity_prompts(7)
    runs = _runs(path, prompts, 40, kv_cache_memory="8MiB")
    for name in ("int8", "fp8"):
        equal, drift, flips = _compare(runs, name)
        print(f"{arch} {name}: {equal}/{40 * len(prompts)} tokens equal before any difference, logprob drift "
              f"{drift:.2e}, top-2 margins where they differ {[round(m, 4) for m in flips]}")
        assert drift < DRIFT[name]
        assert all(margin < NEAR_TIE[name] for margin in flips)


def test_smollm2_greedy_equals_the_float_cache():
    """The embedded SmolLM2 (its GGUF, the default backend) with each cache dtype: the
    float cache's greedy tokens for 32 tokens on every prompt."""
    prompts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time, in a small village by the sea,",
        "List three prime numbers:",
    ]
    runs = _runs(None, prompts, 32, kv_cache_memory="64MiB", max_model_len=512)
    for name in ("int8", "fp8"):
        equal, drift, flips = _compare(runs, name)
        print(f"smollm2 {name}: {equal}/{32 * len(prompts)} tokens equal before any difference, logprob drift "
              f"{drift:.2e}, top-2 margins where they differ {[round(m, 4) for m in flips]}")
        assert drift < DRIFT[name]
        assert all(margin < NEAR_TIE[name] for margin in flips)
    assert _compare(runs, "int8")[0] == 32 * len(prompts)  # int8: every token equal


def test_cache_holds_four_times_the_tokens(tmp_path_factory):
    path = tiny_checkpoint("llama", tmp_path_factory.getbasetemp() / "tiny")
    blocks = {}
    for name in ("auto", "int8"):
        with LLM(path, engine_process=False, kv_cache_dtype=name, kv_cache_memory="4MiB") as llm:
            blocks[name] = llm.engine.info.num_kv_blocks
    head_dim = 16  # 64 hidden / 4 heads: one group, 16 codes and a 2-byte scale per row
    assert blocks["int8"] == blocks["auto"] * 4 * head_dim // (head_dim + 2)


def test_unknown_dtype_and_backend_without_it_are_refused(tmp_path_factory, monkeypatch):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        make_config({"kv_cache_dtype": "int4"}, env=False)
    path = tiny_checkpoint("llama", tmp_path_factory.getbasetemp() / "tiny")
    from pyagent_framework.engine import setup

    class Plain:  # a backend that declares no quantized cache
        pass

    config = make_config({"kv_cache_dtype": "fp8"}, env=False)
    with pytest.raises(ConfigError, match="attention backend 'plain' does not read a fp8 KV cache") as info:
        setup.kv_cache_dtype(config, Plain, "plain")
    assert info.value.field == "kv_cache_dtype"
    assert setup.kv_cache_dtype(make_config({}, env=False), Plain, "plain") == torch.float32
    del path


# ----------------------------------------------------------------------------- auto sizing

GiB = 1 << 30


def test_cpu_auto_takes_a_quarter_of_available_ram_capped():
    probe = lambda device: kv_sizing.DeviceMemory(total=32 * GiB, free=8 * GiB)  # noqa: E731
    budget, how = kv_sizing.auto_budget("cpu", gpu_memory_utilization=0.9, probe=probe)
    assert budget == 2 * GiB and "25% of 8.00 GiB" in how
    probe = lambda device: kv_sizing.DeviceMemory(total=512 * GiB, free=400 * GiB)  # noqa: E731
    assert kv_sizing.auto_budget("cpu", gpu_memory_utilization=0.9, probe=probe)[0] == kv_sizing.CPU_CAP


def test_gpu_auto_leaves_weights_activations_and_other_processes_their_share():
    calls = []

    def profile():
        calls.append("profile")
        return 3 * GiB

    def probe(device):
        calls.append(("probe", str(device)))
        # 80 GiB device; 20 GiB in use (weights, context, another process).
        return kv_sizing.DeviceMemory(total=80 * GiB, free=60 * GiB)

    budget, how = kv_sizing.auto_budget("cuda:0", gpu_memory_utilization=0.9, probe=probe, profile=profile)
    assert budget == int(0.9 * 80 * GiB - 20 * GiB - 3 * GiB)
    assert calls == ["profile", ("probe", "cuda:0")]  # the probe reads memory after the profile
    assert "90% of 80.00 GiB" in how and "3.00 GiB activation peak" in how
    with pytest.raises(ConfigError, match="no GPU memory is left for the KV cache") as info:
        kv_sizing.auto_budget("cuda", gpu_memory_utilization=0.25, probe=probe, profile=profile)
    assert info.value.field == "gpu_memory_utilization"


def test_engine_sizes_its_cache_from_the_probe(tmp_path_factory, monkeypatch, caplog):
    path = tiny_checkpoint("llama", tmp_path_factory.getbasetemp() / "tiny")
    monkeypatch.setattr(kv_sizing, "probe_memory", lambda device: kv_sizing.DeviceMemory(total=GiB, free=64 << 20))
    with caplog.at_level("INFO", logger="pyagent_framework.engine"):
        with LLM(path, engine_process=False) as llm:  # kv_cache_memory auto is the default
            info = llm.engine.info
    # 16 MiB (a quarter of 64 MiB) over blocks of 16 tokens x 2 layers x 2 x 2 heads x 16 floats
    per_block = 16 * 2 * 2 * 2 * 16 * 4
    assert info.num_kv_blocks == (16 << 20) // per_block
    assert any("auto: 25% of 0.06 GiB available RAM" in r.getMessage() for r in caplog.records)
    monkeypatch.setattr(kv_sizing, "probe_memory", lambda device: kv_sizing.DeviceMemory(total=GiB, free=64 << 10))
    with pytest.raises(ConfigError, match=r"raise kv_cache_memory/num_kv_blocks \(auto: 25% of"):
        LLM(path, engine_process=False)


def test_gpu_memory_utilization_is_checked():
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        make_config({"gpu_memory_utilization": 1.5}, env=False)
    assert make_config({}, env=False).kv_cache_memory == "auto"


def test_calloc_backed_cpu_cache_is_zero_and_writable():
    cache = kv_sizing.allocate_zeros((2, 3, 4, 68), torch.float8_e4m3fn, "cpu")
    assert cache.dtype == torch.float8_e4m3fn and cache.view(torch.uint8).eq(0).all()
    cache = kv_sizing.allocate_zeros((2, 3), torch.bfloat16, "cpu")
    cache += 1
    assert cache.eq(1).all()


def test_the_profiling_forward_runs_the_largest_step_without_a_cache(tmp_path_factory, monkeypatch):
    """The GPU's profiling forward, run here with the CUDA allocator's counters mocked:
    one forward of max_num_batched_tokens tokens over at most max_num_seqs sequences,
    each within max_model_len, writing no cache; the peak it returns is the allocator's
    above what was allocated before."""
    path = tiny_checkpoint("llama", tmp_path_factory.getbasetemp() / "tiny")
    counters = {"allocated": 100, "peak": 100}
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("sync"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty"))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: counters["allocated"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: calls.append("reset"))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: counters["peak"])
    with LLM(path, engine_process=False, kv_cache_memory="4MiB") as llm:
        model = llm.engine.client.core.model
        seen = []
        original = model.forward

        def forward(input_ids, positions, context):
            seen.append((input_ids.shape[0], context.metadata.seq_lens.tolist(), [c.numel() for c in context.kv_caches]))
            counters["peak"] = 100 + 5000
            return original(input_ids, positions, context)

        monkeypatch.setattr(model, "forward", forward)
        peak = kv_sizing.profile_forward(model, "cpu", num_tokens=300, num_seqs=4, max_model_len=64, block_size=16)
    assert peak == 5000
    (tokens, lens, caches), = seen
    assert tokens == sum(lens) == 256 and lens == [64, 64, 64, 64]  # 4 sequences, each capped at max_model_len
    assert caches == [0, 0]  # no KV cache is read or written
    assert calls.index("reset") < calls.index("sync", calls.index("reset"))
