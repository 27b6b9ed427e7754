"""The front end's output parsers: built by name, once per sample, by the output
processor; streamed deltas join to the whole message; a parser that raises fails its
request only; an unknown name is the request's error."""

from __future__ import annotations

import itertools
import json

import pytest

from pyagent_framework import LLM, OutputParsers, SamplingParams, registries
from pyagent_framework.engine.errors import InvalidRequestError
from pyagent_framework.engine.output_parsers import NAMED_TOOL_CALL
from pyagent_framework.interfaces import ReasoningParser, ToolParser
from pyagent_framework.types import DeltaMessage, ExtractedToolCalls, ReasoningSplit, ToolCall, ToolCallDelta
from tests.tiny_models import tiny_checkpoint

PROMPT = "The quick brown fox"
TOOLS = {"tools": [{"type": "function", "function": {"name": "echo", "parameters": {"type": "object"}}}]}
built = itertools.count()  # parser instances made, across both test classes


class EchoTool(ToolParser):
    """Any answer text is one call of ``echo`` with ``{"text": ...}``."""

    def __init__(self, tokenizer=None):
        super().__init__(tokenizer)
        next(built)

    def extract(self, text, request=None):
        assert request == TOOLS
        if not text:
            return ExtractedToolCalls(content=None)
        return ExtractedToolCalls(content=None, tool_calls=[ToolCall(id="call-0", name="echo", arguments=json.dumps({"text": text}))])

    def extract_streaming(self, previous_text, current_text, delta_text, previous_ids, current_ids, delta_ids, request=None):
        first = not previous_text
        fragment = ('{"text": "' if first else "") + json.dumps(delta_text)[1:-1]
        return DeltaMessage(tool_calls=[ToolCallDelta(index=0, id="call-0" if first else None, name="echo" if first else None, arguments=fragment)])

    def finish_streaming(self, current_text, request=None):
        return DeltaMessage(tool_calls=[ToolCallDelta(index=0, arguments='"}')]) if current_text else None


class FirstThreeReason(ReasoningParser):
    """The first three characters are reasoning, the rest the answer."""

    def __init__(self, tokenizer=None):
        super().__init__(tokenizer)
        next(built)

    def extract(self, text, request=None):
        return ReasoningSplit(reasoning_content=text[:3] or None, content=text[3:] or None)

    def extract_streaming(self, previous_text, current_text, delta_text, previous_ids, current_ids, delta_ids):
        message = DeltaMessage(
            reasoning_content=current_text[:3][len(previous_text[:3]) :] or None, content=current_text[3:][len(previous_text[3:]) :] or None
        )
        return None if message.is_empty() else message

    def is_reasoning_end(self, token_ids):
        return False


class BrokenTool(EchoTool):
    def extract_streaming(self, *args):
        raise ValueError("broken on purpose")


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny"))
    names = {"echo-test": EchoTool, "broken-test": BrokenTool}
    for name, cls in names.items():
        registries.tool_parsers.register(name, cls, override=True)
    registries.reasoning_parsers.register("first-three-test", FirstThreeReason, override=True)
    yield LLM(path, kv_cache_memory="16MiB", max_model_len=128)
    for name in names:
        registries.tool_parsers.unregister(name)
    registries.reasoning_parsers.unregister("first-three-test")


def run(llm, request_id: str, params: SamplingParams, parsers: OutputParsers) -> list:
    """Every output of one request, in order."""
    engine = llm.engine
    engine.add_request(request_id, PROMPT, params, parsers=parsers)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [out for out in engine.step() if out.request_id == request_id]
    return outputs


PARSERS = OutputParsers(tool_parser="echo-test", reasoning_parser="first-three-test", request=TOOLS)


