"""Generation throughput: this engine vs transformers generate() (and optionally
llama-cpp-python) on the same model and the same work, in one run.

    .venv/bin/python benchmarks/throughput.py                  # 64 chat prompts x 128 tokens
    .venv/bin/python benchmarks/throughput.py --mode single    # one stream, 128 tokens
    .venv/bin/python benchmarks/throughput.py --peer llama-cpp # adds llama-cpp-python on the GGUF
    python benchmarks/throughput.py --device cuda --dtype bfloat16 --hf-batch-size 64  # on a GPU

transformers runs before and after ours and counts as both runs together (total tokens
over total time). Greedy, ignore EOS, the same dtype for both engines unless
``--peer-dtype`` says otherwise (float32 by default; ours with the
float32 linears, `native` or `none`, even on the GGUF, whose default is its quantized
tensors: `benchmarks/decode.py` measures that path), both on ``--device``. Prints
output tokens per second for each and the ratio ours / peer. Model loading is not
timed; on a GPU each side is synchronized before its clock stops.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

TOPICS = [
    "the water cycle", "black holes", "the French revolution", "photosynthesis", "binary search",
    "the immune system", "plate tectonics", "compound interest", "the printing press", "volcanoes",
    "machine learning", "the Roman empire", "vaccines", "climate change", "the internet", "coral reefs",
]
TEMPLATES = [
    "Explain {} to a ten-year-old.",
    "Write a short paragraph about {}.",
    "What are three surprising facts about {}?",
    "Give a one-paragraph summary of {} and why it matters.",
]


def chat_prompts(n: int) -> list[list[dict]]:
    return [[{"role": "user", "content": TEMPLATES[i % len(TEMPLATES)].format(TOPICS[i % len(TOPICS)])}] for i in range(n)]


def run_ours(model: str | None, prompt_ids: list[list[int]], max_tokens: int, args) -> dict:
    from pyagent_framework import LLM, SamplingParams, registries

    unquantized = ("native", "none") if args.device == "cpu" and args.dtype == "float32" else ("none",)
    quantization = next(name for name in unquantized if name in registries.quantizers)
    llm = LLM(model, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              quantization=quantization, device=args.device, dtype=args.dtype,
              attention_backend=args.attention_backend)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompt_ids[:1], params.replace(max_tokens=4))  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompt_ids, params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    ttft = sorted(o.metrics.time_to_first_token for o in outputs)
    return {"engine": f"pyagent ({llm.engine.attention_backend} attention)", "seconds": elapsed, "output_tokens": tokens, "tok_per_s": tokens / elapsed,
            "ttft_p50_s": ttft[len(ttft) // 2]}


def load_transformers(path: str, device: str = "cpu", dtype: str = "float32"):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if path.endswith(".gguf"):
        kwargs = {"gguf_file": os.path.basename(path)}
        path = os.path.dirname(path)
    else:
        kwargs = {}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs)
    model = model.to(device=device, dtype=getattr(torch, dtype)).eval()
    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    return model, tokenizer


def run_transformers(path: str, prompt_ids: list[list[int]], max_tokens: int, batch_size: int, args) -> dict:
    dtype = args.peer_dtype or args.dtype
    model, tokenizer = load_transformers(path, args.device, dtype)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def batch(ids_list):
        width = max(map(len, ids_list))
        input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in ids_list], device=args.device)  # left padding
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in ids_list], device=args.device)
        with torch.no_grad():
            out = model.generate(input_ids, attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                 do_sample=False, pad_token_id=pad)
        return (out.shape[1] - width) * len(ids_list)  # .shape waits for nothing; the tokens are read below

    batch(prompt_ids[:1][:1])  # warm-up
    _synchronize(args.device)
    start = time.perf_counter()
    tokens = sum(batch(prompt_ids[i : i + batch_size]) for i in range(0, len(prompt_ids), batch_size))
    _synchronize(args.device)
    elapsed = time.perf_counter() - start
    return {"engine": f"transformers generate (batch {batch_size}, {dtype})", "seconds": elapsed,
            "output_tokens": tokens, "tok_per_s": tokens / elapsed}


def _synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_llama_cpp(path: str, prompt_ids: list[list[int]], max_tokens: int) -> dict:
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_ctx=2048, n_threads=torch.get_num_threads(), verbose=False)
    start = time.perf_counter()
    tokens = 0
    for ids in prompt_ids:  # llama-cpp-python serves one sequence at a time
        llm.reset()
        for n, _ in enumerate(llm.generate(ids, temp=0.0), start=1):
            if n >= max_tokens:
                break
        tokens += max_tokens
    elapsed = time.perf_counter() - start
    return {"engine": "llama-cpp-python (sequential)", "seconds": elapsed, "output_tokens": tokens, "tok_per_s": tokens / elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2 GGUF")
    parser.add_argument("--mode", choices=["batch", "single"], default="batch")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--peer", action="append", default=["transformers"], choices=["transformers", "llama-cpp"])
    parser.add_argument("--device", default="cpu", help="cpu or cuda (both engines)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--peer-dtype", default=None, choices=["float32", "bfloat16", "float16"],
                        help="transformers' dtype (default: --dtype's)")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from pyagent_framework.chat_templates import render_chat_template
    from pyagent_framework.engine.loader import resolve_model
    from pyagent_framework import registries

    path = resolve_model(args.model)
    tokenizer = registries.tokenizers.load("hf").from_pretrained(path)
    count = 1 if args.mode == "single" else args.num_prompts
    prompt_ids = [
        tokenizer.encode(render_chat_template(tokenizer.chat_template, c), add_special_tokens=False)
        for c in chat_prompts(count)
    ]
    hf_batch = 1 if args.mode == "single" else args.hf_batch_size

    # transformers runs before and after ours (the machine drifts over a run); its
    # figure is the mean of the two
    before = run_transformers(path, prompt_ids, args.max_tokens, hf_batch, args) if "transformers" in args.peer else None
    results = [run_ours(args.model, prompt_ids, args.max_tokens, args)]
    for peer in dict.fromkeys(args.peer):
        if peer == "transformers":
            after = run_transformers(path, prompt_ids, args.max_tokens, hf_batch, args)
            mean = 2 / (1 / before["tok_per_s"] + 1 / after["tok_per_s"])  # of the rates: total tokens / total time
            after.update(engine=after["engine"] + " (before, after)", seconds=before["seconds"] + after["seconds"],
                         output_tokens=before["output_tokens"] + after["output_tokens"], tok_per_s=mean,
                         rounds=[before["tok_per_s"], after["tok_per_s"]])
            results.append(after)
        elif peer == "llama-cpp":
            try:
                results.append(run_llama_cpp(path, prompt_ids, args.max_tokens))
            except ImportError:
                print("llama-cpp-python is not installed: skipping that peer")

    ours = results[0]["tok_per_s"]
    for r in results[1:]:
        r["ours_over_peer"] = ours / r["tok_per_s"]
    summary = {
        "model": os.path.basename(path), "mode": args.mode, "prompts": count, "max_tokens": args.max_tokens,
        "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(), "results": results,
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu", "dtype": args.dtype,
    }
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    print(f"{summary['model']}  mode={args.mode}  prompts={count}  max_tokens={args.max_tokens}  threads={summary['threads']}"
          f"  device={summary['device']}  dtype={args.dtype}")
    for r in results:
        ratio = f"   ours/peer = {r['ours_over_peer']:.2f}x" if "ours_over_peer" in r else ""
        if "rounds" in r:
            ratio += f"   ({' and '.join(f'{x:.1f}' for x in r['rounds'])} tok/s)"
        print(f"  {r['engine']:<45} {r['tok_per_s']:8.1f} tok/s  ({r['output_tokens']} tokens in {r['seconds']:.1f} s){ratio}")


if __name__ == "__main__":
    main()
