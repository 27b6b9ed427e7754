"""Mixture-of-experts decode: experts grouped by expert vs a per-token expert loop.

    .venv/bin/python benchmarks/moe.py
    .venv/bin/python benchmarks/moe.py --rounds 5 --max-tokens 64 --concurrent 1 32

A random Mixtral made on the spot (transformers' MixtralConfig, ``save_pretrained``;
by default hidden 512, 8 experts of 1,024, top-2, 4 layers, 8 heads) is decoded
greedily by this engine three times on the same weights:

- ``native``: the model as it runs by default (native attention backend): each MoE
  layer's experts in one call of the native core's grouped kernel
  (``_core.MoeExperts``: the step's (token, slot) pairs sorted by expert, every
  expert's rows in one thread-pool region, each expert's weight read once);
- ``grouped``: the block's own grouped torch path (``SparseMoeBlock.use_fused_experts``
  off): one ``gate_up``/``down`` product per expert over all its tokens;
- ``per-token``: the baseline defined here, the same routing and experts called once
  per (token, slot), one row at a time.

For 1 sequence, decode tok/s counts the tokens after the first over the time after the
first; for N concurrent sequences, output tok/s over the whole ``LLM.generate`` call
(prefill included). Each figure is the median of ``--rounds`` rounds; the ratios over
per-token are printed. All use torch's thread count; ``--quantization`` applies to all
(e.g. ``int8``: packed experts).
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def make_checkpoint(directory: Path, hidden: int, inter: int, experts: int, top_k: int, layers: int) -> str:
    from transformers import AutoModelForCausalLM, MixtralConfig

    from tests.tiny_models import VOCAB, save_tokenizer

    config = MixtralConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=4, num_local_experts=experts, num_experts_per_tok=top_k,
        max_position_embeddings=1024, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.5 if name.endswith("gate.weight") else 0.05)
    model.save_pretrained(directory, safe_serialization=True)
    save_tokenizer(directory)
    return str(directory)


def per_token_forward(self, x: torch.Tensor) -> torch.Tensor:
    """The baseline: the same router and experts as ``SparseMoeBlock.forward``, each
    expert called for one token at a time."""
    weights, experts = self.gate(x)
    out = torch.zeros_like(x)
    for t, (chosen, scale) in enumerate(zip(experts.tolist(), weights, strict=True)):
        for slot, e in enumerate(chosen):
            out[t : t + 1] += (self.experts[e](x[t : t + 1]) * scale[slot]).to(out.dtype)
    return out


@contextlib.contextmanager
def experts_path(path: str):
    """Run the block's experts by ``path``: "native", "grouped" or "per-token"."""
    from pyagent_hf.models.moe import SparseMoeBlock

    forward, fused = SparseMoeBlock.forward, SparseMoeBlock.use_fused_experts
    SparseMoeBlock.use_fused_experts = path == "native"
    if path == "per-token":
        SparseMoeBlock.forward = per_token_forward
    try:
        yield
    finally:
        SparseMoeBlock.forward, SparseMoeBlock.use_fused_experts = forward, fused


KINDS = ("native", "grouped", "per-token")


def measure(
    path: str, concurrent: int, max_tokens: int, rounds: int, quantization: str | None
) -> tuple[dict[str, float], dict[str, list[int]]]:
    """Per path, the median tok/s (see the module docstring) and the first sequence's
    tokens. One engine serves all three paths (the block's forward is switched between
    calls), and each round times them one after another, so the machine's drift falls
    on all three alike."""
    from pyagent_framework import LLM, SamplingParams

    rng = random.Random(concurrent)
    prompts = [[rng.randrange(2, 300) for _ in range(16)] for _ in range(concurrent)]
    llm = LLM(
        path, attention_backend="native", quantization=quantization, max_num_seqs=max(concurrent, 8),
        kv_cache_memory="256MiB", max_model_len=1024,
        engine_process=False,  # the paths are switched in this process's model
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    rates: dict[str, list[float]] = {kind: [] for kind in KINDS}
    tokens: dict[str, list[int]] = {}
    for kind in KINDS:  # warm-up
        with experts_path(kind):
            llm.generate(prompts, params.replace(max_tokens=4))
    for _ in range(rounds):
        for kind in KINDS:
            with experts_path(kind):
                start = time.perf_counter()
                outs = llm.generate(prompts, params)
                total = time.perf_counter() - start
            tokens[kind] = list(outs[0].outputs[0].token_ids)
            if concurrent == 1:
                rates[kind].append((len(tokens[kind]) - 1) / (total - outs[0].metrics.time_to_first_token))
            else:
                rates[kind].append(sum(len(o.outputs[0].token_ids) for o in outs) / total)
    return {kind: statistics.median(r) for kind, r in rates.items()}, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrent", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--quantization", default=None, help="e.g. int8 (default: the engine's choice, float32)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        path = make_checkpoint(Path(tmp), args.hidden, args.intermediate, args.experts, args.top_k, args.layers)
        print(
            f"random Mixtral: hidden {args.hidden}, {args.experts} experts of {args.intermediate}, top-{args.top_k}, "
            f"{args.layers} layers; {args.max_tokens} tokens per sequence; median of {args.rounds}; "
            f"{torch.get_num_threads()} threads; quantization {args.quantization or 'default'}"
        )
        for n in args.concurrent:
            rates, tokens = measure(path, n, args.max_tokens, args.rounds, args.quantization)
            same = "same tokens" if tokens["native"] == tokens["grouped"] == tokens["per-token"] else "TOKENS DIFFER"
            unit = "decode tok/s" if n == 1 else "output tok/s"
            base = rates["per-token"]
            print(
                f"{n:3d} sequences ({unit}): native {rates['native']:7.1f} ({rates['native'] / base:.2f}x)   "
                f"grouped {rates['grouped']:7.1f} ({rates['grouped'] / base:.2f}x)   per-token {base:7.1f}   ({same})"
            )


if __name__ == "__main__":
    main()
