"""The native core's kernels against the torch code they replace, on SmolLM2's shapes.

    .venv/bin/python benchmarks/native_kernels.py

- linear: every weight of the 30 decoder layers (qkv 960x576, o 576x576, gate_up
  3072x576, down 576x1536; 424 MB, so they stream from memory as in a real step) and
  the 49,152x576 output head, for 1 to 64 rows: ``torch.nn.functional.linear`` vs
  ``pyagent_native._core.linear``.
- decode attention: one layer's decode over a paged cache (9 query heads, 3 key/value
  heads, head size 64, blocks of 16 scattered in the pool) for 64 sequences at several
  context lengths: the built-in ``torch`` backend vs the ``native`` backend.

Each figure is the best of several repetitions (the machine is shared and noisy).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F


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


def bench_attention(repeat: int) -> None:
    from pyagent_framework.builtins.torch_attention import DecodeBatch, TorchAttention
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    from pyagent_native import _core

    print(f"native core ISA: {_core.best_isa()}")
    with torch.inference_mode():
        bench_linear(args.repeat)
    bench_attention(args.repeat)


if __name__ == "__main__":
    main()
