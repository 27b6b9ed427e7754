"""LoRA adapters against transformers + PEFT on the same weights: greedy tokens (and
their logprobs) of a batch mixing two adapters and the base model, the batched op
against its plain torch form, the slots' LRU, the prefix cache's keys and the errors
a bad adapter or request gets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pyagent_framework import LLM, LoRARequest, SamplingParams
from pyagent_framework.engine.errors import ConfigError, InvalidRequestError
from pyagent_framework.engine.lora import read_adapter
from pyagent_framework.interfaces import LayerOps
from tests.lora_adapters import ALL_PROJECTIONS, make_adapter, smollm2_float32
from tests.tiny_models import hf_greedy, hf_model, tiny_checkpoint

peft = pytest.importorskip("peft")

PROMPTS = [[5, 17, 42, 99, 3], [7, 8, 9], [100, 120, 140, 160, 180, 200, 220], [11, 12]]
MAX_NEW = 12
TARGETS = {
    "a": ALL_PROJECTIONS,
    "b": ["q_proj", "v_proj", "down_proj"],
}


def peft_reference(base: str, adapter: str | None, prompts, eos_token_id: int | None = 1) -> list[tuple[list[int], list[float]]]:
    model = hf_model(base)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).eval()
    return [hf_greedy(model, p, MAX_NEW, eos_token_id=eos_token_id) for p in prompts]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return tiny_checkpoint("llama", tmp_path_factory.mktemp("lora-base"))


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {
        "a": make_adapter(base, root / "a", TARGETS["a"], seed=11),
        "b": make_adapter(base, root / "b", TARGETS["b"], seed=12, rank=4, use_rslora=True),
    }


@pytest.fixture(scope="module")
def references(base, adapters):
    return {name: peft_reference(base, adapters.get(name), PROMPTS) for name in ("a", "b", None)}


@pytest.fixture(scope="module")
def llm(base, adapters):
    engine = LLM(base, attention_backend="torch", enable_lora=True, max_loras=2, max_lora_rank=8,
                 lora_modules={"a": adapters["a"]}, engine_process=False)
    yield engine
    engine.close()


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=0)


def _tokens_and_logprobs(out):
    completion = out.outputs[0]
    return completion.token_ids, [entry[t].logprob for entry, t in zip(completion.logprobs, completion.token_ids)]


def test_a_batch_mixing_two_adapters_and_the_base_model_equals_peft(llm, adapters, references):
    # b is loaded by its LoRARequest's path on first use; a came with lora_modules.
    names = ["a", LoRARequest("b", adapters["b"]), None, "a", "b", None]
    prompts = PROMPTS + PROMPTS[:2]
    outs = llm.generate(prompts, GREEDY, lora_request=names)
    for out, prompt, name in zip(outs, prompts, names):
        key = name.name if isinstance(name, LoRARequest) else name
        tokens, logprobs = _tokens_and_logprobs(out)
        want_tokens, want_logprobs = references[key][PROMPTS.index(prompt)]
        assert tokens == want_tokens, (key, prompt)
        assert logprobs == pytest.approx(want_logprobs, abs=1e-4)
    # the adapters do change the output: the test would catch an adapter not applied
    assert references["a"] != references[None] and references["b"] != references[None]


def test_the_prefix_cache_keeps_each_adapters_blocks_apart(llm):
    prompt = list(range(40, 80))  # several full blocks
    params = SamplingParams(temperature=0.0, max_tokens=2)
    pool = llm.engine.core.pool
    llm.generate([prompt], params, lora_request="a")
    hits = pool.stats()["prefix_cache_hits"]
    llm.generate([prompt], params)  # the base model may not reuse a's blocks
    assert pool.stats()["prefix_cache_hits"] == hits
    llm.generate([prompt], params, lora_request="a")  # a reuses its own
    assert pool.stats()["prefix_cache_hits"] > hits


def test_more_adapters_than_slots_wait_for_one_and_all_finish(llm, adapters, base, tmp_path, references):
    if "b" not in llm.engine.lora_adapters:  # when this test runs alone
        llm.engine.add_lora("b", adapters["b"])
    c = make_adapter(base, tmp_path / "c", ["q_proj", "o_proj"], seed=13, rank=2)
    llm.engine.add_lora("c", c)
    reference_c = peft_reference(base, c, PROMPTS[:2])
    names = ["a", "b", "c", "a", "c", None]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0], PROMPTS[2], PROMPTS[1], PROMPTS[3]]
    outs = llm.generate(prompts, GREEDY, lora_request=names)
    for out, prompt, name in zip(outs, prompts, names):
        want = reference_c[PROMPTS.index(prompt)] if name == "c" else references[name][PROMPTS.index(prompt)]
        assert _tokens_and_logprobs(out)[0] == want[0], (name, prompt)
    assert llm.engine.core.stats()["lora_slots_used"] <= 2
    llm.engine.remove_lora("c")
    with pytest.raises(InvalidRequestError, match="no LoRA adapter named 'c'"):
        llm.generate([PROMPTS[0]], GREEDY, lora_request="c")


def test_grouped_op_equals_its_plain_torch_form():
    torch.manual_seed(0)
    slots, rank, d_in, d_out, rows = 3, 4, 16, 24, 10
    a, b = torch.randn(slots, rank, d_in), torch.randn(slots, d_out, rank)
    x, out = torch.randn(rows, d_in), torch.randn(rows, d_out)
    row_slot = [0, 2, -1, 0, 1, 1, -1, 2, 0, 0]
    groups = [(s, torch.tensor([i for i, r in enumerate(row_slot) if r == s])) for s in range(slots)]
    want = out.clone()
    for i, s in enumerate(row_slot):
        if s >= 0:
            want[i] += b[s] @ (a[s] @ x[i])
    got = out.clone()
    LayerOps().add_lora(got, x, a, b, groups, torch.tensor(row_slot, dtype=torch.int32))
    torch.testing.assert_close(got, want)


def test_bad_adapters_are_refused_with_what_is_wrong(llm, base, adapters, tmp_path):
    targets = llm.engine.core.lora.targets
    with pytest.raises(ConfigError, match="not a directory"):
        read_adapter("x", str(tmp_path / "missing"), targets, 8)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    (pickled / "adapter_model.bin").write_bytes(b"\x80\x04not read")
    with pytest.raises(ConfigError, match="pickled and is never read"):
        read_adapter("x", str(pickled), targets, 8)
    with pytest.raises(ConfigError, match="rank 8, above max_lora_rank 4"):
        read_adapter("a", adapters["a"], targets, 4)
    dora = make_adapter(base, tmp_path / "dora", ["q_proj"], seed=3, use_dora=True)
    with pytest.raises(ConfigError, match="DoRA"):
        read_adapter("d", dora, targets, 8)
    # through the engine: the error reaches the caller, the engine keeps serving
    with pytest.raises(InvalidRequestError, match="rank 16, above max_lora_rank 8"):
        llm.engine.add_lora("big", make_adapter(base, tmp_path / "big", ["q_proj"], seed=4, rank=16))
    with pytest.raises(InvalidRequestError, match="already loaded"):
        llm.engine.add_lora("a", adapters["a"])
    with pytest.raises(InvalidRequestError, match="no LoRA adapter named 'nope'"):
        llm.generate([PROMPTS[0]], GREEDY, lora_request="nope")
    assert llm.generate([PROMPTS[0]], GREEDY, lora_request="a")[0].outputs[0].token_ids


def test_lora_off_names_the_flag(base):
    with LLM(base, attention_backend="torch", engine_process=False) as plain:
        with pytest.raises(InvalidRequestError, match="--enable-lora"):
            plain.generate([PROMPTS[0]], GREEDY, lora_request="a")


def test_lora_modules_parse_every_form():
    from pyagent_framework.engine.config import make_config

    for value in (["a=/x", "b=/y"], "a=/x b=/y", "a=/x,b=/y", {"a": "/x", "b": "/y"}, '{"a": "/x", "b": "/y"}'):
        assert make_config({"lora_modules": value}, env=False).lora_modules == {"a": "/x", "b": "/y"}
    with pytest.raises(ConfigError, match="NAME=PATH"):
        make_config({"lora_modules": ["nopath"]}, env=False)


def test_served_over_http_by_model_name_with_runtime_loading(base, adapters, references, tmp_path):
    """``pyagent serve --enable-lora --lora-modules a=...``: the openai SDK picks an
    adapter by model name; /v1/models lists it; load/unload exist only behind the
    operator's flag, and a bad adapter is a 400 that names the problem."""
    import openai

    from pyagent_framework.server.process import server_process

    with server_process("--model", base, "--attention-backend", "torch", "--enable-lora", "--max-loras", "2",
                        "--max-lora-rank", "8", "--lora-modules", f"a={adapters['a']}", "--allow-runtime-lora-updating") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        models = {m.id: m for m in client.models.list().data}
        assert set(models) == {base, "a"} and models["a"].model_extra["parent"] == base

        def post(path: str, payload: dict) -> tuple[int, str]:
            return server.request("POST", path, json.dumps(payload).encode(), {"Content-Type": "application/json"})

        a_text = client.completions.create(model="a", prompt=PROMPTS[0], max_tokens=MAX_NEW, temperature=0)
        assert a_text.model == "a"  # the response names the adapter it was served by
        base_text = client.completions.create(model=base, prompt=PROMPTS[0], max_tokens=MAX_NEW, temperature=0)
        assert a_text.choices[0].text != base_text.choices[0].text

        status, body = post("/v1/load_lora_adapter", {"lora_name": "b", "lora_path": adapters["b"]})
        assert status == 200, body
        b_text = client.completions.create(model="b", prompt=PROMPTS[0], max_tokens=MAX_NEW, temperature=0)
        with LLM(base, attention_backend="torch", enable_lora=True, max_lora_rank=8, engine_process=False) as local:
            want = local.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=MAX_NEW),
                                  lora_request=[LoRARequest("b", adapters["b"])])[0].outputs[0].text
        assert b_text.choices[0].text == want

        status, body = post("/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": str(tmp_path)})
        assert status == 400 and "no adapter_config.json" in body
        status, body = post("/v1/unload_lora_adapter", {"lora_name": "b"})
        assert status == 200, body
        with pytest.raises(openai.NotFoundError, match="'b' does not exist"):
            client.completions.create(model="b", prompt=PROMPTS[0], max_tokens=2)
        chat = client.chat.completions.create(model="a", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert chat.choices[0].finish_reason in ("stop", "length")

    with server_process("--model", base, "--attention-backend", "torch", "--enable-lora") as server:
        status, _ = server.request("POST", "/v1/load_lora_adapter", json.dumps({"lora_name": "b", "lora_path": adapters["b"]}).encode(),
                                   {"Content-Type": "application/json"})
        assert status == 404  # no operator flag: no route


def test_smollm2_float32_with_two_adapters_equals_peft(tmp_path_factory):
    """SmolLM2-135M in float32 (the embedded GGUF, dequantized by transformers and
    saved as safetensors), with two random adapters: a mixed batch's greedy tokens
    equal transformers + PEFT's."""
    from transformers import AutoTokenizer

    base = smollm2_float32(tmp_path_factory.mktemp("smollm2-f32") / "base")
    root = Path(base).parent
    a = make_adapter(base, root / "a", TARGETS["a"], seed=21, rank=8)
    b = make_adapter(base, root / "b", TARGETS["b"], seed=22, rank=16)
    tokenizer = AutoTokenizer.from_pretrained(base)
    prompts = [tokenizer.encode(text) for text in ("The capital of France is", "def fibonacci(n):", "Once upon a time")]
    names = ["a", "b", None, "b", "a", None]
    batch = prompts + prompts
    with LLM(base, attention_backend="torch", dtype="float32", enable_lora=True, max_loras=2,
             lora_modules={"a": a, "b": b}) as llm:
        outs = llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True), lora_request=names)
    want = {name: peft_reference(base, path, prompts, eos_token_id=None) for name, path in (("a", a), ("b", b), (None, None))}
    for out, prompt, name in zip(outs, batch, names):
        assert out.outputs[0].token_ids == want[name][prompts.index(prompt)][0], (name, prompt)
    assert want["a"] != want[None] and want["b"] != want[None]


