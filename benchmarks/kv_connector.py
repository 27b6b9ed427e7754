"""Time to first token of a second engine instance whose prefix another instance
computed and saved through a KV connector, against a cold instance, in one run.

    .venv/bin/python benchmarks/kv_connector.py                     # disk connector, 1,024-token prefix
    .venv/bin/python benchmarks/kv_connector.py --connector redis   # starts a redis-server on a free port

Each instance is its own process (nothing shared but the store): the cold one
computes the prompt from scratch; the producer computes it and saves its blocks; the
second instance, started afterwards with an empty local cache, loads them and
computes only the prompt's tail. Each of the three runs the same prompt (a shared
1,024-token document plus a question), greedy, ``--max-tokens`` tokens; the outputs
must be identical. Model loading is not timed; TTFT is the engine's own
``time_to_first_token`` (arrival to first token). The ratio is cold / second.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

PARAGRAPH = (
    "The river rose slowly through the night, and by morning the low fields were under water. "
    "Farmers moved their animals to the hills, and the old bridge, which had stood for a century, "
    "groaned under the weight of the current. "
)


def prompt_ids(tokenizer, prefix_tokens: int) -> list[int]:
    ids = []
    while len(ids) < prefix_tokens:
        ids += tokenizer.encode(PARAGRAPH, add_special_tokens=False)
    question = tokenizer.encode(" Question: what happened to the bridge? Answer:", add_special_tokens=False)
    return ids[:prefix_tokens] + question


def worker(args) -> None:
    """One engine instance: run the prompt once and print its TTFT and tokens as JSON."""
    from pyagent_framework import LLM, SamplingParams

    engine_args = {}
    if args.connector != "none":
        engine_args = {"kv_connector": args.connector, "kv_connector_config": json.loads(args.connector_config)}
    with LLM(args.model, **engine_args) as llm:
        ids = prompt_ids(llm.engine.tokenizer, args.prefix_tokens)
        out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=args.max_tokens))[0]
        stats = llm.engine.stats()
    print(json.dumps({
        "ttft_s": out.metrics.time_to_first_token,
        "tokens": out.outputs[0].token_ids,
        "prompt_tokens": len(ids),
        "loaded_blocks": stats.get("kv_connector_loaded_blocks", 0),
        "saved_blocks": stats.get("kv_connector_saved_blocks", 0),
    }))


def run_instance(args, connector: str, config: dict) -> dict:
    command = [
        sys.executable, __file__, "--worker", "--connector", connector, "--connector-config", json.dumps(config),
        "--prefix-tokens", str(args.prefix_tokens), "--max-tokens", str(args.max_tokens),
    ]
    if args.model:
        command += ["--model", args.model]
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--connector", default="disk", choices=["disk", "redis", "none"])
    parser.add_argument("--connector-config", default="{}")
    parser.add_argument("--prefix-tokens", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    server = None
    with tempfile.TemporaryDirectory(prefix="pyagent-kv-bench-") as scratch:
        if args.connector == "disk":
            config = {"path": os.path.join(scratch, "kv")}
        else:
            from pyagent_kv_redis.testing import RedisServer

            server = RedisServer()
            server.start()
            config = {"url": server.url}
        try:
            cold = run_instance(args, "none", {})
            producer = run_instance(args, args.connector, config)
            second = run_instance(args, args.connector, config)
        finally:
            if server is not None:
                server.stop()
    same = cold["tokens"] == producer["tokens"] == second["tokens"]
    print(f"prompt {cold['prompt_tokens']} tokens ({args.prefix_tokens} shared), {args.connector} connector, "
          f"greedy outputs identical: {same}")
    print(f"  cold instance                  TTFT {cold['ttft_s'] * 1000:8.1f} ms")
    print(f"  producer (computes and saves)  TTFT {producer['ttft_s'] * 1000:8.1f} ms   saved {producer['saved_blocks']} blocks")
    print(f"  second instance (loads)        TTFT {second['ttft_s'] * 1000:8.1f} ms   loaded {second['loaded_blocks']} blocks")
    print(f"  cold / second = {cold['ttft_s'] / second['ttft_s']:.2f}x")
    if not same:
        sys.exit("outputs differ")


if __name__ == "__main__":
    main()
