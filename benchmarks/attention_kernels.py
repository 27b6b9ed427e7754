"""Triton paged attention vs ``torch.nn.functional.scaled_dot_product_attention`` on
the same shapes, on a GPU, in one run.

    python benchmarks/attention_kernels.py                    # bfloat16, the default shape set
    python benchmarks/attention_kernels.py --dtype float16 --json

Decode: one query token per sequence over a context of ``S`` tokens. Ours reads the
keys/values from the engine's paged cache (blocks of 16, shuffled block ids); SDPA
gets them contiguous (``[B, H, S, D]``, grouped-query through ``enable_gqa``), which is
the layout a non-paged engine keeps, so SDPA is given the easier job. Also shown: the
built-in ``torch`` backend's decode (gather the blocks, then SDPA), what the engine
runs without Triton.

Prefill: ``B`` fresh prompts of ``L`` tokens, causal. Ours is one varlen launch over
the paged cache; SDPA runs the padded batch ``[B, H, L, D]`` with ``is_causal``.

Times are medians of ``triton.testing.do_bench`` (CUDA events, caches flushed between
runs); ratio = SDPA time / ours (above 1: ours is faster). Where a call's host side
(argument checks, Triton's launcher) takes longer than its kernels, the GPU waits for
it and those times are host times; so the table also gives each side's kernel time
alone, from the torch profiler over repeated calls (no flushing between them), and
ours' host time per call.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F

# (label, heads, kv heads, head dim): SmolLM2-135M's attention and a Llama-3-8B-like one.
MODELS = [("smollm2-135m", 9, 3, 64), ("llama3-8b", 32, 8, 128)]
DECODE = [(1, 1024), (8, 1024), (32, 2048), (64, 4096), (1, 16384), (4, 32768)]  # (batch, context)
PREFILL = [(1, 512), (4, 1024), (1, 4096)]  # (prompts, length)
BLOCK = 16


def paged_cache(keys: torch.Tensor, values: torch.Tensor, generator: torch.Generator):
    """Contiguous ``[B, KVH, S, D]`` keys/values -> (cache ``[2, blocks, BLOCK, KVH, D]``,
    block tables ``[B, S / BLOCK]``) holding the same numbers in shuffled blocks."""
    batch, kvh, seq, dim = keys.shape
    per_seq = -(-seq // BLOCK)
    order = torch.randperm(batch * per_seq, generator=generator).to(keys.device)
    cache = torch.zeros(2, batch * per_seq, BLOCK, kvh, dim, device=keys.device, dtype=keys.dtype)
    tables = order.view(batch, per_seq).to(torch.int32)
    for which, tensor in enumerate((keys, values)):
        padded = torch.zeros(batch, per_seq * BLOCK, kvh, dim, device=keys.device, dtype=keys.dtype)
        padded[:, :seq] = tensor.transpose(1, 2)
        cache[which, order] = padded.view(batch * per_seq, BLOCK, kvh, dim)
    return cache, tables


def bench(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median")  # milliseconds


def kernel_ms(fn, calls: int = 20) -> float | None:
    """Milliseconds per call spent in GPU kernels (profiler), or None if unreadable."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
        return sum(e.time_range.elapsed_us() for e in kernels) / calls / 1000 if kernels else None
    except Exception:  # profiler unavailable here
        return None


