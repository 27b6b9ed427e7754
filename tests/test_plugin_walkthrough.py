"""A plugin author's walk, end to end: a fresh virtual environment made here, a plugin of
every kind scaffolded with `pyagent plugin new`, installed with `pyagent plugin install
-e` by that environment's own `pyagent`, then each used by name from the CLI, the Python
API and the server of that environment.

The fresh environment is layered over this one (a `.pth` file adds this environment's
site-packages after its own), so torch and the kernel's dependencies need no download;
the kernel itself is installed into it, so it has a `pyagent` of its own. The plugins
land in the fresh environment only: this one never sees them.

Two checkpoints are written in the scaffolded weight format, with the scaffolded
tokenizer's 258 ids: a tiny Llama (run by the scaffolded attention backend, quantizer,
eviction policy, KV connector, proposer and chat template) and a model of the
scaffolded (bigram) architecture. The server forces its output through the scaffolded
grammar backend, so the scaffolded tool and reasoning parsers have calls and reasoning
to find in a random model's output.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

from pyagent_framework import registries, scaffold
from pyagent_framework.server.process import server_process
from tests.distributions import REPO
from tests.tiny_models import tiny_checkpoint

KINDS = scaffold.kinds()
VOCAB = 258  # the scaffolded tokenizer: 256 bytes, <s>, </s>


def dist(kind: str) -> str:
    return "pyagent-walk-" + kind.replace("_", "-")


def entry(kind: str) -> str:
    return "walk_" + kind


# The engine options that select each engine-side entry by name.
ENGINE_FLAGS = {
    "weight_format": "--weight-format",
    "tokenizer": "--tokenizer",
    "attention_backend": "--attention-backend",
    "quantizer": "--quantization",
    "eviction_policy": "--eviction-policy",
    "kv_connector": "--kv-connector",
    "proposer": "--speculative-method",
    "chat_template": "--chat-template",
}
COMMON = ["--kv-cache-memory", "8MiB", "--max-model-len", "128"]


class Walk:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.venv = root / "venv"
        self.python = str(self.venv / "bin" / "python")
        self.pyagent = str(self.venv / "bin" / "pyagent")
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("PYAGENT_") and k != "VIRTUAL_ENV"}
        self.env["PYAGENT_STRICT_PLUGINS"] = "1"

    def run(self, *command: str, check: bool = True) -> subprocess.CompletedProcess:
        result = subprocess.run(command, capture_output=True, text=True, env=self.env, cwd=self.root, timeout=600)
        if check:
            assert result.returncode == 0, f"$ {' '.join(command)}\n{result.stdout}\n{result.stderr}"
        return result

    def python_json(self, code: str):
        out = self.run(self.python, "-c", textwrap.dedent(code)).stdout
        return json.loads(out.strip().splitlines()[-1])

    def flags(self, *, connector: bool = True) -> list[str]:
        flags = list(COMMON)
        for kind, flag in ENGINE_FLAGS.items():
            if kind != "kv_connector" or connector:
                flags += [flag, entry(kind)]
        return flags


@pytest.fixture(scope="module")
def walk(tmp_path_factory) -> Walk:
    w = Walk(tmp_path_factory.mktemp("walkthrough"))
    w.run(sys.executable, "-m", "venv", str(w.venv))
    purelib = w.run(w.python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip()
    here = sysconfig.get_paths()["purelib"]
    Path(purelib, "_pyagent_parent_env.pth").write_text(f"import site; site.addsitedir({here!r})\n")
    w.run(w.python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "-e", str(REPO))
    for kind in KINDS:
        made = w.run(w.pyagent, "plugin", "new", dist(kind), "--kind", kind, "--dir", str(w.root / "src"))
        assert f"{w.pyagent} plugin install -e" in made.stdout  # the next step names this environment's pyagent
    installed = w.run(w.pyagent, "plugin", "install", "-e", *(str(w.root / "src" / dist(kind)) for kind in KINDS))
    w.install_output = installed.stdout
    # The checkpoints, written by the scaffolded weight format's own writer.
    tiny = tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny"))
    w.run(w.python, "-c", textwrap.dedent(f"""
        import json, pathlib
        from safetensors.torch import load_file
        from pyagent_walk_weight_format.weight_format import save
        src = pathlib.Path({tiny!r})
        config = json.loads((src / "config.json").read_text())
        tensors = {{}}
        for f in sorted(src.glob("*.safetensors")):
            tensors.update(load_file(str(f)))
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            tensors[name] = tensors[name][:{VOCAB}].clone()
        config.update(vocab_size={VOCAB}, bos_token_id=256, eos_token_id=257)
        save({str(w.root / "llama")!r}, config, tensors)
        bigram = {{"architectures": ["{entry('model_architecture')}"], "vocab_size": {VOCAB},
                  "hidden_size": config["hidden_size"], "max_position_embeddings": 256}}
        save({str(w.root / "bigram")!r}, bigram,
             {{n: tensors[n] for n in ("model.embed_tokens.weight", "lm_head.weight")}})
    """))
    return w


def test_every_kind_is_installed_into_the_fresh_environment_only(walk):
    for kind in KINDS:
        assert f"{dist(kind).removeprefix('pyagent-')}  [loaded]  {dist(kind)} 0.1.0" in walk.install_output.splitlines()
        assert f"    {kind}: {entry(kind)}" in walk.install_output.splitlines()
    site = walk.run(walk.python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip()
    for kind in KINDS:
        module = dist(kind).replace("-", "_")
        assert list(Path(site).glob(f"{module}-0.1.0.dist-info")), f"{dist(kind)} is not in the fresh environment"
    # This environment (the one running the tests) does not see them.
    assert not [e.name for registry in registries.KINDS.values() for e in registry.entries() if e.name.startswith("walk_")]


def test_the_cli_lists_and_checks_every_kind(walk):
    checked = walk.run(walk.pyagent, "plugins", "--check")
    assert checked.stdout.splitlines()[-1].endswith("all is well")
    for kind in KINDS:
        listed = json.loads(walk.run(walk.pyagent, "list", kind, "--json").stdout)
        mine = [e for e in listed if e["name"] == entry(kind)]
        assert mine and mine[0]["provider"]["distribution"] == dist(kind)


def test_the_cli_generates_with_every_engine_side_entry_by_name(walk):
    result = walk.run(walk.pyagent, "generate", "--model", str(walk.root / "llama"), *walk.flags(), "--chat",
                      "--prompt", "hello", "--max-tokens", "8", "--json")
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["finish_reason"] == "length" and len(out["token_ids"]) == 8, out
    # The scaffolded chat template rendered the prompt, as the byte tokenizer shows it.
    assert out["metrics"]["num_prompt_tokens"] == len("User: hello\nAssistant:".encode())
    # The bigram architecture: no attention layers, so no KV connector either.
    result = walk.run(walk.pyagent, "generate", "--model", str(walk.root / "bigram"), *walk.flags(connector=False),
                      "--prompt", "hello", "--max-tokens", "8", "--json")
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["finish_reason"] == "length" and len(out["token_ids"]) == 8, out
    refused = walk.run(walk.pyagent, "generate", "--model", str(walk.root / "bigram"), *walk.flags(),
                       "--prompt", "hello", "--max-tokens", "8", check=False)
    assert refused.returncode == 2 and "kv_connector: this model keeps no keys or values" in refused.stderr


def test_the_python_api_runs_every_engine_side_entry_and_names_each_in_stats(walk):
    flags = walk.flags()
    options = {flag.removeprefix("--").replace("-", "_"): value for flag, value in zip(flags[::2], flags[1::2])}
    options["grammar_backend"] = entry("grammar_backend")
    stats = walk.python_json(f"""
        import json
        from pyagent_framework import LLM, SamplingParams
        options = {options!r}
        with LLM({str(walk.root / "llama")!r}, engine_process=False, **options) as llm:
            plain = llm.generate(["the same words"], SamplingParams(max_tokens=12, temperature=0))[0]
            barred = llm.generate(["the same words"], SamplingParams(max_tokens=12, temperature=0,
                logits_processors=[{{"name": "{entry('logits_processor')}", "args": {{"window": 1}}}}]))[0]
            chosen = llm.generate(["pick one"], SamplingParams(max_tokens=12, temperature=0,
                structured_outputs={{"choice": ["yes", "no"]}}))[0]
            stats = llm.engine.stats()
        print(json.dumps({{"plain": plain.outputs[0].token_ids, "barred": barred.outputs[0].token_ids,
                          "chosen": chosen.outputs[0].text, "entries": stats["entries"]}}))
    """)
    plain, barred = stats["plain"], stats["barred"]
    # The logits processor bars a token from coming back right after itself.
    assert all(a != b for a, b in zip(barred, barred[1:])), barred
    assert any(a == b for a, b in zip(plain, plain[1:])) or plain != barred
    assert stats["chosen"] in ("yes", "no")  # the grammar backend's choice
    entries = stats["entries"]
    for kind in (*ENGINE_FLAGS, "grammar_backend"):
        assert entries[kind]["name"] == entry(kind) and entries[kind]["distribution"] == dist(kind), (kind, entries[kind])


def test_the_server_uses_every_entry_by_name(walk):
    call = '<call>{"name": "get_weather", "arguments": {"city": "Paris"}}</call>'
    flags = (*walk.flags(connector=False), "--model", str(walk.root / "llama"), "--grammar-backend", entry("grammar_backend"),
             "--enable-auto-tool-choice", "--tool-call-parser", entry("tool_parser"),
             "--reasoning-parser", entry("reasoning_parser"), "--kv-connector", entry("kv_connector"), "--max-model-len", "256",
             "--log-level", "info")
    with server_process(*flags, python=walk.python, env={"PYAGENT_STRICT_PLUGINS": "1"}) as server:
        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
        body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": tools, "max_tokens": 120,
                "temperature": 0, "structured_outputs": {"choice": [f"Let me look.{call}"]}}
        status, answer = server.post_json("/v1/chat/completions", body)
        assert status == 200, answer
        message = answer["choices"][0]["message"]
        assert message["content"] == "Let me look." and message["reasoning_content"] is None, message
        assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"], message
        assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
        assert answer["choices"][0]["finish_reason"] == "tool_calls"
        # The scaffolded chat template rendered the messages (one byte, one token).
        assert answer["usage"]["prompt_tokens"] == len("User: Weather in Paris?\nAssistant:".encode())
        # A prompt that opens <think> (an assistant turn continued): the reasoning parser
        # reads the unconstrained output as reasoning, cut off before any </think>.
        body = {"messages": [{"role": "user", "content": "Think first."}, {"role": "assistant", "content": "<think>"}],
                "add_generation_prompt": False, "continue_final_message": True, "max_tokens": 6, "temperature": 0,
                "logits_processors": [{"name": entry("logits_processor"), "args": {"window": 1}}]}
        status, answer = server.post_json("/v1/chat/completions", body)
        assert status == 200, answer
        message = answer["choices"][0]["message"]
        assert message["reasoning_content"] and message["content"] is None, message
        status, text = server.get("/metrics")
        rows = set()
        for labels in re.findall(r"^pyagent:entry_info\{(.*)\} 1\.0$", text, re.M):
            label = dict(re.findall(r'(\w+)="([^"]*)"', labels))
            rows.add((label["kind"], label["name"], label["distribution"]))
        expected = {(kind, entry(kind), dist(kind)) for kind in (*ENGINE_FLAGS, "tool_parser", "reasoning_parser",
                                                                  "grammar_backend")}
        assert expected <= rows, expected - rows
        # The start-up log of the engine core (its own process) names them too.
        logged = next(line for line in server.log_text().splitlines() if "entries in use: " in line)
        for kind in ENGINE_FLAGS:
            assert f"{kind} '{entry(kind)}' ({dist(kind)} 0.1.0)" in logged, (kind, logged)
