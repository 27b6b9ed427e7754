"""Serving under load, side by side: guidellm (the vLLM project's benchmark client)
against ``pyagent serve`` and against llama.cpp's ``llama-server`` on the same GGUF file,
one server at a time.

    .venv/bin/python benchmarks/serve_peers.py --llama-server /path/to/llama-server
    .venv/bin/python benchmarks/serve_peers.py --build-llama-server   # builds it first (~10 min)
    .venv/bin/python benchmarks/serve_peers.py --skip-llama           # ours only

Workload (the same for both servers): guidellm 0.8.1's synthetic text, 256 prompt tokens
and 128 output tokens per request, streamed from ``/v1/completions``, at a fixed number
of concurrent clients (``--concurrency``, default 1, 8 and 32), ``max(8, 4 x clients)``
requests each. Reported per server and concurrency: output tokens/s, median and p99
time to first token, and errored requests; then ours / llama-server.

- guidellm is installed, if missing, into an environment of its own
  (``--guidellm-venv``, default ``~/.cache/pyagent-bench/guidellm-0.8.1``): it is a
  benchmark client, never a dependency. Its synthetic prompts are made with the model's
  tokenizer, exported from the GGUF file to a temporary folder (no network).
- ``pyagent serve``: default engine options except ``--max-num-seqs`` (32) and, with
  ``--ours-config``, a quantization config (e.g. '{"activations": "int8"}').
- ``llama-server``: ``-np 32 -c 32768 -t <threads>`` (continuous batching, 32 slots of
  1024 tokens), the same file. ``--build-llama-server`` builds it from the llama.cpp
  sources vendored in the llama-cpp-python sdist (``pip download --no-binary :all:``,
  then ``cmake -B build -DLLAMA_CURL=OFF -DGGML_NATIVE=OFF`` with the AVX2/AVX-512
  switches /proc/cpuinfo allows, and ``cmake --build build --target llama-server``).

Run it on an otherwise idle machine: the client shares the CPU with the server.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

GUIDELLM = "guidellm==0.8.1"
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"


def ensure_guidellm(venv: Path) -> Path:
    exe = venv / "bin" / "guidellm"
    if not exe.exists():
        print(f"installing {GUIDELLM} into {venv} ...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "--quiet", GUIDELLM], check=True)
    return exe


def cpu_flags() -> list[str]:
    """llama.cpp's x86 build switches for what /proc/cpuinfo lists. GGML_NATIVE is left
    off: its build (AMX included on this machine) crashed with a segmentation fault on
    every file, as llama-cpp-python's native build did (docs/benchmarks.md)."""
    try:
        have = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return []
    switches = {"avx2": ["GGML_AVX", "GGML_AVX2", "GGML_FMA", "GGML_F16C"], "avx512f": ["GGML_AVX512"],
                "avx512_vnni": ["GGML_AVX512_VNNI"], "avx512_bf16": ["GGML_AVX512_BF16"],
                "avx512vbmi": ["GGML_AVX512_VBMI"], "avx_vnni": ["GGML_AVX_VNNI"]}
    return [f"-D{name}=ON" for flag, names in switches.items() if flag in have for name in names]


def build_llama_server(where: Path) -> Path:
    """llama-server from the llama.cpp sources vendored in the llama-cpp-python sdist."""
    exe = where / "build" / "bin" / "llama-server"
    if exe.exists():
        return exe
    download = where.parent / "sdist"
    download.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", LLAMA_CPP_PYTHON,
                    "-d", str(download)], check=True)
    [archive] = download.glob("llama_cpp_python-*.tar.gz")
    subprocess.run(["tar", "xzf", str(archive), "-C", str(download)], check=True)
    source = next(download.glob("llama_cpp_python-*/vendor/llama.cpp"))
    subprocess.run(["cmake", "-S", str(source), "-B", str(where / "build"), "-DLLAMA_CURL=OFF", "-DCMAKE_BUILD_TYPE=Release",
                    "-DGGML_NATIVE=OFF", *cpu_flags()], check=True)
    subprocess.run(["cmake", "--build", str(where / "build"), "--target", "llama-server", "-j", str(os.cpu_count() or 2)],
                   check=True)
    return exe


def export_tokenizer(gguf_path: str, out: Path) -> Path:
    """The GGUF's tokenizer as a transformers folder, for guidellm's synthetic prompts."""
    from transformers import AutoTokenizer

    path = Path(gguf_path)
    AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(str(out))
    return out


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(command: list[str], port: int, log: Path, timeout: float = 300.0) -> subprocess.Popen:
    sink = open(log, "wb")  # noqa: SIM115 (closed with the process)
    process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
    deadline = time.time() + timeout
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"{command[0]} exited with {process.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return process
        except OSError:
            pass
        if time.time() > deadline:
            process.kill()
            raise RuntimeError(f"{command[0]} did not answer /health in {timeout} s:\n{log.read_text()[-4000:]}")
        time.sleep(0.5)


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def warm_up(port: int, model: str) -> None:
    body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 8}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        response.read()


