"""Engine behaviour per request: bad input, sampling options, stop conditions, n,
logprobs, abort, streaming — on a tiny random Llama checkpoint."""

from __future__ import annotations

import math

import pytest

from pyagent_framework import LLM, SamplingParams
from pyagent_framework.engine.errors import ConfigError, InvalidRequestError
from tests.tiny_models import hf_greedy, hf_model, tiny_checkpoint

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def llm(path):
    return LLM(path, kv_cache_memory="64MiB", max_model_len=128)


BAD_REQUESTS = [
    ("", SamplingParams(), "prompt"),
    ([], SamplingParams(), "prompt"),
    ([5] * 128, SamplingParams(), "prompt"),  # no room left in the 128-token window
    ([99999], SamplingParams(), "prompt"),
    (PROMPT, SamplingParams(max_tokens=0), "max_tokens"),
    (PROMPT, SamplingParams(max_tokens=-3), "max_tokens"),
    (PROMPT, SamplingParams(temperature=-0.1), "temperature"),
    (PROMPT, SamplingParams(temperature=math.nan), "temperature"),
    (PROMPT, SamplingParams(top_p=0.0), "top_p"),
    (PROMPT, SamplingParams(top_p=1.5), "top_p"),
    (PROMPT, SamplingParams(n=17), "n"),
    (PROMPT, SamplingParams(n=10**6), "n"),
    (PROMPT, SamplingParams(logprobs=21), "logprobs"),
    (PROMPT, SamplingParams(stop=["x"] * 17), "stop"),
    (PROMPT, SamplingParams(stop="y" * 5000), "stop"),
    (PROMPT, SamplingParams(logit_bias={100000: 1.0}), "logit_bias"),
    (PROMPT, SamplingParams(min_tokens=5, max_tokens=2), "min_tokens"),
    (PROMPT, SamplingParams(top_k=-2), "top_k"),
]


@pytest.mark.parametrize("prompt, params, param", BAD_REQUESTS)
def test_bad_request_names_the_parameter_and_engine_keeps_serving(llm, prompt, params, param):
    with pytest.raises(InvalidRequestError) as info:
        llm.engine.add_request("bad", prompt, params)
    assert info.value.param == param
    assert param.split("_")[0] in str(info.value)
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(InvalidRequestError):  # the same through the public API
        llm.generate([prompt] if isinstance(prompt, list) else prompt, params)
    [out] = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 3


@pytest.mark.parametrize(
    "args, field",
    [
        ({"model": "/no/such/model"}, "model"),
        ({"attention_backend": "flash"}, "attention_backend"),
        ({"quantization": "int3"}, "quantization"),
        ({"tokenizer": "/no/such/tokenizer"}, "tokenizer"),
        ({"kv_cache_memory": "lots"}, "kv_cache_memory"),
        ({"max_num_seqs": 0}, None),
        ({"chat_template": "nope"}, "chat_template"),
        ({"chat_template": "/no/such/template.jinja"}, "chat_template"),
        ({"grammar_backend": "xgrammar-typo"}, "grammar_backend"),
        ({"kv_connector": "no-such-connector"}, "kv_connector"),
    ],
)
def test_bad_engine_options_name_the_field(path, args, field):
    args = {"model": path, **args}
    with pytest.raises(ConfigError) as info:
        LLM(**args)
    if field:
        assert info.value.field == field
    assert (field or "max_num_seqs") in str(info.value)


def test_stats_name_the_backends_that_run(path):
    stats = LLM(path, attention_backend="torch", quantization="none", kv_cache_memory="16MiB").engine.stats()
    assert (stats["attention_backend"], stats["quantization"]) == ("torch", "none")


def test_unknown_backend_lists_the_available_ones(path):
    with pytest.raises(ConfigError, match=r"\(available: [^)]*\btorch\b"):
        LLM(path, attention_backend="flash")


