"""Structured outputs: what a grammar costs per token for each registered grammar
backend, and decode throughput constrained against unconstrained, in one run.

    .venv/bin/python benchmarks/structured.py                         # everything, ~5 min on 2 idle cores
    .venv/bin/python benchmarks/structured.py --backends xgrammar     # one backend
    .venv/bin/python benchmarks/structured.py --batch 1 --batch 32 --max-tokens 256 --repeats 5
    .venv/bin/python benchmarks/structured.py --skip-masks            # only the decode comparison

(1) Masks, on the embedded SmolLM2 tokenizer (49,152 ids) without the model. For each
    backend and each spec (a nested JSON schema with objects, an array of objects,
    enums, a pattern, strings, numbers and a boolean; ``json_object``; a regex; a
    24-way choice), the spec is compiled once (cold: the engine's own grammar cache is
    not involved; the backend's per-vocabulary set-up is done beforehand and reported
    on its own line), then a valid instance is tokenized as the tokenizer would write
    it, end-of-sequence appended, and replayed token by token through a fresh matcher
    ``--walks`` times (more for short instances, so each figure has at least 1,000
    tokens): ``fill_bitmask`` before each token and ``accept_tokens`` after it are
    timed one call at a time (median and p99 over all tokens of all walks, in
    microseconds). Each token is checked against the mask it was given, so a backend
    that refuses the instance is reported, not timed. Then, per ``--batch`` size and
    at 64 (the engine's default ``max_num_seqs``): the engine's ``apply_token_bitmask``
    on a ``[batch, 49152]`` float32 logits tensor, next to xgrammar's own CPU kernel
    (``xgrammar.apply_token_bitmask_inplace``, same result) as the peer; and the
    engine's whole mask step (``StructuredOutputManager.apply_masks``: one
    ``fill_bitmask`` per row into a fresh bitmask, then the batched apply), with the
    rows' matchers at staggered positions of the nested-schema instance.

(2) Decode, with ``LLM()`` (the embedded SmolLM2) called from this process's main
    thread for every arm. Per ``--batch`` size the same chat prompts (ask for customer
    records as JSON) run unconstrained and with ``structured_outputs={"json": schema,
    "backend": name}`` for each backend; greedy, ``ignore_eos``, ``max_tokens``
    ``--max-tokens``. The schema asks for an object holding an array of records with
    ``minItems`` large enough that no valid output fits in ``--max-tokens`` tokens, so
    the grammar can never end a sequence early and every arm generates exactly
    batch x max_tokens tokens (checked: each output must end with finish reason
    ``length``). Measured: tok/s = generated tokens / wall time of ``LLM.generate``
    (the short prompts' prefill included, the same in every arm), and the decode step
    time = (last finish - last first token) / (max_tokens - 1). Before timing, each arm
    runs once with 8 tokens (grammar compiled and cached, prefixes cached, model warm);
    then ``--repeats`` rounds, each running every arm once in a rotated order; medians
    are reported, and constrained / unconstrained with the slowdown 1 - ratio.
    The engine core runs in this process (``engine_process=False``) so that during
    the timed rounds its step phases can be timed by wrapping its bound methods on
    the instance (model forward, the mask step, sampling, the per-token update that
    includes ``accept_tokens``); the wrappers cost ~1 us a call and are
    the same in every arm. ``--xgrammar-kernel-arm`` adds a diagnostic arm: xgrammar
    with the engine's ``apply_token_bitmask`` swapped, in this process only, for
    xgrammar's own CPU kernel, which runs no OpenMP region (see docs/benchmarks.md).

(3) Coverage (``--coverage``), on the stored sample of 256 real-world schemas
    (``tests/data/jsonschemabench``, JSONSchemaBench, MIT). A schema the engine's own
    request checks refuse (its metaschema, a pattern whose matching cost cannot be
    bounded) is counted apart, as a request would meet that refusal before any
    backend. Each other schema is compiled
    through the engine's ``StructuredOutputManager`` (worker processes, the default
    10 s compile timeout, the SmolLM2 vocabulary) by each backend and by ``auto``:
    once as the engine asks (``checked_after``: keywords a grammar cannot express
    are left to the check after generation) and once exactly (``checked_after``
    off: such keywords refused). Counted: compiled / refused / invalid (the backend
    called the schema wrong) / timed out, and the compile time of what compiled
    (p50 / p99). Then (``--coverage-generate``) every schema ``auto`` compiled is
    generated with ``LLM()`` (the embedded SmolLM2, sampled at temperature 0.7 with
    frequency penalty 1.0, which keeps the small model from repeating itself inside
    a string until the limit, seed 0, ``max_tokens`` ``--coverage-max-tokens``), asked in a chat message for a JSON
    value of the schema (its text cut to 1,500 characters). Each output is
    validated here with ``jsonschema`` (the format checker on): valid / failed by the
    engine's check after generation (the grammar admitted it; the request ended in an
    error naming the keyword) / delivered invalid (must be 0) / cut by
    ``max_tokens`` (finish reason ``length``; not JSON yet).

The machine's load average (``os.getloadavg``) and the share of the CPU that other
processes used during each phase are printed: on a small machine figures taken while
other work runs are skewed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from functools import wraps

import torch
from machine_load import OtherLoad, percentile  # benchmarks/, the script's own folder

VOCAB_SIZE = 49152
SLOWDOWN_GOAL = 0.10
WARMUP_TOKENS = 8
XGRAMMAR_KERNEL_ARM = "xgrammar+xgr-apply"
MIN_SAMPLES = 1000  # per-token timings per (backend, spec): short instances are replayed more often

# ---------------------------------------------------------------------- specs for (1)

ORDER_SCHEMA = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "ORD-[0-9]{6}"},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "email": {"type": "string"},
                "tier": {"enum": ["free", "pro", "enterprise"]},
            },
            "required": ["name", "email", "tier"],
        },
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "description": {"type": "string"},
                    "quantity": {"type": "integer"},
                    "unit_price": {"type": "number"},
                },
                "required": ["sku", "description", "quantity", "unit_price"],
            },
        },
        "status": {"enum": ["pending", "shipped", "delivered", "cancelled"]},
        "gift": {"type": "boolean"},
        "notes": {"type": "string"},
    },
    "required": ["order_id", "customer", "items", "status", "gift", "notes"],
}
ORDER_INSTANCE = {
    "order_id": "ORD-204817",
    "customer": {"name": "Margaret Okafor", "email": "m.okafor@example.com", "tier": "pro"},
    "items": [
        {"sku": "BTL-750-SS", "description": "Stainless steel water bottle, 750 ml, keeps drinks cold for 24 hours",
         "quantity": 2, "unit_price": 24.5},
        {"sku": "BAG-TRAIL-30", "description": "Trail backpack with 30 litre capacity and a rain cover",
         "quantity": 1, "unit_price": 89.99},
        {"sku": "SCK-MER-L", "description": "Merino hiking socks, size L, pack of three", "quantity": 3,
         "unit_price": 12.0},
    ],
    "status": "shipped",
    "gift": False,
    "notes": "Please leave the parcel at the back door if nobody answers the bell.",
}
OBJECT_INSTANCE = {
    "title": "Weekly report",
    "week": 37,
    "highlights": ["Shipped the new search page", "Fixed two checkout bugs", "Hired a support engineer"],
    "metrics": {"visitors": 15234, "conversion": 0.031, "refunds": [12, 7, 9]},
    "owner": {"name": "Lena", "on_call": True},
    "next_steps": None,
}
CONTACT_REGEX = (
    r"[A-Z][a-z]+ [A-Z][a-z]+, (18|19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01]), "
    r"[a-z0-9._]{1,32}@[a-z0-9]{1,24}\.(com|org|net)"
)
CONTACT_INSTANCE = "Ada Lovelace, 1815-12-10, ada.lovelace@example.org"
COUNTRIES = [
    "Argentina", "Australia", "Brazil", "Canada", "Chile", "China", "Egypt", "France", "Germany", "India",
    "Indonesia", "Italy", "Japan", "Kenya", "Mexico", "Morocco", "Nigeria", "Norway", "Peru", "Poland",
    "South Africa", "South Korea", "Spain", "United Kingdom",
]


def as_written(value) -> str:
    """JSON with ", " and ": " separators: xgrammar's grammar for a schema without
    ``any_whitespace`` admits exactly these (compact ``","``/``":"`` is refused), and
    outlines' admits them too."""
    return json.dumps(value, ensure_ascii=False)


