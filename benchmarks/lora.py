"""LoRA: what serving a batch that mixes three adapters costs against the base model
alone, in our engine and in transformers + PEFT (the peer), on SmolLM2-135M.

Three random PEFT adapters (rank ``--rank``, all seven projections) are made for the
base model and saved as safetensors. Each arm generates ``--batch`` sequences of
``--tokens`` tokens (greedy, ``ignore_eos``) from the same prompts:

- ours, no LoRA: an engine started without LoRA (``--enable-lora`` off), the batch;
- ours, base model: the LoRA engine, the batch with no adapter;
- ours, mixed: the same batch, requests spread round-robin over the three adapters;
- peer, base and mixed: ``PeftModel.generate`` with ``adapter_names`` per row
  (PEFT's mixed-batch inference), batch ``--peer-batch`` at a time.

Ours runs the embedded model as ``--ours`` says (``gguf``: the default packed GGUF
path; ``float32``: the float32 checkpoint the peer runs); the peer runs float32. The
arms alternate over ``--rounds`` rounds after a warm-up; the medians count. The
overhead is mixed time / base time - 1 for each engine; for ours it is given against
both the LoRA engine's base batch and the engine without LoRA.

    .venv/bin/python benchmarks/lora.py [--batch 32] [--tokens 64] [--rank 16] [--rounds 3]
        [--ours gguf|float32] [--peer-rounds 1] [--no-peer]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from machine_load import OtherLoad  # noqa: E402
from tests.lora_adapters import ALL_PROJECTIONS, make_adapter, smollm2_float32  # noqa: E402

TEXTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "Water boils at", "The best way to learn",
         "In 1969, the first", "SELECT name FROM", "A haiku about autumn:"]


def median_time(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ours", default="gguf", choices=["gguf", "float32"])
    ap.add_argument("--peer-batch", type=int, default=16)
    ap.add_argument("--peer-rounds", type=int, default=1, help="rounds of each peer arm, before and after ours")
    ap.add_argument("--no-peer", dest="peer", action="store_false")
    args = ap.parse_args()

    from pyagent_framework import LLM, SamplingParams

    root = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    base = smollm2_float32(root / "base")
    adapters = {name: make_adapter(base, root / name, ALL_PROJECTIONS, seed=100 + i, rank=args.rank, std=0.02)
                for i, name in enumerate(("a", "b", "c"))}
    names = ["a", "b", "c"]
    model = None if args.ours == "gguf" else base
    llm = LLM(model, enable_lora=True, max_loras=3, max_lora_rank=args.rank, lora_modules=adapters, engine_process=False,
              **({"dtype": "float32"} if model else {}))
    plain = LLM(model, engine_process=False, **({"dtype": "float32"} if model else {}))
    prompts = [llm.tokenizer.encode(TEXTS[i % len(TEXTS)]) for i in range(args.batch)]
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    mixed = [names[i % 3] for i in range(args.batch)]
    total = args.batch * args.tokens
    print(f"lora: SmolLM2-135M ({'embedded GGUF' if model is None else 'float32'}), {args.batch} sequences x "
          f"{args.tokens} tokens, 3 adapters of rank {args.rank}, threads={torch.get_num_threads()}, "
          f"loadavg {os.getloadavg()[0]:.2f}", flush=True)

    def ours_plain():
        plain.generate(prompts, params)

    def ours_base():
        llm.generate(prompts, params)

    def ours_mixed():
        llm.generate(prompts, params, lora_request=mixed)

    if args.peer:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(base)
        tokenizer.padding_side = "left"
        tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
        peer = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapters["a"], adapter_name="a")
        for name in ("b", "c"):
            peer.load_adapter(adapters[name], adapter_name=name)
        peer.eval()
        texts = [TEXTS[i % len(TEXTS)] for i in range(args.batch)]

        def peer_run(adapter_names):
            with torch.no_grad():
                for start in range(0, args.batch, args.peer_batch):
                    chunk = tokenizer(texts[start : start + args.peer_batch], return_tensors="pt", padding=True)
                    kwargs = {"adapter_names": adapter_names[start : start + args.peer_batch]}
                    peer.generate(**chunk, max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False,
                                  pad_token_id=tokenizer.pad_token_id, **kwargs)

        def peer_base():
            peer_run(["__base__"] * args.batch)

        def peer_mixed():
            peer_run(mixed)

    ours = {"ours no LoRA": ours_plain, "ours base": ours_base, "ours mixed": ours_mixed}
    peer_arms = {"peer base": peer_base, "peer mixed": peer_mixed} if args.peer else {}
    ours_plain(), ours_base(), ours_mixed()  # warm-up
    load = OtherLoad().start()
    times: dict[str, float] = {}

    def report_arm(label: str, seconds: float) -> None:
        times[label] = seconds
        print(f"  {label:20s} {seconds:8.2f} s  {total / seconds:8.1f} tok/s", flush=True)

    for label, fn in peer_arms.items():
        report_arm(label, median_time(fn, args.peer_rounds))
    # Ours round-robin (one round of each arm, then the next): drift on a shared
    # machine falls on every arm alike.
    samples: dict[str, list[float]] = {label: [] for label in ours}
    for _ in range(args.rounds):
        for label, fn in ours.items():
            samples[label].append(median_time(fn, 1))
    for label, values in samples.items():
        report_arm(label, statistics.median(values))
    for label, fn in peer_arms.items():
        report_arm(f"{label} (after)", median_time(fn, args.peer_rounds))
    report = load.report()
    ours_overhead = times["ours mixed"] / times["ours base"] - 1
    print(f"  ours: 3-adapter mixed batch costs {ours_overhead:+.1%} against the base model alone on the LoRA engine, "
          f"{times['ours mixed'] / times['ours no LoRA'] - 1:+.1%} against the engine without LoRA")
    if args.peer:
        peer_base_t = (times["peer base"] + times["peer base (after)"]) / 2
        peer_mixed_t = (times["peer mixed"] + times["peer mixed (after)"]) / 2
        print(f"  peer: 3-adapter mixed batch costs {peer_mixed_t / peer_base_t - 1:+.1%} against the base model alone")
        print(f"  ratio (ours / peer, mixed batch tok/s): {peer_mixed_t / times['ours mixed']:.2f}x")
    share = report["other_cpu_share"]
    print(f"  other processes used {'?' if share is None else f'{share:.0%}'} of the CPU; loadavg "
          f"{report['loadavg_start'][0]:.2f} -> {report['loadavg_end'][0]:.2f}", flush=True)
    llm.close()
    plain.close()


if __name__ == "__main__":
    main()