def run_guidellm(exe: Path, port: int, model: str, tokenizer: Path, clients: int, prompt_tokens: int,
                 output_tokens: int, out: Path) -> dict:
    scenario = {
        "spec": {
            "backend": {"kind": "openai_http", "target": f"http://127.0.0.1:{port}", "model": model,
                        "request_format": "/v1/completions"},
            "profile": {"kind": "concurrent", "streams": clients},
            "data": [{"kind": "synthetic_text", "prompt_tokens": prompt_tokens, "output_tokens": output_tokens}],
            "tokenizer": {"kind": "huggingface_auto", "model": str(tokenizer)},
            "constraints": [{"kind": "max_requests", "count": max(8, 4 * clients)}],
            "outputs": [{"kind": "json", "path": str(out)}],
        }
    }
    config = out.with_suffix(".scenario.json")
    config.write_text(json.dumps(scenario))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run([str(exe), "run", "--scenario", str(config), "--disable-console-interactive"],
                          capture_output=True, text=True, env=env)
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"guidellm failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return summarize(json.loads(out.read_text()))


def summarize(report: dict) -> dict:
    [bench] = report["benchmarks"]
    metrics = bench["metrics"]
    ttft = metrics["time_to_first_token_ms"]["successful"]
    totals = metrics["request_totals"] if "request_totals" in metrics else bench.get("request_totals", {})
    return {
        "output_tok_per_s": metrics["output_tokens_per_second"]["successful"]["mean"],
        "ttft_p50_s": ttft["median"] / 1000,
        "ttft_p99_s": ttft["percentiles"]["p99"] / 1000,
        "errored": totals.get("errored", 0),
        "successful": totals.get("successful"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a GGUF file (default: the embedded SmolLM2 Q4_1 GGUF)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None, help="server threads (default: torch's)")
    parser.add_argument("--ours-config", default=None, help="pyagent serve --quantization-config (JSON)")
    parser.add_argument("--llama-server", default=None, help="a llama-server executable")
    parser.add_argument("--build-llama-server", action="store_true", help="build llama-server first (see above)")
    parser.add_argument("--skip-llama", action="store_true")
    parser.add_argument("--guidellm-venv", default=str(Path.home() / ".cache/pyagent-bench/guidellm-0.8.1"))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    import torch

    from pyagent_framework.engine.loader import resolve_model

    path = resolve_model(args.model)
    threads = args.threads or torch.get_num_threads()
    guidellm = ensure_guidellm(Path(args.guidellm_venv))
    llama_server = None
    if not args.skip_llama:
        if args.build_llama_server:
            llama_server = build_llama_server(Path.home() / ".cache/pyagent-bench/llama.cpp")
        elif args.llama_server:
            llama_server = Path(args.llama_server)
        else:
            sys.exit("name --llama-server PATH, --build-llama-server or --skip-llama")
    work = Path(tempfile.mkdtemp(prefix="serve-peers-"))
    tokenizer = export_tokenizer(path, work / "tokenizer")
    print(f"{os.path.basename(path)}  threads={threads}  {args.prompt_tokens} in / {args.output_tokens} out  "
          f"concurrency {args.concurrency}", flush=True)

    servers = [("pyagent", [sys.executable, "-m", "pyagent_framework.cli", "serve", "--model", path,
                            "--max-num-seqs", "32", "--log-level", "warning"]
                + (["--quantization-config", args.ours_config] if args.ours_config else []))]
    if llama_server is not None:
        servers.append(("llama-server", [str(llama_server), "-m", path, "-np", "32", "-c", "32768", "-t", str(threads),
                                         "--host", "127.0.0.1"]))
    results: dict[str, dict[int, dict]] = {}
    for name, command in servers:
        port = free_port()
        command = command + ["--port", str(port)]
        print(f"starting {name} ...", flush=True)
        process = start(command, port, work / f"{name}.log")
        try:
            model = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10).read())["data"][0]["id"]
            warm_up(port, model)
            results[name] = {}
            for clients in args.concurrency:
                out = work / f"{name}-{clients}.json"
                results[name][clients] = run_guidellm(guidellm, port, model, tokenizer, clients, args.prompt_tokens,
                                                      args.output_tokens, out)
                r = results[name][clients]
                print(f"  {name:<13} {clients:>3} clients: {r['output_tok_per_s']:7.1f} tok/s  TTFT p50 "
                      f"{r['ttft_p50_s']:6.2f} s  p99 {r['ttft_p99_s']:6.2f} s  errors {r['errored']}", flush=True)
        finally:
            stop(process)
    if "llama-server" in results:
        print("\nours / llama-server:")
        for clients in args.concurrency:
            a, b = results["pyagent"][clients], results["llama-server"][clients]
            print(f"  {clients:>3} clients: output tok/s {a['output_tok_per_s'] / b['output_tok_per_s']:.2f}x   "
                  f"median TTFT {a['ttft_p50_s'] / b['ttft_p50_s']:.2f}x")
    if args.json:
        print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
