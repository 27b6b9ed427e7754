"""How close decoding runs to this machine's limits: memory bandwidth and float32/int8
arithmetic peak, measured here, against what single-stream decode, batched decode and
prefill of the embedded SmolLM2 (Q4_1 GGUF) achieve.

    .venv/bin/python benchmarks/limits.py
    .venv/bin/python benchmarks/limits.py --skip-engine   # the machine's limits only
    .venv/bin/python benchmarks/limits.py --part context  # the KV cache in a decode step

The limits, with torch's thread count (2 here):

- **read bandwidth**: ``torch.sum`` over 1 GiB of float32 (a STREAM-like pass, each
  byte read once), and ``copy_`` between two 1 GiB tensors (bytes read + written);
- **float32 and int8 peak**: a microkernel compiled here with gcc (``-O3 -march=native``,
  one OpenMP thread per torch thread) running twelve independent chains of 512-bit FMAs
  (``vfmadd231ps``: 32 FLOP each) and of ``vpdpbusd`` (64 int8 multiply-adds: 128 OP),
  on registers only; 256-bit FMAs when the CPU has no AVX-512, no int8 figure without
  VNNI;
- for reference, torch's float32 GEMM at 2048^3 (MKL): what a tuned GEMM reaches.

The work (``benchmarks/decode.py``'s functions: greedy, EOS ignored), with float32
activations, int16 (the default: two int8 products per multiply-add, counted so
against the int8 peak) and int8 activations:

- single stream, 128 tokens: each token reads every packed weight once (the bytes the
  model's linears and head hold), so bytes/s = weight bytes x tok/s;
- 32 concurrent x 128 tokens: a step reads the weights once for 32 tokens, so bytes/s =
  weight bytes x tok/s / 32; FLOP/s from output tokens only (prefill time is in the
  run, so it is a lower bound);
- prefill of a 512-token prompt: FLOP/s.

FLOPs per token are 2 x the linears' and head's multiply-adds (attention and the rest
left out: under 2% at these lengths).

The ``context`` part: what attention's reading of the KV cache costs a batched decode
step. 32 sequences decode 128 tokens after prompts of 16 and of 256 random tokens (the
default int16 activations); a pure-decode step's time is ``generate``'s time for 129
tokens less its time for 1 (the prefill), over 128 steps (best of 2 rounds). The
longer prompts add 32 x 240 tokens of context per step, whose keys and values every
step reads: those bytes over the added time are the rate attention reads the cache at,
set against the read bandwidth.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

MICROKERNEL = r"""
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>

#define CHAINS 12
#if defined(__AVX512F__)
typedef __m512 vec;
#define LANES 16
#define SET1 _mm512_set1_ps
#define FMA _mm512_fmadd_ps
#define STORE _mm512_storeu_ps
#else
typedef __m256 vec;
#define LANES 8
#define SET1 _mm256_set1_ps
#define FMA _mm256_fmadd_ps
#define STORE _mm256_storeu_ps
#endif
static double now(void) { return omp_get_wtime(); }