def mask_specs() -> list[tuple[str, dict, str]]:
    """(label, StructuredOutputsParams keys, a valid output as the model would write it)."""
    return [
        ("json schema, nested", {"json": ORDER_SCHEMA}, as_written(ORDER_INSTANCE)),
        ("json_object", {"json_object": True}, as_written(OBJECT_INSTANCE)),
        ("regex", {"regex": CONTACT_REGEX}, CONTACT_INSTANCE),
        ("choice, 24 strings", {"choice": COUNTRIES}, "South Korea"),
    ]


# ---------------------------------------------------------------------- schema for (2)

RECORD = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "name": {"type": "string"},
        "email": {"type": "string"},
        "status": {"enum": ["active", "inactive", "pending"]},
    },
    "required": ["id", "name", "email", "status"],
}
# The shortest record, as tokens the tokenizer would write; no tokenization of it is
# much shorter, since each key is spelled out between its quotes.
SHORTEST_RECORD = '{"id": 0, "name": "", "email": "", "status": "active"}'


def decode_schema(min_items: int) -> dict:
    return {
        "type": "object",
        "properties": {"records": {"type": "array", "items": RECORD, "minItems": min_items}},
        "required": ["records"],
    }


def decode_prompts(count: int) -> list[list[dict]]:
    shops = ["bicycle", "book", "coffee", "garden", "music", "pet", "toy", "shoe", "bakery", "camera", "tea",
             "flower", "hardware", "sports", "wine", "computer"]
    return [[{"role": "user", "content": f"List the customers of a {shops[i % len(shops)]} shop (#{i}) as JSON: "
              "an object whose records array holds each customer's id, name, email and status."}]
            for i in range(count)]