def test_streamed_message_deltas_join_to_the_whole_message_built_once_per_sample(llm):
    params = dict(max_tokens=12, temperature=0.8, seed=7, ignore_eos=True, n=3)
    before = next(built)
    [whole] = [out for out in run(llm, "whole", SamplingParams(**params), PARSERS) if out.finished]
    assert next(built) - before - 1 == 2 * 3, "one tool and one reasoning parser per sample, no more"
    streamed = run(llm, "streamed", SamplingParams(**params, output_kind="delta"), PARSERS)
    for sample in whole.outputs:
        message = sample.message
        assert message.reasoning_content == sample.text[:3] and message.content is None
        [call] = message.tool_calls
        assert json.loads(call.arguments) == {"text": sample.text[3:]}
        deltas = [o.message_delta for out in streamed for o in out.outputs if o.index == sample.index and o.message_delta]
        assert "".join(d.reasoning_content or "" for d in deltas) == message.reasoning_content
        arguments = "".join(c.arguments or "" for d in deltas for c in d.tool_calls)
        assert json.loads(arguments) == {"text": sample.text[3:]}, "the same text, whole or streamed"
        assert [c.name for d in deltas for c in d.tool_calls if c.name] == ["echo"]


def test_no_parsers_named_the_message_is_the_text(llm):
    [final] = [out for out in run(llm, "plain", SamplingParams(max_tokens=6, ignore_eos=True), OutputParsers()) if out.finished]
    sample = final.outputs[0]
    assert sample.message.content == sample.text and sample.message.reasoning_content is None and not sample.message.tool_calls


def test_a_tool_call_forced_by_a_grammar_is_read_as_a_call(llm):
    spec = {"json": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}}
    params = SamplingParams(max_tokens=30, temperature=0, structured_outputs=spec)
    request = {**TOOLS, "tool_choice": {"type": "function", "function": {"name": "echo"}}}
    [final] = [out for out in run(llm, "named", params, OutputParsers(tool_parser=NAMED_TOOL_CALL, request=request)) if out.finished]
    sample = final.outputs[0]
    [call] = sample.message.tool_calls
    assert call.name == "echo" and call.arguments == sample.text and set(json.loads(call.arguments)) == {"a"}


def test_a_parser_that_raises_fails_only_its_request(llm):
    engine = llm.engine
    stream = SamplingParams(max_tokens=8, ignore_eos=True, output_kind="delta")
    engine.add_request("broken", PROMPT, stream, parsers=OutputParsers(tool_parser="broken-test", request=TOOLS))
    engine.add_request("fine", PROMPT, stream, parsers=PARSERS)
    finals = {}
    while engine.has_unfinished_requests():
        finals.update((out.request_id, out) for out in engine.step() if out.finished)
    broken, fine = finals["broken"], finals["fine"]
    assert broken.outputs[0].finish_reason == "error" and broken.error_kind == "internal"
    assert "tool_parser 'broken-test'" in broken.error and "extract_streaming" in broken.error
    assert fine.error is None and fine.outputs[0].finish_reason == "length"
    assert not engine.has_unfinished_requests()


def test_an_unknown_parser_is_the_requests_error_and_nothing_is_queued(llm):
    engine = llm.engine
    for parsers, param in [
        (OutputParsers(tool_parser="nope"), "parsers.tool_parser"),
        (OutputParsers(reasoning_parser="nope"), "parsers.reasoning_parser"),
    ]:
        with pytest.raises(InvalidRequestError, match="nope") as info:
            engine.add_request("unknown", PROMPT, SamplingParams(max_tokens=4), parsers=parsers)
        assert info.value.param == param
        assert not engine.has_unfinished_requests()
    assert run(llm, "after", SamplingParams(max_tokens=4, ignore_eos=True), PARSERS)[-1].outputs[0].finish_reason == "length"


def test_llm_chat_reads_each_sample_with_the_parsers_it_names(llm):
    conversation = [{"role": "user", "content": "Say something."}]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    [out] = llm.chat(
        conversation, params, chat_template="chatml", tools=TOOLS["tools"], tool_parser="echo-test", reasoning_parser="first-three-test"
    )
    sample = out.outputs[0]
    assert sample.message.reasoning_content == sample.text[:3]
    [call] = sample.message.tool_calls
    assert json.loads(call.arguments) == {"text": sample.text[3:]}
    [plain] = llm.chat(conversation, params, chat_template="chatml")
    assert plain.outputs[0].message is None, "no parsers named: no message"