int main(int argc, char** argv) {
  const long iters = atol(argv[1]);
  double best_fma = 0, best_dp = 0;
  for (int round = 0; round < 5; ++round) {
    double t0 = now();
#pragma omp parallel
    {
      vec acc[CHAINS];
      const vec a = SET1(1.0000001f), b = SET1(0.9999999f);
      for (int c = 0; c < CHAINS; ++c) acc[c] = SET1((float)c);
      for (long i = 0; i < iters; ++i)
#pragma GCC unroll 12
        for (int c = 0; c < CHAINS; ++c) acc[c] = FMA(a, acc[c], b);
      float sink = 0, lanes[LANES];
      for (int c = 0; c < CHAINS; ++c) {
        STORE(lanes, acc[c]);
        for (int l = 0; l < LANES; ++l) sink += lanes[l];
      }
      if (sink == 12345.0f) printf("%f\n", sink);
    }
    double t = now() - t0;
    const double flop_per = 2.0 * LANES;
    double gflops = flop_per * CHAINS * (double)iters * omp_get_max_threads() / t / 1e9;
    if (gflops > best_fma) best_fma = gflops;
#if defined(__AVX512VNNI__)
    t0 = now();
#pragma omp parallel
    {
      __m512i acc[CHAINS];
      const __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(5);
      for (int c = 0; c < CHAINS; ++c) acc[c] = _mm512_set1_epi32(c);
      for (long i = 0; i < iters; ++i)
#pragma GCC unroll 12
        for (int c = 0; c < CHAINS; ++c) acc[c] = _mm512_dpbusd_epi32(acc[c], a, b);
      int sink = 0;
      for (int c = 0; c < CHAINS; ++c) sink += _mm512_reduce_add_epi32(acc[c]);
      if (sink == 12345) printf("%d\n", sink);
    }
    t = now() - t0;
    double gops = 128.0 * CHAINS * (double)iters * omp_get_max_threads() / t / 1e9;
    if (gops > best_dp) best_dp = gops;
#endif
  }
  printf("%.1f %.1f\n", best_fma, best_dp);
  return 0;
}
"""


def median(values):
    return sorted(values)[len(values) // 2]


def bandwidth() -> tuple[float, float]:
    """(read GB/s through torch.sum, copy GB/s counting bytes read and written), medians of 5."""
    import torch

    a = torch.ones(2**28)  # 1 GiB of float32
    b = torch.empty_like(a)
    a.sum(), b.copy_(a)
    reads, copies = [], []
    for _ in range(5):
        start = time.perf_counter()
        a.sum()
        reads.append(a.nbytes / (time.perf_counter() - start) / 1e9)
        start = time.perf_counter()
        b.copy_(a)
        copies.append(2 * a.nbytes / (time.perf_counter() - start) / 1e9)
    return median(reads), median(copies)


def peaks(threads: int) -> tuple[float, float | None]:
    """(float32 GFLOP/s, int8 GOP/s or None) from the register-only microkernel."""
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise SystemExit("limits.py needs gcc to build its peak microkernel")
    with tempfile.TemporaryDirectory() as tmp:
        source, binary = Path(tmp) / "peak.c", Path(tmp) / "peak"
        source.write_text(MICROKERNEL)
        subprocess.run([compiler, "-O3", "-march=native", "-fopenmp", str(source), "-o", str(binary)], check=True)
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        out = subprocess.run([str(binary), "20000000"], check=True, capture_output=True, text=True, env=env).stdout
    fma, dp = (float(v) for v in out.split())
    return fma, (dp or None)


def mkl_gemm() -> float:
    import torch

    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    a @ b
    rates = []
    for _ in range(5):
        start = time.perf_counter()
        a @ b
        rates.append(2 * 2048**3 / (time.perf_counter() - start) / 1e9)
    return median(rates)


def weight_facts(model: str | None) -> tuple[int, int]:
    """(bytes the linears and head hold, multiply-adds per token) of the GGUF model."""
    from torch import nn

    from pyagent_framework import LLM

    llm = LLM(model, engine_process=False, kv_cache_memory="16MiB", max_model_len=256)
    total_bytes = macs = 0
    for module in llm.engine.core.model.modules():
        packed = getattr(module, "packed", None)
        if packed is not None and hasattr(module, "in_features"):
            total_bytes += packed.data.nbytes
            macs += module.in_features * module.out_features
        elif isinstance(module, nn.Linear):
            total_bytes += module.weight.nbytes
            macs += module.in_features * module.out_features
    llm.close()
    return total_bytes, macs


def kv_bytes_per_token(model: str | None) -> int:
    """Bytes of keys and values one token holds in the engine's cache (every layer)."""
    from pyagent_framework import LLM

    llm = LLM(model, engine_process=False, kv_cache_memory="16MiB", max_model_len=256)
    core = llm.engine.core
    per_token = core.kv_cache.nbytes // (core.kv_cache.shape[2] * core.config.block_size)
    llm.close()
    return per_token


def decode_step_ms(model: str | None, batch: int, prompt_tokens: int, rounds: int = 2) -> float:
    """ms per pure-decode step of `batch` sequences after prompts of `prompt_tokens`
    random tokens (see the module docstring)."""
    import random

    from pyagent_framework import LLM, SamplingParams

    llm = LLM(model, max_num_seqs=batch)
    rng = random.Random(prompt_tokens)
    vocab = llm.engine.vocab_size

    def run(max_tokens: int) -> float:
        prompts = [[rng.randrange(vocab) for _ in range(prompt_tokens)] for _ in range(batch)]
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        return time.perf_counter() - start

    run(4)  # warm-up
    times = {1: [], 129: []}
    for _ in range(rounds):
        for max_tokens in times:
            times[max_tokens].append(run(max_tokens))
    llm.close()
    return 1e3 * (min(times[129]) - min(times[1])) / 128


