"""Quantized decode: this engine vs llama-cpp-python on the same GGUF file, in one run.

    .venv/bin/python benchmarks/decode.py                 # all three parts
    .venv/bin/python benchmarks/decode.py --part single   # or: batch, prefill, memory

- ``single``: one stream, greedy, ``--max-tokens`` tokens after a chat prompt. Decode
  tok/s counts the tokens after the first over the time after the first (prefill and
  the first token excluded), for both engines. Ours runs once per ``--activations``:
  ``gguf`` with float32 activations (exact up to float rounding), int16 (x rounded to
  16 bits per block of 32 and multiplied in integers) and int8 (rounded to 8 bits, as
  llama.cpp does).
- ``batch``: ``--concurrent`` requests at once, each ``--max-tokens`` tokens. Ours: one
  ``LLM.generate`` call. llama.cpp: its batched decode through llama-cpp-python's
  low-level API (one ``llama_decode`` per step carrying every sequence's token, greedy
  by argmax over each sequence's logits), the way ``llama-batched-bench`` runs it.
  Output tok/s over the whole run, prefill included for both.
- ``prefill``: prompts of ``--prefill-tokens`` tokens (text from the shipped public-domain
  file, a different one each round so no prefix cache helps), each prefilled in one step;
  tokens/s = prompt tokens over the time to the first token (ours: ``generate`` with
  ``max_tokens=1``; llama.cpp: ``eval`` of the prompt with ``n_batch=512``). Ours with
  each ``--activations``; llama.cpp before and after ours; medians.
- ``memory``: each quantization loaded in a fresh process: bytes the model holds
  (parameters and buffers) and the process's resident-memory growth over the load.

Both engines use the same thread count (torch's, 2 on this machine). llama-cpp-python
is a benchmark-only peer: ``pip install llama-cpp-python`` (it compiles llama.cpp).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

QUESTION = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def prompt_ids(path: str, n: int) -> list[list[int]]:
    from pyagent_framework import registries
    from pyagent_framework.chat_templates import render_chat_template

    tokenizer = registries.tokenizers.load("hf").from_pretrained(path)
    topics = ["a lighthouse keeper", "a lost robot", "a city under the sea", "the last dragon", "a time traveller",
              "a talking cat", "a mountain village", "a desert caravan"]
    out = []
    for i in range(n):
        chat = [{"role": "user", "content": f"Write a short story about {topics[i % len(topics)]} (version {i})."}]
        out.append(tokenizer.encode(render_chat_template(tokenizer.chat_template, chat), add_special_tokens=False))
    return out


# ----------------------------------------------------------------------------- ours


def ours_single(model: str | None, ids: list[int], max_tokens: int, quantization: str | None, rounds: int,
                options: dict | None = None) -> dict:
    from pyagent_framework import LLM, SamplingParams

    llm = LLM(model, quantization=quantization, quantization_config=options, kv_cache_memory="256MiB",
              max_model_len=2048)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([ids], params.replace(max_tokens=8))  # warm-up
    rates, tokens = [], None
    for _ in range(rounds):
        start = time.perf_counter()
        [out] = llm.generate([ids], params)
        total = time.perf_counter() - start
        first = out.metrics.time_to_first_token
        tokens = list(out.outputs[0].token_ids)
        rates.append((len(tokens) - 1) / (total - first))
    label = llm.engine.quantization + (f" {json.dumps(options)}" if options else "")
    return {"engine": f"pyagent ({label})", "decode_tok_per_s": sorted(rates)[len(rates) // 2],
            "all": rates, "tokens": tokens}


def ours_batch(model: str | None, prompts: list[list[int]], max_tokens: int, options: dict | None = None) -> dict:
    from pyagent_framework import LLM, SamplingParams

    llm = LLM(model, max_num_seqs=max(64, len(prompts)), kv_cache_memory="512MiB", max_model_len=2048,
              quantization_config=options)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:1], params.replace(max_tokens=4))
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    label = llm.engine.quantization + (f" {json.dumps(options)}" if options else "")
    return {"engine": f"pyagent ({label}, {len(prompts)} concurrent)", "tok_per_s": tokens / elapsed,
            "seconds": elapsed, "tokens": tokens}


def prefill_prompts(path: str, tokens: int, n: int) -> list[list[int]]:
    """n prompts of `tokens` tokens: windows of the shipped text, each starting elsewhere."""
    from pathlib import Path

    from pyagent_framework import registries

    text = Path(__file__).resolve().parent.parent / "plugins/pyagent-quant/tests/data/public_domain.txt"
    ids = registries.tokenizers.load("hf").from_pretrained(path).encode(text.read_text())
    while len(ids) < tokens + n:
        ids = ids + ids
    return [ids[i : i + tokens] for i in range(n)]


def ours_prefill(model: str | None, prompts: list[list[int]], options: dict | None = None) -> dict:
    from pyagent_framework import LLM, SamplingParams

    llm = LLM(model, quantization_config=options, kv_cache_memory="256MiB", max_model_len=2048,
              max_num_batched_tokens=max(2048, len(prompts[0])), enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate(prompts[:1], params)  # warm-up
    rates = []
    for ids in prompts[1:]:
        start = time.perf_counter()
        llm.generate([ids], params)
        rates.append(len(ids) / (time.perf_counter() - start))
    label = llm.engine.quantization + (f" {json.dumps(options)}" if options else "")
    return {"engine": f"pyagent ({label})", "tok_per_s": sorted(rates)[len(rates) // 2], "all": rates}


# ----------------------------------------------------------------------------- llama.cpp


def _llama(path: str, n_ctx: int, n_seq: int = 1):
    from llama_cpp import Llama

    import torch

    return Llama(model_path=path, n_ctx=n_ctx, n_batch=512, n_threads=torch.get_num_threads(),
                 n_threads_batch=torch.get_num_threads(), n_seq_max=n_seq, verbose=False)


def llama_single(path: str, ids: list[int], max_tokens: int, rounds: int) -> dict:
    llm = _llama(path, 2048)
    rates, tokens = [], []
    for _ in range(rounds + 1):  # the first round warms up
        llm.reset()
        tokens = []
        first = None
        for token in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            if first is None:
                first = time.perf_counter()
            tokens.append(token)
            if len(tokens) >= max_tokens:
                break
        rates.append((len(tokens) - 1) / (time.perf_counter() - first))
    rates = rates[1:]
    return {"engine": "llama-cpp-python", "decode_tok_per_s": sorted(rates)[len(rates) // 2], "all": rates, "tokens": tokens}


def llama_prefill(path: str, prompts: list[list[int]]) -> dict:
    llm = _llama(path, 2048)
    rates = []
    for ids in prompts:  # the first warms up
        llm.reset()
        start = time.perf_counter()
        llm.eval(ids)
        rates.append(len(ids) / (time.perf_counter() - start))
    rates = rates[1:]
    return {"engine": "llama-cpp-python", "tok_per_s": sorted(rates)[len(rates) // 2], "all": rates}


def llama_batch(path: str, prompts: list[list[int]], max_tokens: int) -> dict:
    import llama_cpp
    import numpy as np
    import torch

    n = len(prompts)
    llm = _llama(path, 512)  # loads the model; the batched context is made below
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = sum(len(p) for p in prompts) + n * max_tokens + 64
    params.n_batch = params.n_ubatch = 512
    params.n_seq_max = n
    params.kv_unified = True  # one cache shared by the sequences, as llama-batched-bench -kvu
    params.n_threads = params.n_threads_batch = torch.get_num_threads()
    ctx = llama_cpp.llama_init_from_model(llm._model.model, params)
    if not ctx:
        raise RuntimeError("llama.cpp could not make a batched context")
    vocab = llm.n_vocab()
    batch = llama_cpp.llama_batch_init(max(512, n), 0, n)

    def decode(entries):  # entries: (token, position, seq, wants logits)
        for start in range(0, len(entries), 512):
            chunk = entries[start : start + 512]
            batch.n_tokens = len(chunk)
            for i, (token, pos, seq, logits) in enumerate(chunk):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
                batch.seq_id[i][0], batch.logits[i] = seq, logits
            if llama_cpp.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
        return len(entries)

    def next_tokens(count):
        logits = llama_cpp.llama_get_logits(ctx)
        return np.ctypeslib.as_array(logits, shape=(count, vocab)).argmax(axis=1).tolist()

    def run():
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
        # Prefill: every prompt; the logits of each prompt's last token are kept, in order.
        firsts = []
        for seq, ids in enumerate(prompts):
            decode([(t, p, seq, p == len(ids) - 1) for p, t in enumerate(ids)])
            firsts.append(next_tokens(1)[0])
        current, produced = firsts, n
        positions = [len(ids) for ids in prompts]
        for _ in range(max_tokens - 1):
            decode([(current[s], positions[s], s, True) for s in range(n)])
            current = next_tokens(n)
            positions = [p + 1 for p in positions]
            produced += n
        return produced

    run()  # warm-up on the same work, then the timed run
    start = time.perf_counter()
    tokens = run()
    elapsed = time.perf_counter() - start
    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_free(ctx)
    return {"engine": f"llama-cpp-python ({n} sequences, batched decode)", "tok_per_s": tokens / elapsed,
            "seconds": elapsed, "tokens": tokens}


# ----------------------------------------------------------------------------- memory

_MEMORY_CHILD = r"""
import json, sys
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
import torch
from pyagent_framework import LLM, SamplingParams
import pyagent_framework.engine.llm_engine  # imports done before the baseline
before = rss()
llm = LLM(sys.argv[1] or None, quantization=sys.argv[2] or None, kv_cache_memory="16MiB", max_model_len=256,
          engine_process=False)  # the model in this process, where its bytes and RSS can be read
