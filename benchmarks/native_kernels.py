"""The native core's kernels against the torch code they replace, on SmolLM2's shapes.

    .venv/bin/python benchmarks/native_kernels.py

- linear: every weight of the 30 decoder layers (qkv 960x576, o 576x576, gate_up
  3072x576, down 576x1536; 424 MB, so they stream from memory as in a real step) and
  the 49,152x576 output head, for 1 to 64 rows: ``torch.nn.functional.linear`` vs
  ``pyagent_native._core.linear``.
- quantized linear: ``pyagent_native._core.quantized_linear`` (the packed weight read
  directly) per encoding vs the native fp32 ``linear`` on a float weight of the same
  shape and vs ``_core.dequantize`` + ``torch.nn.functional.linear`` (the prefill path),
  on SmolLM2's shapes for 1 to 32 rows, with the effective GB/s of weight bytes read
  for one row. Each weight is cycled through copies totalling 96 MB (more than the
  L3), so it streams from memory as in a real decode step.
- decode attention: one layer's decode over a paged cache (9 query heads, 3 key/value
  heads, head size 64, blocks of 16 scattered in the pool) for 64 sequences at several
  context lengths: the built-in ``torch`` backend vs the ``native`` backend.
- isas: every build of the kernels this CPU runs (portable, AVX2, AVX-512) on the same
  float and quantized GEMMs (1, 8 and 32 rows), in the same run.
- int8: the AVX-512 build's integer GEMM (``--activations int16``, the default, or
  ``int8``) against the float path, per encoding, from 4 to 2,048 rows of x.

Each figure is the best of several repetitions (the machine is shared and noisy).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def best_ms(fn, repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def bench_linear(repeat: int) -> None:
    from pyagent_native import _core

    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
    gen = torch.Generator().manual_seed(0)
    layers = [[torch.randn(*s, generator=gen) for s in shapes] for _ in range(30)]
    head = torch.randn(49152, 576, generator=gen)
    threads = torch.get_num_threads()
    print(f"linear (threads={threads}): ms per pass, torch / native")
    print(f"  {'rows':>4}  {'30 layers':>22}  {'output head':>22}")
    for rows in (1, 2, 4, 8, 16, 32, 64):
        xs = {k: torch.randn(rows, k, generator=gen) for k in (576, 1536)}
        outs = {s: torch.empty(rows, s[0]) for s in shapes}
        arrays = [[(outs[tuple(w.shape)].numpy(), xs[w.shape[1]].numpy(), w.numpy()) for w in layer] for layer in layers]
        head_out = torch.empty(rows, head.shape[0])

        def torch_layers():
            for layer in layers:
                for w in layer:
                    F.linear(xs[w.shape[1]], w)

        def native_layers():
            for layer in arrays:
                for out, x, w in layer:
                    _core.linear(out, x, w, None, threads)

        t_layers, n_layers = best_ms(torch_layers, repeat), best_ms(native_layers, repeat)
        t_head = best_ms(lambda: F.linear(xs[576], head), repeat)
        n_head = best_ms(lambda: _core.linear(head_out.numpy(), xs[576].numpy(), head.numpy(), None, threads), repeat)
        print(
            f"  {rows:>4}  {t_layers:7.1f} / {n_layers:6.1f} = {t_layers / n_layers:4.2f}x"
            f"  {t_head:7.2f} / {n_head:6.2f} = {t_head / n_head:4.2f}x"
        )


# encoding, group, label: what the quantized section times.
QUANT_KINDS = [("Q4_1", 0, "Q4_1"), ("Q8_0", 0, "Q8_0"), ("I8", 0, "I8"), ("I4", 32, "I4 g32"), ("Q6_K", 0, "Q6_K")]


def random_quantized(encoding: str, group: int, n: int, k: int, gen: torch.Generator):
    """Random codes with finite, weight-sized half scales (uint8 [n, row bytes])."""
    import numpy as np

    from pyagent_native import _core

    row_bytes = _core.quant_row_bytes(encoding, k, group)
    data = torch.randint(0, 256, (n, row_bytes), dtype=torch.uint8, generator=gen).numpy()
    if encoding == "I8":
        data[:, :4] = (torch.rand(n, 1, generator=gen) * 0.01).numpy().view(np.uint8)
        return data
    block, size, fields = {
        "Q8_0": (32, 34, [0]),
        "Q4_0": (32, 18, [0]),
        "Q4_1": (32, 20, [0, 2]),
        "Q6_K": (256, 210, [208]),
        "I4": (group, 4 + group // 2, [0, 2]),
    }[encoding]
    blocks = data.reshape(n, -1, size)
    for offset in fields:
        halves = (torch.randn(n, blocks.shape[1], generator=gen) * 0.01).half().numpy()
        blocks[:, :, offset : offset + 2] = halves.view(np.uint8).reshape(n, -1, 2)
    return data


def bench_quantized(repeat: int, threads: int) -> None:
    from pyagent_native import _core

    pool_bytes = 96 << 20
    deq_copies = 16
    shapes = [(576, 576), (1536, 576), (576, 1536), (49152, 576)]
    rows_list = (1, 4, 16, 32)
    gen = torch.Generator().manual_seed(0)

    def per_call_us(fn, copies: int) -> float:
        return best_ms(lambda: [fn(i) for i in range(copies)], repeat) * 1e3 / copies

    print(
        f"quantized linear (threads={threads}, load average {os.getloadavg()[0]:.2f}): us per call, "
        f"weights cycled through {pool_bytes >> 20} MB"
    )
    print("  native: _core.quantized_linear; fp32: _core.linear on a float weight of the same shape;")
    print(f"  deq+F: _core.dequantize + F.linear (through at most {deq_copies} copies: its float matmul dominates)")
    print("  GB/s: weight bytes per call / time, one row; (x): fp32 time / this time")
    for n, k in shapes:
        xs = {m: torch.randn(m, k, generator=gen) for m in rows_list}
        outs = {m: torch.empty(m, n) for m in rows_list}
        fp32_bytes = n * k * 4
        copies = max(1, -(-pool_bytes // fp32_bytes))
        weights = [torch.randn(n, k, generator=gen).numpy() for _ in range(copies)]
        fp32 = {
            m: per_call_us(lambda i, m=m: _core.linear(outs[m].numpy(), xs[m].numpy(), weights[i], None, threads), copies)
            for m in rows_list
        }
        del weights
        print(f"  {n}x{k}")
        header = "".join(f"{'rows ' + str(m):>22}" for m in rows_list)
        print(f"    {'weight':<16}{'KB':>7}{'GB/s':>7}{header}")
        cells = "".join(f"{fp32[m]:>14.1f}        " for m in rows_list)
        print(f"    {'fp32':<16}{fp32_bytes / 1024:>7.0f}{fp32_bytes / fp32[1] / 1e3:>7.1f}{cells}")
        dense = torch.empty(n, k)
        for encoding, group, label in QUANT_KINDS:
            if encoding == "Q6_K" and k % 256:
                print(f"    {label:<16}  n/a: K = {k} is not a multiple of 256")
                continue
            row_bytes = _core.quant_row_bytes(encoding, k, group)
            size = n * row_bytes
            copies = max(1, -(-pool_bytes // size))
            packed = [random_quantized(encoding, group, n, k, gen) for _ in range(copies)]
            native, torch_path = {}, {}
            for m in rows_list:
                x, out = xs[m].numpy(), outs[m].numpy()

                def fused(i, x=x, out=out):
                    _core.quantized_linear(out, x, packed[i], encoding, group, None, threads)

                def dequant_then_torch(i, m=m):
                    _core.dequantize(dense.numpy(), packed[i], encoding, group, threads)
                    F.linear(xs[m], dense)

                native[m] = per_call_us(fused, copies)
                torch_path[m] = per_call_us(dequant_then_torch, min(copies, deq_copies))
            cells = "".join(f"{native[m]:>10.1f} ({fp32[m] / native[m]:4.1f}x)   " for m in rows_list)
            print(f"    {label + ' native':<16}{size / 1024:>7.0f}{size / native[1] / 1e3:>7.1f}{cells}")
            cells = "".join(f"{torch_path[m]:>10.1f} ({fp32[m] / torch_path[m]:4.1f}x)   " for m in rows_list)
            print(f"    {label + ' deq+F':<16}{'':>7}{size / torch_path[1] / 1e3:>7.1f}{cells}")
            del packed
    print(f"  (load average after: {os.getloadavg()[0]:.2f})")


def bench_attention(repeat: int) -> None:
    from pyagent_framework.paged_attention import DecodeBatch, TorchAttention
    from pyagent_native.attention import NativeAttention

    heads, kv_heads, head_size, block_size, seqs = 9, 3, 64, 16, 64
    print(f"decode attention, one layer, {seqs} sequences: ms, torch / native")
    gen = torch.Generator().manual_seed(0)
    for context in (64, 160, 320, 640):
        per_seq = -(-context // block_size)
        num_blocks = seqs * per_seq + 1
        cache = torch.randn(2, num_blocks, block_size, kv_heads, head_size, generator=gen)
        tables = (torch.randperm(num_blocks - 1, generator=gen)[: seqs * per_seq].view(seqs, per_seq) + 1).int()
        lens = torch.full((seqs,), context, dtype=torch.int32)
        query = torch.randn(seqs, heads, head_size, generator=gen)
        batch = DecodeBatch(None, tables, lens, context, block_size, torch.device("cpu"))
        ref, native = TorchAttention(heads, head_size, kv_heads), NativeAttention(heads, head_size, kv_heads)
        with torch.inference_mode():
            t = best_ms(lambda: ref.decode_attention(query, cache, batch), repeat)
            n = best_ms(lambda: native.decode_attention(query, cache, batch), repeat)
        print(f"  context {context:>4}: {t:6.2f} / {n:6.2f} = {t / n:4.2f}x")


def bench_isas(repeat: int, threads: int) -> None:
    """Every build of the kernels this CPU runs on the same work, in the same run: the
    float GEMM and the quantized GEMM of a SmolLM2 gate_up (3072 x 576) and down
    (576 x 1536) for 1, 8 and 32 rows of x."""
    import numpy as np

    from native.tests.quant_reference import random_weight
    from pyagent_native import _core

    isas = _core.available_isas()
    rng = np.random.default_rng(0)
    print(f"kernel builds (threads={threads}): ms per call, {' / '.join(isas)}; last build's speed-up over the first SIMD one")
    cases = [("float32", 3072, 576), ("Q4_1", 3072, 576), ("Q5_0", 3072, 576), ("Q8_0", 3072, 576),
             ("Q4_K", 576, 1536), ("Q6_K", 576, 1536)]
    for encoding, n, k in cases:
        weight = rng.standard_normal((n, k)).astype(np.float32) if encoding == "float32" else random_weight(encoding, n, k, 0, rng)
        for rows in (1, 8, 32):
            x = rng.standard_normal((rows, k)).astype(np.float32)
            out = np.empty((rows, n), np.float32)

            def call(isa):
                if encoding == "float32":
                    return lambda: _core.linear(out, x, weight, None, threads, isa)
                return lambda: _core.quantized_linear(out, x, weight, encoding, 0, None, threads, isa)

            times = [best_ms(call(isa), repeat) for isa in isas]
            simd = times[1] if len(times) > 2 else times[0]
            cells = " / ".join(f"{t:6.3f}" for t in times)
            print(f"  {encoding:<7} {n:>4}x{k:<4} rows {rows:>2}: {cells}   {simd / times[-1]:4.2f}x")


def bench_int8(repeat: int, threads: int, activations: str) -> None:
    """The integer GEMM (int16 or int8 activations) against the float path on the same
    weights, per encoding, at the row counts of batched decode (4-64) and of 512- and
    2,048-token prefills, where the float path is dequantize + torch's GEMM (what
    PackedLinear does past 64 rows with float32 activations)."""
    import numpy as np

    from native.tests.quant_reference import INT8_GEMM, random_weight
    from pyagent_native import _core

    rng = np.random.default_rng(0)
    n, k = 3072, 1024
    print(f"{activations} activations (threads={threads}): GOP/s of {n}x{k} products (2 per multiply-add), "
          "float path / integer GEMM = speed-up")
    for encoding in INT8_GEMM:
        if not _core.int8_gemm(encoding):
            print(f"  {encoding}: no integer GEMM in this build")
            continue
        weight = random_weight(encoding, n, k, 0, rng)
        dense = torch.empty(n, k)
        cells = []
        for rows in (4, 16, 32, 64, 512, 2048):
            x = rng.standard_normal((rows, k)).astype(np.float32)
            out = np.empty((rows, n), np.float32)
            if rows <= 64:
                def plain():
                    _core.quantized_linear(out, x, weight, encoding, 0, None, threads)
            else:
                xt = torch.from_numpy(x)

                def plain():
                    _core.dequantize(dense.numpy(), weight, encoding, 0, threads)
                    F.linear(xt, dense)

            def integer():
                _core.quantized_linear(out, x, weight, encoding, 0, None, threads, "auto", activations)

            flops = 2 * rows * n * k / 1e6  # per ms = GFLOP/s
            a, b = best_ms(plain, repeat), best_ms(integer, repeat)
            cells.append(f"{rows:>3}: {flops / a:5.0f} / {flops / b:5.0f} = {a / b:4.2f}x")
        print(f"  {encoding:<7} " + "   ".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None, help="torch and native threads (default: torch's)")
    parser.add_argument(
        "--only", choices=["linear", "quantized", "attention", "isas", "int8"], action="append",
        help="run only these sections"
    )
    parser.add_argument("--activations", choices=["int16", "int8"], default="int16",
                        help="the int8 section's rounding of x (default: the gguf quantizer's int16)")
    args = parser.parse_args()
    from pyagent_native import _core

    if args.threads:
        torch.set_num_threads(args.threads)
    sections = args.only or ["linear", "quantized", "attention", "isas", "int8"]
    print(f"native core ISA: {_core.best_isa()}")
    with torch.inference_mode():
        if "linear" in sections:
            bench_linear(args.repeat)
        if "quantized" in sections:
            bench_quantized(args.repeat, torch.get_num_threads())
    if "attention" in sections:
        bench_attention(args.repeat)
    if "isas" in sections:
        bench_isas(args.repeat, torch.get_num_threads())
    if "int8" in sections:
        bench_int8(args.repeat, torch.get_num_threads(), args.activations)


if __name__ == "__main__":
    main()