def context_part(model: str | None, read: float) -> None:
    per_token = kv_bytes_per_token(model)
    short, long = decode_step_ms(model, 32, 16), decode_step_ms(model, 32, 256)
    added = 32 * (256 - 16) * per_token
    rate = added / ((long - short) / 1e3)
    at_long = 32 * (256 + 64.5) * per_token  # mean context over the 128 steps
    print(f"\n32 concurrent decode steps (int16 activations), KV cache {per_token} bytes per token:")
    print(f"  after 16-token prompts   {short:6.1f} ms/step")
    print(f"  after 256-token prompts  {long:6.1f} ms/step: {at_long / 1e6:.0f} MB of keys and values read per step")
    print(f"  the added context's {added / 1e6:.0f} MB in {long - short:.1f} ms: {rate / 1e9:.1f} GB/s, "
          f"{rate / 1e9 / read:.0%} of the read bandwidth")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a GGUF file (default: the embedded SmolLM2 Q4_1 GGUF)")
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--part", choices=["all", "work", "context"], default="all",
                        help="the engine's work against the limits, the KV cache's cost in a decode step, or both")
    args = parser.parse_args()

    import torch

    threads = torch.get_num_threads()
    read, copy = bandwidth()
    fma, dp = peaks(threads)
    gemm = mkl_gemm()
    print(f"machine, {threads} threads:")
    print(f"  read bandwidth (torch.sum, 1 GiB)         {read:7.1f} GB/s")
    print(f"  copy bandwidth (read + write, 1 GiB)      {copy:7.1f} GB/s")
    print(f"  float32 peak (FMA microkernel)            {fma:7.1f} GFLOP/s")
    print(f"  int8 peak (vpdpbusd microkernel)          {dp:7.1f} GOP/s" if dp else "  int8 peak: no AVX-512 VNNI")
    print(f"  torch float32 GEMM 2048^3 (MKL)           {gemm:7.1f} GFLOP/s ({gemm / fma:.0%} of the peak)")
    if args.skip_engine:
        return
    if args.part in ("all", "context"):
        context_part(args.model, read)
    if args.part == "context":
        return

    from decode import ours_batch, ours_prefill, ours_single, prefill_prompts, prompt_ids

    from pyagent_framework.engine.loader import resolve_model

    path = resolve_model(args.model)
    weight_bytes, macs = weight_facts(args.model)
    flop_per_token = 2 * macs
    print(f"\nmodel: {weight_bytes / 1e6:.1f} MB of packed weights read per decode step, "
          f"{flop_per_token / 1e9:.3f} GFLOP per token")
    arms = [(f"{a} activations", {"activations": a}) for a in ("float32", "int16", "int8")]
    [ids] = prompt_ids(path, 1)
    prompts32 = prompt_ids(path, 32)
    prefill = prefill_prompts(path, 512, 4)
    rows = []
    for label, options in arms:
        single = ours_single(args.model, ids, 128, "gguf", 3, options)["decode_tok_per_s"]
        rows.append((f"single stream, {label}", single, weight_bytes * single, flop_per_token * single, options))
        batch = ours_batch(args.model, prompts32, 128, options)["tok_per_s"]
        rows.append((f"32 concurrent, {label}", batch, weight_bytes * batch / 32, flop_per_token * batch, options))
        rate = ours_prefill(args.model, prefill, options)["tok_per_s"]
        rows.append((f"prefill 512 tokens, {label}", rate, None, flop_per_token * rate, options))
    print("\n| work | tok/s | weight bytes/s | of read bandwidth | GFLOP/s (GOP/s) | of float32 peak | of int8 peak |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for label, rate, bytes_per_s, flops, options in rows:
        bw = f"{bytes_per_s / 1e9:.1f} GB/s | {bytes_per_s / 1e9 / read:.0%}" if bytes_per_s else "— | —"
        # int16 activations multiply each x as two int8 rows: twice the vpdpbusd work
        int8_products = {"float32": 0, "int16": 2, "int8": 1}[options["activations"]]
        of_dp = f"{int8_products * flops / 1e9 / dp:.0%}" if int8_products and dp else "—"
        print(f"| {label} | {rate:.1f} | {bw} | {flops / 1e9:.1f} | {flops / 1e9 / fma:.0%} | {of_dp} |")


if __name__ == "__main__":
    main()