# ---------------------------------------------------------------------- helpers


def describe_load(phase: str, load: dict) -> str:
    a, b = load["loadavg_start"], load["loadavg_end"]
    text = f"  load during {phase}: loadavg {a[0]:.2f} -> {b[0]:.2f} (1 min)"
    if load["other_cpu_share"] is not None:
        text += f", other processes used {load['other_cpu_share'] * 100:.0f}% of the CPU"
        if load["other_cpu_share"] > 0.05:
            text += "  <- skewed: rerun on an idle machine"
    return text


def mask_allows(bitmask: torch.Tensor, row: int, token: int) -> bool:
    return (int(bitmask[row, token >> 5]) >> (token & 31)) & 1 == 1


def time_calls(fn, iterations: int) -> list[float]:
    out = []
    for _ in range(iterations):
        start = time.perf_counter_ns()
        fn()
        out.append((time.perf_counter_ns() - start) / 1e3)
    return out


# ---------------------------------------------------------------------- (1) masks


def walk(backend, compiled, tokens: list[int], bitmask: torch.Tensor, fill_us: list, accept_us: list) -> str | None:
    """Replay ``tokens`` through a fresh matcher, timing each call; an error text if
    the backend refuses a token of the valid instance."""
    matcher = backend.matcher(compiled)
    for position, token in enumerate(tokens):
        start = time.perf_counter_ns()
        matcher.fill_bitmask(bitmask, 0)
        middle = time.perf_counter_ns()
        if not mask_allows(bitmask, 0, token):
            return f"its mask refuses token {position} ({token}) of the valid instance"
        ok = matcher.accept_tokens([token])
        end = time.perf_counter_ns()
        if not ok:
            return f"it refuses token {position} ({token}) of the valid instance"
        fill_us.append((middle - start) / 1e3)
        accept_us.append((end - middle) / 1e3)
    if not matcher.is_terminated():
        return "it is not terminated after the instance and end-of-sequence"
    return None