def host_ms(fn, calls: int = 200) -> float:
    """Host milliseconds per call, launching without waiting (the queue absorbs it)."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1000


def timings(ours, sdpa) -> dict:
    return {
        "ours_ms": bench(ours), "sdpa_ms": bench(sdpa), "ours_kernel_ms": kernel_ms(ours),
        "sdpa_kernel_ms": kernel_ms(sdpa), "ours_host_ms": host_ms(ours),
    }


def decode_case(model, batch, seq, dtype, generator):
    from pyagent_framework.paged_attention import TorchAttention, attention_plan
    from pyagent_framework.types import AttentionMetadata
    from pyagent_triton.attention import paged_attention_decode

    label, heads, kv_heads, dim = model
    device = "cuda"
    q = torch.randn(batch, heads, dim, device=device, dtype=dtype)
    k = torch.randn(batch, kv_heads, seq, dim, device=device, dtype=dtype)
    v = torch.randn(batch, kv_heads, seq, dim, device=device, dtype=dtype)
    cache, tables = paged_cache(k, v, generator)
    seq_lens = torch.full((batch,), seq, device=device, dtype=torch.int32)
    scale = dim**-0.5

    ours = lambda: paged_attention_decode(q, cache, seq_lens, tables, scale)  # noqa: E731
    q4 = q.view(batch, heads, 1, dim)
    sdpa = lambda: F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)  # noqa: E731
    backend = TorchAttention(heads, dim, kv_heads, scale)
    metadata = AttentionMetadata(
        slot_mapping=torch.zeros(batch, dtype=torch.long, device=device),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
        seq_lens=seq_lens, block_tables=tables, block_size=BLOCK, max_query_len=1, max_seq_len=seq,
    )
    decode = attention_plan(metadata, cache.device).decode
    torch_backend = lambda: backend.decode_attention(q, cache, decode)  # noqa: E731

    reference = sdpa().view(batch, heads, dim).float()
    error = (ours().float() - reference).abs().max().item()
    t = timings(ours, sdpa)
    kv_bytes = 2 * batch * seq * kv_heads * dim * cache.element_size()
    return {
        "kind": "decode", "model": label, "batch": batch, "context": seq, **t, "torch_backend_ms": bench(torch_backend),
        "sdpa_over_ours": t["sdpa_ms"] / t["ours_ms"], "ours_gb_per_s": kv_bytes / t["ours_ms"] / 1e6,
        "max_abs_error": error,
    }


def prefill_case(model, batch, length, dtype, generator):
    from pyagent_triton.attention import paged_attention_prefill

    label, heads, kv_heads, dim = model
    device = "cuda"
    q = torch.randn(batch, heads, length, dim, device=device, dtype=dtype)
    k = torch.randn(batch, kv_heads, length, dim, device=device, dtype=dtype)
    v = torch.randn(batch, kv_heads, length, dim, device=device, dtype=dtype)
    cache, tables = paged_cache(k, v, generator)
    flat_q = q.transpose(1, 2).reshape(batch * length, heads, dim).contiguous()
    starts = torch.arange(0, (batch + 1) * length, length, device=device, dtype=torch.int32)
    seq_lens = torch.full((batch,), length, device=device, dtype=torch.int32)
    scale = dim**-0.5

    ours = lambda: paged_attention_prefill(flat_q, cache, starts, seq_lens, tables, scale, max_query_len=length)  # noqa: E731
    sdpa = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)  # noqa: E731
    reference = sdpa().transpose(1, 2).reshape(batch * length, heads, dim).float()
    error = (ours().float() - reference).abs().max().item()
    t = timings(ours, sdpa)
    return {
        "kind": "prefill", "model": label, "batch": batch, "context": length, **t,
        "sdpa_over_ours": t["sdpa_ms"] / t["ours_ms"], "max_abs_error": error,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("attention_kernels.py times compiled kernels and needs a CUDA GPU (the CPU runs Triton only interpreted)")
    dtype = getattr(torch, args.dtype)
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    rows = []
    with torch.inference_mode():
        for model in MODELS:
            rows += [decode_case(model, b, s, dtype, generator) for b, s in DECODE]
            rows += [prefill_case(model, b, n, dtype, generator) for b, n in PREFILL]
    summary = {"device": torch.cuda.get_device_name(), "dtype": args.dtype, "torch": torch.__version__, "rows": rows}
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    import triton

    print(f"{summary['device']}  {args.dtype}  torch {torch.__version__}  triton {triton.__version__}")
    print(f"{'kind':<8}{'model':<14}{'batch':>6}{'context':>8}{'ours ms':>10}{'sdpa ms':>10}{'torch-be ms':>12}"
          f"{'sdpa/ours':>10}{'kern ours':>10}{'kern sdpa':>10}{'host ours':>10}{'max err':>10}")

    def ms(value, width):
        return f"{value:{width}.4f}" if value is not None else " " * (width - 1) + "-"

    for r in rows:
        print(f"{r['kind']:<8}{r['model']:<14}{r['batch']:>6}{r['context']:>8}{r['ours_ms']:10.4f}{r['sdpa_ms']:10.4f}"
              f"{ms(r.get('torch_backend_ms'), 12)}{r['sdpa_over_ours']:10.2f}{ms(r['ours_kernel_ms'], 10)}"
              f"{ms(r['sdpa_kernel_ms'], 10)}{r['ours_host_ms']:10.4f}{r['max_abs_error']:10.4f}")


if __name__ == "__main__":
    main()
