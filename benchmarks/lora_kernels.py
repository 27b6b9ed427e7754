"""The LoRA op on a GPU: Triton's ``add_lora_`` (one shrink and one expand launch for
the whole batch) against the plain-torch ``LayerOps.add_lora`` (a gather, two GEMMs
and a scatter-add per adapter present), with the base layer's GEMM for scale.

Rows are spread over three adapters and the base model (row i: slot i % 4, the base
model's row when that is 3), the
adapters' rank is ``--rank`` per fused part. Shapes: SmolLM2-135M's and
Llama-3-8B's fused q/k/v and gate/up layers. Times are ``triton.testing.do_bench``
medians (milliseconds).

    python benchmarks/lora_kernels.py [--dtype bfloat16] [--rank 16]
"""

from __future__ import annotations

import argparse

import torch

SHAPES = {  # name: (in, out, fused parts)
    "smollm2 qkv": (576, 960, 3),
    "smollm2 gate_up": (576, 3072, 2),
    "llama-8b qkv": (4096, 6144, 3),
    "llama-8b gate_up": (4096, 28672, 2),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--batches", default="1,8,32,64")
    args = ap.parse_args()
    import triton.testing
    from pyagent_triton import ops

    from pyagent_framework.interfaces import LayerOps

    dtype = getattr(torch, args.dtype)
    device = torch.device("cuda")
    print(f"LoRA op, {torch.cuda.get_device_name()}, {args.dtype}, rank {args.rank} per part, 3 adapters + base rows")
    print("| layer | batch | base GEMM ms | torch grouped ms | triton ms | triton / torch | triton / GEMM |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, (d_in, d_out, parts) in SHAPES.items():
        width = parts * args.rank
        weight = torch.randn(d_out, d_in, dtype=dtype, device=device) * 0.02
        a = torch.randn(4, width, d_in, dtype=dtype, device=device) * 0.02
        b = torch.randn(4, d_out, width, dtype=dtype, device=device) * 0.02
        for batch in (int(x) for x in args.batches.split(",")):
            x = torch.randn(batch, d_in, dtype=dtype, device=device)
            row_slots = torch.tensor([i % 4 if i % 4 < 3 else -1 for i in range(batch)], dtype=torch.int32, device=device)
            groups = [(s, torch.nonzero(row_slots == s).flatten()) for s in range(3) if (row_slots == s).any()]
            out = x @ weight.T
            want = out.clone()
            LayerOps().add_lora(want, x, a, b, groups, row_slots)
            got = out.clone()
            ops.add_lora_(got, x, a, b, row_slots)
            torch.testing.assert_close(got.float(), want.float(), rtol=3e-2, atol=3e-2)
            gemm = triton.testing.do_bench(lambda: x @ weight.T)
            torch_ms = triton.testing.do_bench(lambda: LayerOps().add_lora(out, x, a, b, groups, row_slots))
            triton_ms = triton.testing.do_bench(lambda: ops.add_lora_(out, x, a, b, row_slots))
            print(f"| {name} | {batch} | {gemm:.4f} | {torch_ms:.4f} | {triton_ms:.4f} | {triton_ms / torch_ms:.2f} | "
                  f"{triton_ms / gemm:.2f} |", flush=True)


if __name__ == "__main__":
    main()