def bench_masks(backend_names: list[str], batches: list[int], walks: int) -> dict:
    from pyagent_framework import registries
    from pyagent_framework.engine import loader
    from pyagent_framework.engine.params import StructuredOutputsParams
    from pyagent_framework.engine.structured import StructuredOutputManager, tokenizer_info
    from pyagent_framework.interfaces import apply_token_bitmask, bitmask_words
    from pyagent_framework.types import GrammarSpec

    path = loader.resolve_model("smollm2")
    tok = registries.tokenizers.load("hf").from_pretrained(path)
    start = time.perf_counter()
    info = tokenizer_info(tok, VOCAB_SIZE)
    info_ms = (time.perf_counter() - start) * 1e3
    eos = min(info.eos_token_ids)
    specs = [(label, StructuredOutputsParams(**keys).spec(), text) for label, keys, text in mask_specs()]
    tokenized = {label: tok.encode(text, add_special_tokens=False) + [eos] for label, _, text in specs}
    words = bitmask_words(VOCAB_SIZE)
    batches = sorted(set(batches) | {64})  # 64: the engine's default max_num_seqs
    result = {"tokenizer_info_ms": info_ms, "vocab_size": info.vocab_size, "backends": {}, "apply": []}

    for name in backend_names:
        entry = result["backends"][name] = {"specs": []}
        try:
            backend = registries.grammar_backends.load(name)()
            start = time.perf_counter()  # per-vocabulary set-up (xgrammar's TokenizerInfo, outlines' Vocabulary)
            backend.compile(GrammarSpec("choice", ("yes", "no")), info)
            entry["setup_ms"] = (time.perf_counter() - start) * 1e3
        except Exception as exc:  # a backend that is not ready must not stop the others
            entry["error"] = f"{type(exc).__name__}: {exc}"
            print(f"  {name}: cannot be used ({entry['error']})", flush=True)
            continue
        compiled_schema = None
        for label, spec, _ in specs:
            row = {"spec": label, "tokens": len(tokenized[label])}
            entry["specs"].append(row)
            if spec.kind not in backend.supported_kinds:
                row["refused"] = f"does not handle {spec.kind!r} specs"
                continue
            start = time.perf_counter()
            try:
                compiled = backend.compile(spec, info)
            except (NotImplementedError, ValueError) as exc:
                row["refused"] = f"{type(exc).__name__}: {exc}"
                continue
            row["compile_ms"] = (time.perf_counter() - start) * 1e3
            bitmask = torch.full((1, words), -1, dtype=torch.int32)
            fill_us, accept_us = [], []
            error = None
            for _ in range(max(walks, -(-MIN_SAMPLES // len(tokenized[label])))):
                error = walk(backend, compiled, tokenized[label], bitmask, fill_us, accept_us)
                if error:
                    row["refused"] = error
                    break
            if error is None:
                row.update(fill_p50_us=percentile(fill_us, 50), fill_p99_us=percentile(fill_us, 99),
                           fill_max_us=max(fill_us), accept_p50_us=percentile(accept_us, 50),
                           accept_p99_us=percentile(accept_us, 99), samples=len(fill_us))
                if spec.kind == "json_schema":
                    compiled_schema = compiled
            print(f"  {name:<9} {label:<20} " + (f"refused: {row['refused']}" if "refused" in row else
                  f"compiled in {row['compile_ms']:.1f} ms, fill p50 {row['fill_p50_us']:.1f} us"), flush=True)

        # The engine's whole mask step at each batch size, rows at staggered states.
        entry["step"] = []
        if compiled_schema is not None:
            manager = StructuredOutputManager(tok, VOCAB_SIZE)
            tokens = tokenized["json schema, nested"][:-1]
            for batch in batches:
                matchers = []
                for i in range(batch):
                    matcher = backend.matcher(compiled_schema)
                    matcher.accept_tokens(tokens[: (i * 7) % len(tokens)])
                    matchers.append(matcher)
                logits = torch.randn(batch, VOCAB_SIZE)
                manager.apply_masks(logits, matchers)
                us = time_calls(lambda: manager.apply_masks(logits, matchers), 200 if batch <= 16 else 50)
                entry["step"].append({"batch": batch, "p50_us": percentile(us, 50), "p99_us": percentile(us, 99)})

    for batch in batches:
        logits = torch.randn(batch, VOCAB_SIZE)
        bitmask = torch.randint(-(2**31), 2**31 - 1, (batch, words), dtype=torch.int32)
        apply_token_bitmask(logits, bitmask)
        us = time_calls(lambda: apply_token_bitmask(logits, bitmask), 200 if batch <= 16 else 50)
        row = {"batch": batch, "p50_us": percentile(us, 50), "p99_us": percentile(us, 99)}
        try:
            import xgrammar
        except ImportError:
            pass
        else:
            expected, logits = logits, torch.randn(batch, VOCAB_SIZE)
            xgrammar.apply_token_bitmask_inplace(logits, bitmask)
            assert torch.equal(torch.isinf(logits), torch.isinf(expected))
            us = time_calls(lambda: xgrammar.apply_token_bitmask_inplace(logits, bitmask), 200 if batch <= 16 else 50)
            row.update(xgrammar_kernel_p50_us=percentile(us, 50), xgrammar_kernel_p99_us=percentile(us, 99))
        result["apply"].append(row)
    return result


def print_masks(result: dict) -> None:
    print(f"  tokenizer_info for {result['vocab_size']} ids: {result['tokenizer_info_ms']:.0f} ms")
    print(f"  {'backend':<9} {'spec':<20} {'tokens':>6} {'compile':>10} {'fill p50':>9} {'fill p99':>9} "
          f"{'accept p50':>10} {'accept p99':>10}   (per token, us)")
    for name, entry in result["backends"].items():
        if "error" in entry:
            print(f"  {name:<9} not usable: {entry['error']}")
            continue
        print(f"  {name:<9} {'(vocabulary set-up)':<20} {'':>6} {entry['setup_ms']:8.0f}ms")
        for row in entry["specs"]:
            if "refused" in row:
                print(f"  {name:<9} {row['spec']:<20} {row['tokens']:>6}   refused: {row['refused']}")
                continue
            print(f"  {name:<9} {row['spec']:<20} {row['tokens']:>6} {row['compile_ms']:8.1f}ms {row['fill_p50_us']:9.1f} "
                  f"{row['fill_p99_us']:9.1f} {row['accept_p50_us']:10.1f} {row['accept_p99_us']:10.1f}")
    print("  masking [batch, 49152] float32 logits, us p50 / p99: the engine's apply_token_bitmask, xgrammar's "
          "kernel (peer), the engine's whole mask step (apply_masks: a fill per row + the apply; nested schema):")
    for i, applied in enumerate(result["apply"]):
        parts = [f"apply_token_bitmask {applied['p50_us']:.0f} / {applied['p99_us']:.0f}"]
        if "xgrammar_kernel_p50_us" in applied:
            parts.append(f"peer xgrammar.apply_token_bitmask_inplace {applied['xgrammar_kernel_p50_us']:.0f} / "
                         f"{applied['xgrammar_kernel_p99_us']:.0f}")
        for name, entry in result["backends"].items():
            steps = entry.get("step") or []
            if i < len(steps):
                parts.append(f"{name} step {steps[i]['p50_us']:.0f} / {steps[i]['p99_us']:.0f}")
        print(f"    batch {applied['batch']:>3}: " + ";  ".join(parts))


# ---------------------------------------------------------------------- (2) decode


class PhaseTimer:
    """Wraps bound methods of one engine core (run in this process) and sums the time
    spent in each."""

    def __init__(self, core) -> None:
        self.totals: dict[str, float] = {}
        self.steps = 0
        for label, owner, attr in [
            ("forward", core.runner, "execute"),
            ("masks", core.grammar, "apply_masks"),
            ("sample", core.step_sampler, "sample"),
            ("append", core.updater, "update"),
            ("step", core, "step"),
        ]:
            setattr(owner, attr, self._wrap(label, getattr(owner, attr)))

    def _wrap(self, label: str, fn):
        self.totals[label] = 0.0

        @wraps(fn)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.totals[label] += time.perf_counter() - start
                if label == "step":
                    self.steps += 1

        return timed

    def reset(self) -> None:
        self.totals = dict.fromkeys(self.totals, 0.0)
        self.steps = 0

    def per_step_ms(self) -> dict:
        steps = max(self.steps, 1)
        out = {k: v / steps * 1e3 for k, v in self.totals.items()}
        out["other"] = out["step"] - sum(out[k] for k in ("forward", "masks", "sample", "append"))
        return out


def use_mask_kernel(arm: str) -> None:
    """For the ``--xgrammar-kernel-arm`` diagnostic: the engine's mask step (the plain
    ``LayerOps``) calls the module-level ``interfaces.grammar.apply_token_bitmask``; that
    arm swaps in xgrammar's CPU kernel (same result, no OpenMP region), every other arm
    runs the engine's own."""
    from pyagent_framework.interfaces import grammar

    if not hasattr(use_mask_kernel, "engine_kernel"):
        use_mask_kernel.engine_kernel = grammar.apply_token_bitmask
    if arm == XGRAMMAR_KERNEL_ARM:
        import xgrammar

        grammar.apply_token_bitmask = lambda logits, bitmask: xgrammar.apply_token_bitmask_inplace(logits, bitmask)
    else:
        grammar.apply_token_bitmask = use_mask_kernel.engine_kernel


def bench_decode(backend_names: list[str], batches: list[int], max_tokens: int, repeats: int, model: str | None,
                 kernel_arm: bool = False) -> dict:
    from pyagent_framework import LLM, SamplingParams
    from pyagent_framework.engine.errors import InvalidRequestError

    from pyagent_framework import registries
    from pyagent_framework.engine import loader

    tok = registries.tokenizers.load("hf").from_pretrained(loader.resolve_model(model))
    # No valid output fits in max_tokens: each record takes at least this many tokens.
    record_tokens = len(tok.encode(SHORTEST_RECORD, add_special_tokens=False))
    min_items = max_tokens // max(record_tokens // 2, 1) + 1
    schema = decode_schema(min_items)
    # The core runs in this process so that its phases can be timed (the same in every arm).
    llm = LLM(model, max_num_seqs=max(batches), grammar_compile_timeout=600.0, engine_process=False)
    timer = PhaseTimer(llm.engine.core)
    base = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    arms = {"unconstrained": base}
    refused = {}
    for name in backend_names:
        params = base.replace(structured_outputs={"json": schema, "backend": name})
        start = time.perf_counter()
        try:
            llm.generate([[1, 2, 3]], params.replace(max_tokens=2))  # compiles into the engine's cache
        except InvalidRequestError as exc:
            refused[name] = str(exc)
            print(f"  {name}: refused the decode schema: {exc}", flush=True)
            continue
        print(f"  {name}: first request with the decode schema (minItems {min_items}; compile + 2 steps) took "
              f"{time.perf_counter() - start:.1f} s", flush=True)
        arms[name] = params
    if kernel_arm and "xgrammar" in arms:
        arms[XGRAMMAR_KERNEL_ARM] = arms["xgrammar"]

    result = {"min_items": min_items, "schema": schema, "refused": refused, "batches": []}
    for batch in batches:
        prompts = [llm.encode_chat(c) for c in decode_prompts(batch)]
        for arm, params in arms.items():  # warm: model, prefixes, grammar cache
            use_mask_kernel(arm)
            llm.generate(prompts, params.replace(max_tokens=WARMUP_TOKENS))
        runs = {arm: [] for arm in arms}
        load = OtherLoad().start()
        for r in range(repeats):
            order = list(arms)[r % len(arms):] + list(arms)[: r % len(arms)]
            for arm in order:
                use_mask_kernel(arm)
                timer.reset()
                start = time.perf_counter()
                outputs = llm.generate(prompts, arms[arm])
                wall = time.perf_counter() - start
                tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
                short = [o.outputs[0].finish_reason for o in outputs if o.outputs[0].finish_reason != "length"]
                if short or tokens != batch * max_tokens:
                    raise RuntimeError(f"{arm} at batch {batch}: {tokens} tokens, not {batch * max_tokens} "
                                       f"(finish reasons {short}): the arms did unequal work")
                first = max(o.metrics.first_token_time for o in outputs)
                finish = max(o.metrics.finish_time for o in outputs)
                runs[arm].append({
                    "tok_per_s": tokens / wall, "wall_s": wall,
                    "decode_step_ms": (finish - first) / (max_tokens - 1) * 1e3,
                    "phases_ms": timer.per_step_ms(), "steps": timer.steps,
                    "sample": outputs[0].outputs[0].text[:100],
                })
        entry = {"batch": batch, "load": load.report(), "arms": {}}
        for arm, rs in runs.items():
            entry["arms"][arm] = {
                "tok_per_s": statistics.median(r["tok_per_s"] for r in rs),
                "tok_per_s_runs": [r["tok_per_s"] for r in rs],
                "decode_step_ms": statistics.median(r["decode_step_ms"] for r in rs),
                "phases_ms": {k: statistics.median(r["phases_ms"][k] for r in rs) for k in rs[0]["phases_ms"]},
                "sample": rs[0]["sample"],
            }
        free = entry["arms"]["unconstrained"]
        for arm, side in entry["arms"].items():
            if arm != "unconstrained":
                side["ratio"] = side["tok_per_s"] / free["tok_per_s"]
                side["slowdown"] = 1 - side["ratio"]
                side["step_ratio"] = side["decode_step_ms"] / free["decode_step_ms"]
                side["ratio_per_round"] = [a / b for a, b in zip(side["tok_per_s_runs"], free["tok_per_s_runs"])]
        result["batches"].append(entry)
        print_batch(entry, max_tokens, repeats)
    return result


def print_batch(entry: dict, max_tokens: int, repeats: int) -> None:
    batch = entry["batch"]
    print(f"  batch {batch} x {max_tokens} tokens, median of {repeats} rounds (step phases: ms per engine step, "
          "all steps of the call)")
    print(f"    {'arm':<18} {'tok/s':>7} {'ratio':>7} {'slowdown':>9} | {'decode step':>11} {'forward':>8} {'masks':>7} "
          f"{'sample':>7} {'append':>7} {'other':>6} | tok/s per round")
    for arm, side in entry["arms"].items():
        ph = side["phases_ms"]
        ratio = f"{side['ratio']:.3f}x" if "ratio" in side else ""
        slow = f"{side['slowdown'] * 100:.1f}%" if "slowdown" in side else ""
        runs = ", ".join(f"{x:.1f}" for x in side["tok_per_s_runs"])
        print(f"    {arm:<18} {side['tok_per_s']:7.1f} {ratio:>7} {slow:>9} | {side['decode_step_ms']:9.1f}ms {ph['forward']:8.1f} "
              f"{ph['masks']:7.2f} {ph['sample']:7.2f} {ph['append']:7.2f} {ph['other']:6.2f} | {runs}")
    for arm, side in entry["arms"].items():
        if arm != "unconstrained":
            verdict = "within" if side["slowdown"] <= SLOWDOWN_GOAL else "OUTSIDE"
            rounds = ", ".join(f"{x:.3f}" for x in side["ratio_per_round"])
            print(f"    {arm}: constrained / unconstrained = {side['ratio']:.3f}x tok/s (per round: {rounds}), "
                  f"decode step {side['step_ratio']:.3f}x; slowdown {side['slowdown'] * 100:.1f}%, {verdict} the "
                  f"{SLOWDOWN_GOAL * 100:.0f}% goal")
            print(f"      output starts: {side['sample'][:80]!r}")
    print(describe_load(f"batch {batch}", entry["load"]), flush=True)


# ---------------------------------------------------------------------- main


COLLECTION = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data", "jsonschemabench",
                          "schemas.jsonl.gz")


def load_collection() -> list[dict]:
    import gzip

    with gzip.open(COLLECTION) as f:
        return [json.loads(line) for line in f]


def bench_coverage(backend_names: list[str], timeout: float) -> dict:
    """(3): every stored schema compiled by each backend and by auto, as the engine
    asks (checked after) and exactly."""
    from pyagent_framework import registries
    from pyagent_framework.engine import loader
    from pyagent_framework.engine.errors import InvalidRequestError
    from pyagent_framework.engine.structured import StructuredOutputManager
    from pyagent_framework.types import GrammarSpec

    from pyagent_framework import StructuredOutputsParams

    rows = []
    result = {"schemas": 0, "arms": {}, "engine_refused": {}}
    for row in load_collection():  # the engine's own checks first, as a request meets them
        try:
            StructuredOutputsParams(json=row["schema"]).spec()
            rows.append(row)
        except InvalidRequestError as exc:
            result["engine_refused"][row["id"]] = str(exc)[:300]
    result["schemas"] = len(rows)
    print(f"  {len(rows)} schemas; refused by the engine's request checks before any backend: "
          f"{len(result['engine_refused'])}", flush=True)
    for rid, why in result["engine_refused"].items():
        print(f"    {rid}: {why[:200]}", flush=True)
    tok = registries.tokenizers.load("hf").from_pretrained(loader.resolve_model("smollm2"))
    for name in [*backend_names, "auto"]:
        for checked in (True, False):
            manager = StructuredOutputManager(tok, VOCAB_SIZE, default_backend=name, compile_timeout=timeout)
            warm = manager.submit(GrammarSpec("choice", ("yes", "no")))  # worker and vocabulary set-up, not timed
            try:
                warm.result(600)
            except InvalidRequestError:
                pass
            counts = {"compiled": 0, "refused": 0, "invalid": 0, "timeout": 0}
            times, reasons, compiled_ids, slowest = [], {}, [], []
            for row in rows:
                start = time.perf_counter()
                try:
                    manager.submit(GrammarSpec("json_schema", row["schema"], checked_after=checked)).result(timeout + 600)
                except InvalidRequestError as exc:
                    message = str(exc)
                    verdict = ("timeout" if "took longer than" in message else
                               "refused" if "no grammar backend supports" in message else "invalid")
                    counts[verdict] += 1
                    reasons[row["id"]] = message[:300]
                    continue
                times.append(time.perf_counter() - start)
                counts["compiled"] += 1
                compiled_ids.append(row["id"])
                slowest.append((times[-1], row["id"]))
            manager.close()
            arm = f"{name}{'' if checked else ' (exact)'}"
            result["arms"][arm] = {
                **counts, "compile_p50_ms": percentile(times, 50) * 1e3 if times else None,
                "compile_p99_ms": percentile(times, 99) * 1e3 if times else None,
                "compile_max_ms": max(times) * 1e3 if times else None, "reasons": reasons, "compiled_ids": compiled_ids,
            }
            entry = result["arms"][arm]
            print(f"  {arm:<20} compiled {counts['compiled']:>3} ({counts['compiled'] / len(rows):.1%})  refused "
                  f"{counts['refused']:>3}  invalid {counts['invalid']:>2}  timeout {counts['timeout']:>2}  compile p50 "
                  f"{entry['compile_p50_ms'] or 0:.1f} ms  p99 {entry['compile_p99_ms'] or 0:.0f} ms  max "
                  f"{entry['compile_max_ms'] or 0:.0f} ms", flush=True)
            slowest.sort(reverse=True)
            entry["slowest"] = {rid: round(seconds * 1e3, 1) for seconds, rid in slowest[:5]}
            print("    slowest: " + ", ".join(f"{rid} {ms:.0f} ms" for rid, ms in entry["slowest"].items()), flush=True)
    return result


def bench_generate(compiled_ids: list[str], max_tokens: int, model: str | None) -> dict:
    """(3), generation: each compiled schema's output from SmolLM2, validated here."""
    import jsonschema

    from pyagent_framework import LLM, SamplingParams

    rows = {row["id"]: row for row in load_collection()}
    llm = LLM(model, max_num_seqs=32, max_model_len=max_tokens + 1024, grammar_compile_timeout=600.0)
    prompts, params = [], []
    for rid in compiled_ids:
        schema = rows[rid]["schema"]
        text = json.dumps(schema, separators=(",", ":"))[:1500]
        prompts.append(llm.encode_chat([{"role": "user", "content": f"Reply with a JSON value that follows this JSON schema: {text}"}]))
        params.append(SamplingParams(temperature=0.7, frequency_penalty=1.0, seed=0, max_tokens=max_tokens,
                                     structured_outputs={"json": schema}))
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    counts = {"valid": 0, "caught by the check": 0, "failed otherwise": 0, "delivered invalid": 0, "cut by max_tokens": 0}
    caught, wrong, tokens = {}, {}, 0
    for rid, out in zip(compiled_ids, outs):
        [sample] = out.outputs
        tokens += len(sample.token_ids)
        if out.error_kind == "invalid_output":
            counts["caught by the check"] += 1
            caught[rid] = out.error[:300]
            continue
        if out.error is not None:  # e.g. the per-token grammar budget: no output was delivered
            counts["failed otherwise"] += 1
            caught[rid] = f"{out.error_kind}: {out.error[:280]}"
            continue
        if sample.finish_reason == "length":
            counts["cut by max_tokens"] += 1
            continue
        schema = rows[rid]["schema"]
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        try:
            errors = [e.message for e in cls(schema, format_checker=cls.FORMAT_CHECKER).iter_errors(json.loads(sample.text))]
        except ValueError as exc:
            errors = [f"not JSON: {exc}"]
        if errors:
            counts["delivered invalid"] += 1
            wrong[rid] = (errors or [out.error])[:3]
        else:
            counts["valid"] += 1
    print(f"  generated {len(compiled_ids)} requests, {tokens} tokens in {elapsed:.0f} s: "
          + "  ".join(f"{k} {v}" for k, v in counts.items()), flush=True)
    for rid, why in list(caught.items())[:10]:
        print(f"    caught {rid}: {why}", flush=True)
    for rid, why in wrong.items():
        print(f"    DELIVERED INVALID {rid}: {why}", flush=True)
    return {**counts, "caught": caught, "wrong": wrong, "tokens": tokens, "seconds": elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2 (masks always use its tokenizer)")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens generated per request in (2) (default 128)")
    parser.add_argument("--batch", type=int, action="append", help="batch sizes, repeatable (default: 1 and 16)")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds per arm in (2); medians reported (default 3)")
    parser.add_argument("--backends", default=None,
                        help="comma-separated grammar backends (default: every registered one)")
    parser.add_argument("--walks", type=int, default=5, help="least replays of each instance in (1) (default 5; short ones replay until 1,000 tokens)")
    parser.add_argument("--xgrammar-kernel-arm", action="store_true",
                        help=f"diagnostic: add a decode arm {XGRAMMAR_KERNEL_ARM!r}, the xgrammar arm with the engine's "
                        "apply_token_bitmask swapped for xgrammar's CPU kernel in this process")
    parser.add_argument("--skip-masks", action="store_true", help="skip (1)")
    parser.add_argument("--skip-decode", action="store_true", help="skip (2)")
    parser.add_argument("--coverage", action="store_true", help="run (3), the coverage on the stored schemas, only")
    parser.add_argument("--coverage-generate", action="store_true", help="with --coverage: also generate with SmolLM2")
    parser.add_argument("--coverage-max-tokens", type=int, default=768, help="max_tokens per generated schema (default 768)")
    parser.add_argument("--compile-timeout", type=float, default=10.0, help="compile timeout in (3) (default 10 s, the engine's)")
    parser.add_argument("--json", action="store_true", help="also print a machine-readable summary")
    args = parser.parse_args()
    if args.max_tokens < 2:
        parser.error("--max-tokens must be at least 2")
    batches = args.batch or [1, 16]

    from pyagent_framework import registries

    registered = registries.grammar_backends.names()
    if args.backends:
        backends = [b.strip() for b in args.backends.split(",") if b.strip()]
        missing = [b for b in backends if b not in registered]
        for b in missing:
            print(f"grammar backend {b!r} is not registered (registered: {', '.join(registered) or 'none'}): skipped")
        backends = [b for b in backends if b in registered]
    else:
        backends = list(registered)
    if not backends:
        sys.exit("no grammar backend to measure (pip install pyagent-xgrammar)")

    from importlib import metadata

    versions = {}
    for dist in ("xgrammar", "outlines_core"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    summary = {
        "backends": backends, "versions": versions, "batches": batches, "max_tokens": args.max_tokens,
        "repeats": args.repeats, "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
        "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
        "loadavg_start": os.getloadavg(),
    }
    print(f"structured outputs: backends {', '.join(backends)} ({', '.join(f'{k} {v}' for k, v in versions.items())})  "
          f"torch {torch.__version__}  threads={summary['threads']}  cpus={summary['cpus']}  "
          f"loadavg {' '.join(f'{x:.2f}' for x in summary['loadavg_start'])}", flush=True)

    if args.coverage:
        print(f"(3) coverage on {COLLECTION} ...", flush=True)
        load = OtherLoad().start()
        summary["coverage"] = bench_coverage(backends, args.compile_timeout)
        if args.coverage_generate:
            summary["coverage"]["generate"] = bench_generate(summary["coverage"]["arms"]["auto"]["compiled_ids"],
                                                             args.coverage_max_tokens, args.model)
        summary["coverage"]["load"] = load.report()
        print(describe_load("(3)", summary["coverage"]["load"]), flush=True)
        args.skip_masks = args.skip_decode = True
    if not args.skip_masks:
        print("(1) grammar masks on the SmolLM2 tokenizer ...", flush=True)
        load = OtherLoad().start()
        summary["masks"] = bench_masks(backends, batches, args.walks)
        summary["masks"]["load"] = load.report()
        print_masks(summary["masks"])
        print(describe_load("(1)", summary["masks"]["load"]), flush=True)
    if not args.skip_decode:
        print(f"(2) decode with LLM(), main thread, constrained vs unconstrained ...", flush=True)
        summary["decode"] = bench_decode(backends, batches, args.max_tokens, args.repeats, args.model,
                                         args.xgrammar_kernel_arm)
    summary["loadavg_end"] = os.getloadavg()
    if args.json:
        print(json.dumps(summary, indent=2, default=str))


if __name__ == "__main__":
    main()