def test_max_tokens_min_tokens_and_ignore_eos(llm):
    [out] = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].finish_reason == "length"
    eos = sorted(llm.engine.eos_token_ids)[0]
    # A huge EOS bias: EOS comes first unless min_tokens holds it back.
    [forced] = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=8, logit_bias={eos: 50.0}))
    assert forced.outputs[0].token_ids == [eos] and forced.outputs[0].finish_reason == "stop"
    [held] = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=8, min_tokens=3, logit_bias={eos: 50.0}))
    held_ids = held.outputs[0].token_ids
    assert len(held_ids) == 4 and held_ids[3] == eos and eos not in held_ids[:3]


def test_stop_strings_cut_exactly_and_never_leak_while_streaming(llm):
    base = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    [full] = llm.generate(PROMPT, base)
    text = full.outputs[0].text
    assert len(text) > 6
    stop = text[3:6]  # spans wherever the token boundaries fall
    cut = text[: text.find(stop)]
    streamed = [o.outputs[0].text for o in llm.stream(PROMPT, base.replace(stop=[stop]))]
    assert streamed[-1] == cut
    assert all(cut.startswith(s) and stop not in s for s in streamed)
    assert llm.generate(PROMPT, base.replace(stop=[stop]))[0].outputs[0].stop_reason == stop
    kept = llm.generate(PROMPT, base.replace(stop=[stop], include_stop_str_in_output=True))[0].outputs[0].text
    assert kept == cut + stop


def test_stop_token_ids(llm):
    base = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    [full] = llm.generate(PROMPT, base)
    tokens = full.outputs[0].token_ids
    [stopped] = llm.generate(PROMPT, base.replace(stop_token_ids=[tokens[2]]))
    first = tokens.index(tokens[2])
    assert stopped.outputs[0].token_ids == tokens[: first + 1]
    assert stopped.outputs[0].stop_reason == tokens[2] and stopped.outputs[0].finish_reason == "stop"
    # The stopping token is not text (as with end-of-sequence), special tokens kept or
    # not, unless include_stop_str_in_output asks for it.
    decode = llm.engine.tokenizer.decode
    for keep_special in (True, False):
        params = base.replace(stop_token_ids=[tokens[2]], skip_special_tokens=not keep_special)
        [out] = llm.generate(PROMPT, params)
        assert out.outputs[0].text == decode(tokens[:first], skip_special_tokens=not keep_special)
        [out] = llm.generate(PROMPT, params.replace(include_stop_str_in_output=True))
        assert out.outputs[0].text == decode(tokens[: first + 1], skip_special_tokens=not keep_special)


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(llm):
    seeded = SamplingParams(temperature=1.0, max_tokens=10, seed=42, ignore_eos=True)
    [alone] = llm.generate(PROMPT, seeded)
    outs = llm.generate(["Other words here", PROMPT, "A third prompt"], [SamplingParams(temperature=1.0, max_tokens=7), seeded, SamplingParams(max_tokens=3)])
    assert outs[1].outputs[0].token_ids == alone.outputs[0].token_ids
    [other_seed] = llm.generate(PROMPT, seeded.replace(seed=43))
    assert other_seed.outputs[0].token_ids != alone.outputs[0].token_ids


def test_n_samples_differ_and_are_indexed(llm):
    [out] = llm.generate(PROMPT, SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=1, ignore_eos=True))
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_logprobs_and_prompt_logprobs_match_transformers(llm, path):
    ids = llm.tokenizer.encode(PROMPT)
    tokens, logprobs = hf_greedy(hf_model(path), ids, 4, eos_token_id=None)
    [out] = llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, prompt_logprobs=2, ignore_eos=True))
    completion = out.outputs[0]
    assert completion.token_ids == tokens
    for step, token, expected in zip(completion.logprobs, tokens, logprobs):
        assert step[token].logprob == pytest.approx(expected, abs=1e-4)
        assert step[token].rank == 1
        assert len(step) == 3  # the chosen token is also the best one
        assert sorted(e.rank for e in step.values()) == [1, 2, 3]
    assert completion.cumulative_logprob == pytest.approx(sum(logprobs), abs=1e-3)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    import torch

    with torch.no_grad():
        reference = torch.log_softmax(hf_model(path)(torch.tensor([ids])).logits[0].float(), -1)
    for position in range(1, len(ids)):
        entry = out.prompt_logprobs[position][ids[position]]
        assert entry.logprob == pytest.approx(float(reference[position - 1, ids[position]]), abs=1e-4)