llm.generate(["Hello"], SamplingParams(max_tokens=2))
model = llm.engine.core.model
held = {}
for t in list(model.parameters()) + list(model.buffers()):
    held[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
print(json.dumps({"quantization": llm.engine.quantization, "model_bytes": sum(held.values()), "rss_growth": rss() - before}))
"""


def memory(model: str | None, quantizations: list[str]) -> list[dict]:
    rows = []
    for q in quantizations:
        proc = subprocess.run([sys.executable, "-c", _MEMORY_CHILD, model or "", "" if q == "default" else q],
                              capture_output=True, text=True, check=True)
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return rows


# ----------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a GGUF file (default: the embedded SmolLM2 Q4_1 GGUF)")
    parser.add_argument("--part", action="append", choices=["single", "batch", "prefill", "memory"])
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrent", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3, help="single stream: timed rounds (median reported)")
    parser.add_argument("--quantization", action="append",
                        help="single stream: ours with these quantizations (default: gguf with each --activations)")
    parser.add_argument("--activations", action="append", choices=["float32", "int16", "int8"],
                        help="ours with these activations (default: float32, int16 and int8)")
    args = parser.parse_args()
    parts = args.part or ["single", "batch", "prefill", "memory"]
    options_arms = [{"activations": a} for a in args.activations or ["float32", "int16", "int8"]]

    import torch

    from pyagent_framework.engine.loader import resolve_model

    path = resolve_model(args.model)
    print(f"{os.path.basename(path)}  threads={torch.get_num_threads()}  cpu={platform.processor() or platform.machine()}")
    try:
        import llama_cpp  # noqa: F401

        have_llama = True
    except ImportError:
        have_llama = False
        print("llama-cpp-python is not installed (pip install llama-cpp-python): the peer is skipped")

    if "single" in parts:
        [ids] = prompt_ids(path, 1)
        # The machine drifts over a run: llama.cpp is timed before and after our arms,
        # and each ratio uses the median of all its rounds.
        peer = llama_single(path, ids, args.max_tokens, args.rounds) if have_llama else None
        arms = [(q, None) for q in args.quantization or []] or [("gguf", options) for options in options_arms]
        results = [ours_single(args.model, ids, args.max_tokens, q, args.rounds, options) for q, options in arms]
        if peer:
            after = llama_single(path, ids, args.max_tokens, args.rounds)
            peer["all"] += after["all"]
            peer["decode_tok_per_s"] = sorted(peer["all"])[len(peer["all"]) // 2]
        print(f"\nsingle stream, {args.max_tokens} tokens, decode tok/s (median of the rounds):")
        for ours in results:
            line = f"  {ours['engine']:<40} {ours['decode_tok_per_s']:7.1f}  ({', '.join(f'{r:.1f}' for r in ours['all'])})"
            if peer:
                same = next((i for i, (a, b) in enumerate(zip(ours["tokens"], peer["tokens"])) if a != b), len(ours["tokens"]))
                line += f"   ours/llama.cpp = {ours['decode_tok_per_s'] / peer['decode_tok_per_s']:.2f}x"
                line += f"   (same greedy tokens for the first {same})"
            print(line)
        if peer:
            print(f"  {peer['engine'] + ' (before and after)':<40} {peer['decode_tok_per_s']:7.1f}  "
                  f"({', '.join(f'{r:.1f}' for r in peer['all'])})")

    if "batch" in parts:
        prompts = prompt_ids(path, args.concurrent)
        print(f"\n{args.concurrent} concurrent requests x {args.max_tokens} tokens, output tok/s (prefill included):")
        # llama.cpp before and after ours; the ratio takes the mean of its two runs
        peers = [llama_batch(path, prompts, args.max_tokens)] if have_llama else []
        results = [ours_batch(args.model, prompts, args.max_tokens, options) for options in options_arms]
        if have_llama:
            peers.append(llama_batch(path, prompts, args.max_tokens))
        peer_rate = sum(p["tok_per_s"] for p in peers) / len(peers) if peers else None
        for ours in results:
            line = f"  {ours['engine']:<60} {ours['tok_per_s']:7.1f}  ({ours['tokens']} tokens in {ours['seconds']:.1f} s)"
            if peer_rate:
                line += f"   ours/llama.cpp = {ours['tok_per_s'] / peer_rate:.2f}x"
            print(line)
        for peer in peers:
            print(f"  {peer['engine']:<60} {peer['tok_per_s']:7.1f}  ({peer['tokens']} tokens in {peer['seconds']:.1f} s)")

    if "prefill" in parts:
        prompts = prefill_prompts(path, args.prefill_tokens, args.rounds + 1)
        print(f"\nprefill of a {args.prefill_tokens}-token prompt, tokens/s (median of {args.rounds} rounds):")
        before = llama_prefill(path, prompts) if have_llama else None
        results = [ours_prefill(args.model, prompts, options) for options in options_arms]
        peer_all = (before["all"] + llama_prefill(path, prompts)["all"]) if have_llama else []
        peer_rate = sorted(peer_all)[len(peer_all) // 2] if peer_all else None
        for ours in results:
            line = f"  {ours['engine']:<40} {ours['tok_per_s']:7.1f}  ({', '.join(f'{r:.0f}' for r in ours['all'])})"
            if peer_rate:
                line += f"   ours/llama.cpp = {ours['tok_per_s'] / peer_rate:.2f}x"
            print(line)
        if peer_rate:
            print(f"  {'llama-cpp-python (before and after)':<40} {peer_rate:7.1f}  ({', '.join(f'{r:.0f}' for r in peer_all)})")

    if "memory" in parts:
        rows = memory(args.model, ["none", "int8", "int4", "gguf"])
        base = rows[0]
        print("\nmemory after load (fresh process each; KV cache 16 MiB):")
        for r in rows:
            print(f"  {r['quantization']:<6} model {r['model_bytes'] / 2**20:7.1f} MiB ({r['model_bytes'] / base['model_bytes']:5.1%} of fp32)"
                  f"   resident growth {r['rss_growth'] / 2**20:7.1f} MiB ({r['rss_growth'] / base['rss_growth']:5.1%})")


if __name__ == "__main__":
    main()
