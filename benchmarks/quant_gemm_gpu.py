"""Packed-weight GEMV/GEMM (``pyagent_triton.quant_gemm.packed_linear``) against the
bfloat16 ``F.linear`` (cuBLAS) on Llama-3-8B's linear shapes, on a GPU, in one run.

    python benchmarks/quant_gemm_gpu.py                       # batch 1 and 16, the default encodings
    python benchmarks/quant_gemm_gpu.py --batches 1 16 512 --encodings I4_G128 Q4_K --json

Shapes ``N x K`` (out x in features): 4096 x 4096 (q/o projections), 14336 x 4096
(gate/up) and 4096 x 14336 (down). x is bfloat16 ``[batch, K]``; the weights are
random: int8/int4 quantized from N(0, 0.02) floats, GGUF types random blocks with
small finite f16 fields (the kernels' work does not depend on the values).

Per case: the time of each side, twice. ``eager``: one call per iteration, as the
engine runs today (``triton.testing.do_bench``, median, L2 flushed between calls;
where the host launches slower than the GPU computes, this is host time). ``graph``:
the call captured in a CUDA graph and replayed (what a decode step under CUDA graphs
pays: launch overhead gone, still L2-flushed). ``ratio`` = ours / bf16 (below 1:
ours is faster); ``bytes`` = bytes ours reads / bytes bf16 reads (weights + x + out).
The issue's goal: at batch 1, ratio <= 1.5 while bytes <= 0.35. ``err`` is the
relative error (Frobenius) of ours against the packed weight dequantized to bfloat16
and multiplied by ``F.linear``, a check that the timed kernel computes the product.

Without CUDA it says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys

SHAPES = [("q/o 4096x4096", 4096, 4096), ("gate/up 14336x4096", 14336, 4096), ("down 4096x14336", 4096, 14336)]
ENCODINGS = ["I8", "I4_G32", "I4_G128", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"]
#: GGUF block types: (values, bytes, byte offsets of the f16 fields) per block.
GGUF_BLOCKS = {
    "Q8_0": (32, 34, (0,)), "Q4_0": (32, 18, (0,)), "Q4_1": (32, 20, (0, 2)), "Q5_0": (32, 22, (0,)),
    "Q5_1": (32, 24, (0, 2)), "IQ4_NL": (32, 18, (0,)), "Q2_K": (256, 84, (80, 82)),
    "Q3_K": (256, 110, (108,)), "Q4_K": (256, 144, (0, 2)), "Q5_K": (256, 176, (0, 2)),
    "Q6_K": (256, 210, (208,)),
}


def packed_weight(encoding: str, n: int, k: int, generator):
    import torch

    if encoding in GGUF_BLOCKS:
        block, size, fields = GGUF_BLOCKS[encoding]
        blocks = torch.randint(0, 256, (n, k // block, size), dtype=torch.uint8, device="cuda", generator=generator)
        for at in fields:
            scale = (torch.rand(n, k // block, device="cuda", generator=generator) * 2e-3).half()
            blocks[..., at : at + 2] = scale.view(torch.uint8).view(n, k // block, 2)
        return blocks.view(n, -1)
    from pyagent_quant import encodings

    w = torch.randn(n, k, device="cuda", generator=generator) * 0.02
    if encoding == "I8":
        return encodings.quantize_i8(w).data
    return encodings.quantize_i4(w, int(encoding[4:])).data


def bench(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median")  # milliseconds


def graphed(fn):
    """``fn`` captured in a CUDA graph (after a warm-up that compiles), as a replay call."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def run_case(encoding: str, n: int, k: int, batch: int, generator) -> dict:
    import torch
    import torch.nn.functional as F
    from pyagent_triton import quant_gemm

    data = packed_weight(encoding, n, k, generator)
    weight = quant_gemm.dequantize(data, encoding, k, torch.bfloat16)  # bf16's own weight: same values
    x = torch.randn(batch, k, device="cuda", generator=generator).bfloat16()

    def ours():
        return quant_gemm.packed_linear(x, data, encoding)

    def bf16():
        return F.linear(x, weight)

    expected = bf16().float()
    error = float((ours().float() - expected).norm() / expected.norm())
    t_ours, t_bf16 = bench(ours), bench(bf16)
    g_ours, g_bf16 = bench(graphed(ours)), bench(graphed(bf16))
    io = 2 * batch * (k + n)
    return {
        "encoding": encoding, "n": n, "k": k, "batch": batch,
        "ours_ms": t_ours, "bf16_ms": t_bf16, "ratio": t_ours / t_bf16,
        "ours_graph_ms": g_ours, "bf16_graph_ms": g_bf16, "graph_ratio": g_ours / g_bf16,
        "bytes_ratio": (data.numel() + io) / (weight.numel() * 2 + io), "error": error,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--encodings", nargs="+", default=ENCODINGS)
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--json", action="store_true", help="print the rows as JSON lines too")
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("quant_gemm_gpu: no CUDA device here; this benchmark times Triton kernels on a GPU", file=sys.stderr)
        return 2
    from pyagent_triton import quant_gemm

    unknown = [e for e in args.encodings if not quant_gemm.supports(e)]
    if unknown:
        parser.error(f"no kernel for {', '.join(unknown)} (there are: {', '.join(quant_gemm.encodings())})")
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    header = (
        f"{'shape':<20} {'enc':<8} {'batch':>5} {'ours ms':>8} {'bf16 ms':>8} {'ratio':>6} "
        f"{'graph ours':>10} {'graph bf16':>10} {'ratio':>6} {'bytes':>6} {'err':>8}"
    )
    print(header)
    generator = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for label, n, k in SHAPES:
        for encoding in args.encodings:
            for batch in args.batches:
                row = run_case(encoding, n, k, batch, generator)
                rows.append(row)
                print(
                    f"{label:<20} {encoding:<8} {batch:>5} {row['ours_ms']:>8.4f} {row['bf16_ms']:>8.4f} "
                    f"{row['ratio']:>6.2f} {row['ours_graph_ms']:>10.4f} {row['bf16_graph_ms']:>10.4f} "
                    f"{row['graph_ratio']:>6.2f} {row['bytes_ratio']:>6.2f} {row['error']:>8.1e}",
                    flush=True,
                )
    goal = [r for r in rows if r["batch"] == 1 and r["bytes_ratio"] <= 0.35]
    met = [r for r in goal if r["graph_ratio"] <= 1.5]
    print(
        f"batch 1, encodings reading <= 35% of bf16's bytes: {len(met)} of {len(goal)} cases within 1.5x of bf16's "
        "time (graph replay)"
    )
    if args.json:
        for row in rows:
            print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