@pytest.mark.in_process
def test_abort_frees_blocks_and_reports_abort(llm):
    engine = llm.engine
    free = engine.core.pool.num_free_blocks
    engine.add_request("to-abort", PROMPT, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.core.pool.num_free_blocks < free
    out = engine.abort_request("to-abort")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert engine.core.pool.num_free_blocks == free
    assert engine.abort_request("to-abort") is None


def test_stream_pieces_concatenate_to_the_final_text(llm):
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    texts = [o.outputs[0].text for o in llm.stream(PROMPT, params)]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    [final] = llm.generate(PROMPT, params)
    assert texts[-1] == final.outputs[0].text == llm.tokenizer.decode(final.outputs[0].token_ids)


def test_metrics_are_ordered(llm):
    [out] = llm.generate(PROMPT, SamplingParams(max_tokens=3))
    m = out.metrics
    assert m.arrival_time <= m.first_token_time <= m.finish_time


def test_chat_uses_the_tokenizer_template(llm):
    messages = [{"role": "user", "content": "hi"}]
    rendered = llm.engine.render_chat(messages)
    assert rendered == "<|user|>hi\n<|assistant|>"
    [out] = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert out.prompt_token_ids == llm.tokenizer.encode(rendered, add_special_tokens=False) == llm.encode_chat(messages)


def test_named_chat_template_replaces_the_tokenizers(path):
    llm = LLM(path, kv_cache_memory="16MiB", max_model_len=128, chat_template="chatml")
    rendered = llm.engine.render_chat([{"role": "user", "content": "hi"}])
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_chat_template_from_a_file(path, tmp_path):
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}>")
    llm = LLM(path, kv_cache_memory="16MiB", max_model_len=128, chat_template=str(template))
    assert llm.engine.render_chat([{"role": "user", "content": "hi"}]) == "[user] hi\n>"


def test_a_bad_prompt_in_a_batch_queues_none_of_them(llm):
    with pytest.raises(InvalidRequestError) as info:
        llm.generate([PROMPT, ""], SamplingParams(max_tokens=2))
    assert info.value.param == "prompt"
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.in_process
def test_leaving_a_stream_early_aborts_its_requests(llm):
    free = llm.engine.core.pool.num_free_blocks
    stream = llm.stream([PROMPT, "def add"], SamplingParams(max_tokens=50, ignore_eos=True))
    next(stream)
    stream.close()
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.core.pool.num_free_blocks == free


@pytest.mark.parametrize("stop", [None, [" the", "a"]])
def test_delta_outputs_join_to_the_cumulative_ones(llm, stop):
    """Each delta output carries what is new; joined, the deltas of every sample are
    its whole output (text, token ids, logprobs), stop strings withheld alike."""
    base = SamplingParams(n=2, temperature=0.9, seed=3, max_tokens=24, logprobs=1, stop=stop)
    [whole] = llm.generate(PROMPT, base)
    joined = {i: {"text": "", "ids": [], "logprobs": []} for i in range(2)}
    finals = {}
    for out in llm.stream(PROMPT, base.replace(output_kind="delta")):
        for o in out.outputs:
            joined[o.index]["text"] += o.text
            joined[o.index]["ids"] += o.token_ids
            joined[o.index]["logprobs"] += o.logprobs
            if o.finish_reason is not None:
                finals[o.index] = (o.finish_reason, o.stop_reason)
    for o in whole.outputs:
        assert joined[o.index]["text"] == o.text and joined[o.index]["ids"] == o.token_ids
        assert [sorted(e) for e in joined[o.index]["logprobs"]] == [sorted(e) for e in o.logprobs]
        assert finals[o.index] == (o.finish_reason, o.stop_reason)


def test_final_only_outputs_come_once(llm):
    outs = list(llm.stream([PROMPT, "def add"], SamplingParams(max_tokens=6, output_kind="final_only")))
    assert len(outs) == 2 and all(out.finished for out in outs)
    with pytest.raises(InvalidRequestError) as info:
        list(llm.stream(PROMPT, SamplingParams(output_kind="sometimes")))
    assert info.value.param == "output_kind"
