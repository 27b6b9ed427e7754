"""`pyagent generate` and `pyagent chat` on a tiny checkpoint, in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.distributions import run_cli
from tests.tiny_models import tiny_checkpoint


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny"))


def test_generate_json_prints_one_object_per_prompt(path):
    result = run_cli(
        "generate", "--model", path, "--prompt", "The quick", "--prompt", "def add", "--max-tokens", "5",
        "--ignore-eos", "--json", "--kv-cache-memory", "16MiB", "--max-model-len", "128",
    )
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [line["prompt"] for line in lines] == ["The quick", "def add"]
    for line in lines:
        assert set(line) >= {"text", "token_ids", "finish_reason", "metrics"}
        assert len(line["token_ids"]) == 5 and line["finish_reason"] == "length"
        assert line["metrics"]["num_output_tokens"] == 5
        assert line["metrics"]["first_token_time"] >= line["metrics"]["arrival_time"]


def test_generate_with_a_seed_is_reproducible(path):
    args = ["generate", "--model", path, "--prompt", "The", "--max-tokens", "6", "--temperature", "1.0", "--seed", "7",
            "--ignore-eos", "--json", "--kv-cache-memory", "16MiB", "--max-model-len", "128"]
    first, second = run_cli(*args), run_cli(*args)
    assert json.loads(first.stdout)["token_ids"] == json.loads(second.stdout)["token_ids"]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--attention-backend", "flash"], "unknown attention_backend 'flash'"),
        (["--max-num-seqs", "zero"], "max_num_seqs"),
        (["--temperature", "-1"], "temperature"),
        (["--model", "/no/such/dir"], "model '/no/such/dir'"),
    ],
)
def test_bad_flags_exit_2_naming_the_problem(path, flags, message):
    result = run_cli("generate", "--model", path, "--prompt", "x", "--kv-cache-memory", "16MiB", "--max-model-len", "128", *flags)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr


def test_chat_reads_turns_from_stdin_and_streams_answers(path):
    result = subprocess.run(
        [sys.executable, "-m", "pyagent_framework", "chat", "--model", path, "--max-tokens", "4", "--ignore-eos",
         "--kv-cache-memory", "16MiB", "--max-model-len", "128"],
        input="hello\n\nsecond turn\n/exit\nnot read\n",
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.splitlines()) == 2  # two answers, then /exit


def test_generate_chat_renders_the_prompt_as_a_user_turn(path):
    result = run_cli(
        "generate", "--model", path, "--chat", "--prompt", "hi", "--max-tokens", "2", "--ignore-eos", "--json",
        "--kv-cache-memory", "16MiB", "--max-model-len", "128",
    )
    assert result.returncode == 0, result.stderr
    line = json.loads(result.stdout)
    assert line["prompt"] == "hi"
    assert line["metrics"]["num_prompt_tokens"] > 2  # the template's role markers came along