def test_native_fused_decode_computes_the_adapters_too(base, adapters, references):
    """With the default (native) backend a pure-decode step runs the whole-stack fused
    kernel; with adapter rows it passes each row's slot, and the kernel adds the
    adapters (the gathered rows through two GEMMs): tokens and logprobs equal PEFT's."""
    pytest.importorskip("pyagent_native")
    with LLM(base, enable_lora=True, max_loras=2, max_lora_rank=8, lora_modules={"a": adapters["a"]},
             engine_process=False) as llm:
        assert llm.engine.core.attention_backend == "native"
        base_only = llm.generate(PROMPTS, GREEDY)
        model = llm.engine.core.model
        fused = model._fused
        assert fused and fused.supports_lora
        calls = []

        class Spy:
            supports_lora = True

            def __call__(self, *args, **kwargs):
                done = fused(*args, **kwargs)
                calls.append((kwargs.get("lora_slots") is not None, done))
                return done

        model._fused = Spy()
        llm.engine.add_lora("b", adapters["b"])
        names = ["a", None, "b", "a"]
        mixed = llm.generate(PROMPTS, GREEDY, lora_request=names)
    assert (True, True) in calls, "a decode step with adapter rows ran the fused kernel"
    for out, want in zip(base_only, references[None]):
        assert _tokens_and_logprobs(out)[0] == want[0]
    for out, name, i in zip(mixed, names, range(4)):
        tokens, logprobs = _tokens_and_logprobs(out)
        assert tokens == references[name][i][0], name
        assert logprobs == pytest.approx(references[name][i][1], abs=1e-4)


