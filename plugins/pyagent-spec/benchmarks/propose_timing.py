"""Per-call timings of the proposers (not a test): the numbers in the README.

    .venv/bin/python plugins/pyagent-spec/benchmarks/propose_timing.py
"""
import itertools, random, statistics, time, tracemalloc, gc
from pyagent_framework.types import DraftRequest as R
from pyagent_spec.ngram import NgramProposer
from pyagent_spec.suffix import SuffixProposer

rng = random.Random(0)
V = 32000
CUM = list(itertools.accumulate(1.0 / (i + 1) for i in range(V)))  # Zipf-ish unigrams

def zipf(n):
    return rng.choices(range(V), cum_weights=CUM, k=n)

def text(n, copy_rate=0.0, src=None):
    out = []
    while len(out) < n:
        if copy_rate and rng.random() < copy_rate:
            pool = src if src is not None and rng.random() < 0.5 else out
            if len(pool) > 20:
                s = rng.randrange(len(pool) - 20)
                out.extend(pool[s:s + rng.randrange(5, 20)])
                continue
        out.extend(zipf(rng.randrange(1, 10)))
    return out[:n]

def decode(proposer, prompt, gen, mt, seq_id=1):
    """One token appended a step, a propose each step: per-call times (us) and mean draft."""
    seq = list(prompt)
    proposer.propose([R(seq_id, seq, len(prompt), mt)])  # first call packs the prompt
    ts, drafted = [], 0
    for tok in gen:
        seq.append(tok)
        r = [R(seq_id, seq, len(prompt), mt)]
        t0 = time.perf_counter()
        d = proposer.propose(r)
        ts.append((time.perf_counter() - t0) * 1e6)
        drafted += len(d[0].tokens)
    return ts, drafted / len(gen)

def first_call(proposer, seq, mt):
    t0 = time.perf_counter()
    proposer.propose([R(99, seq, len(seq) - 1, mt)])
    return (time.perf_counter() - t0) * 1e6

gc.disable()
print("single sequence, prompt 4000 tokens, 500 decode steps (us per propose call: mean / median / p99 / max)")
cases = [
    ("zipf text (few matches)", text(4000), text(500)),
    ("copy-heavy (30% copied spans)", text(4000, 0.3), None),
    ("periodic (period 50)", list(range(50)) * 80, list(range(50)) * 10),
    ("8-symbol alphabet", [rng.randrange(8) for _ in range(4000)], [rng.randrange(8) for _ in range(500)]),
]
for label, prompt, gen in cases:
    if gen is None:
        gen = text(500, 0.3, src=prompt)
    for name, mk, mt in [("ngram", lambda: NgramProposer({}), 5), ("suffix", lambda: SuffixProposer({}), 8)]:
        ts, avg = decode(mk(), prompt, gen, mt)
        ts.sort()
        fc = first_call(mk(), prompt + gen, mt)
        print(f"  {label:31s} {name:6s} {statistics.mean(ts):6.1f} / {statistics.median(ts):6.1f} / {ts[int(len(ts)*.99)]:6.1f} / {ts[-1]:6.1f}"
              f"   mean draft {avg:.2f}   first call (packs 4500 tokens) {fc:6.0f}")

print()
sp = SuffixProposer({})
outs = [text(1000, 0.2) for _ in range(20)]
ts = []
for i in range(300):
    o = outs[i % 20] if i % 2 else text(1000, 0.2)
    t0 = time.perf_counter()
    sp.request_finished(1000 + i, [5] * 10 + o, 10)
    ts.append((time.perf_counter() - t0) * 1e6)
print(f"suffix request_finished, 1000-token outputs (300, evicting past 256): median {statistics.median(ts):.0f} us, first {ts[0]:.0f} us, max {max(ts):.0f} us")
print("  stats", sp.stats())
prompt = text(4000, 0.1)
for label, gen in [("an output seen before being regenerated", outs[3][:500]), ("a novel output", text(500, 0.2))]:
    ts, avg = decode(sp, prompt, gen, 8, seq_id=5)
    ts.sort()
    print(f"  suffix, 256 cached outputs, {label:40s} {statistics.mean(ts):6.1f} / {statistics.median(ts):6.1f} / {ts[int(len(ts)*.99)]:6.1f} us  mean draft {avg:.2f}")
# Adversarial: a bigram that occurs ~100k times in the cache, pattern ending with it.
adv = SuffixProposer({})
for i in range(256):
    adv.request_finished(i, [7] + [0, 1] * 500, 1)
seq = text(4000) + [0, 1]
ts = []
for i in range(200):
    seq = seq + [rng.randrange(2, V), 0, 1]
    t0 = time.perf_counter(); adv.propose([R(1, seq, 100, 8)]); ts.append((time.perf_counter() - t0) * 1e6)
print(f"  suffix, adversarial (key in every cached position): median {statistics.median(ts):.1f} us, max {max(ts):.1f} us")

# memory of the global index
gc.enable()
tracemalloc.start()
mem = SuffixProposer({})
for i in range(256):
    mem.request_finished(i, [1] + text(1024, 0.2), 1)
cur, _ = tracemalloc.get_traced_memory(); tracemalloc.stop()
st = mem.stats()
print(f"global index memory (tracemalloc): {cur/2**20:.1f} MiB for {st['cached_tokens']} tokens in {st['cached_outputs']} outputs"
      f" ({(cur - 2*8*st['buckets']//2)/st['cached_tokens']:.1f} B/token besides the 2 x {8*st['buckets']//2/2**20:.0f} MiB bucket tables)")
gc.disable()
print()
for p in (NgramProposer({}), SuffixProposer({})):
    seqs = [text(4000, 0.2) for _ in range(64)]
    reqs = [R(i, s, 3000, 5) for i, s in enumerate(seqs)]
    p.propose(reqs)
    t = 0
    for step in range(50):
        for s in seqs:
            s.append(rng.randrange(V))
        t0 = time.perf_counter(); p.propose(reqs); t += time.perf_counter() - t0
    print(f"{type(p).__name__}: batch of 64 sequences x ~4000 tokens: {t/50*1e6:.0f} us/step = {t/50/64*1e6:.1f} us/sequence")