def test_data_parallel_replicas_each_serve_the_adapters(base, adapters, references):
    """Two replicas: adapters of --lora-modules and one loaded at run time reach both
    (requests spread over them give PEFT's tokens)."""
    with LLM(base, attention_backend="torch", data_parallel_size=2, data_parallel_routing="round_robin", engine_process=True,
             enable_lora=True, max_loras=2, max_lora_rank=8, lora_modules={"a": adapters["a"]}) as llm:
        llm.engine.add_lora("b", adapters["b"])
        names = ["a", "b", None, "a", "b", None, "a", "b"]
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
        outs = llm.generate(prompts, GREEDY, lora_request=names)
    for out, prompt, name in zip(outs, prompts, names):
        assert _tokens_and_logprobs(out)[0] == references[name][PROMPTS.index(prompt)][0], (name, prompt)


def test_a_fused_layer_adapted_whole_or_by_part_computes_the_same_in_both_layouts():
    """A q/k/v layer adapted part by part, or whole (a checkpoint that fuses it, as
    Phi-3's qkv_proj): the block-diagonal B the torch op reads and the per-part B the
    fused decode reads both give x @ A^T @ B^T."""
    from pyagent_framework.engine.lora import LoRALinear, LoRAState, LoRAWeights

    torch.manual_seed(0)
    parts = [(0, 8), (8, 4), (12, 4)]
    layer = LoRALinear(torch.nn.Linear(6, 16, bias=False), 6, 16, parts, slots=2, max_rank=4,
                       state=LoRAState(LayerOps()), dtype=torch.float32, device="cpu")
    x = torch.randn(3, 6)
    whole_a, whole_b = torch.randn(3, 6), torch.randn(16, 3)
    by_part = [(offset, LoRAWeights(torch.randn(2, 6), torch.randn(rows, 2))) for offset, rows in parts]
    layer.set_slot(0, [(0, LoRAWeights(whole_a, whole_b))])
    layer.set_slot(1, by_part)
    want = {0: x @ whole_a.T @ whole_b.T,
            1: torch.cat([x @ w.a.T @ w.b.T for _, w in by_part], dim=1)}
    for slot in (0, 1):
        block = x @ layer.lora_a[slot].T @ layer.lora_b[slot].T
        mids = x @ layer.lora_a[slot].T
        compact = torch.cat([mids[:, p * 4 : (p + 1) * 4] @ layer.lora_b_parts[slot, offset : offset + rows].T
                             for p, (offset, rows) in enumerate(parts)], dim=1)
        torch.testing.assert_close(block, want[slot])
        torch.testing.assert_close(compact, want[slot])
