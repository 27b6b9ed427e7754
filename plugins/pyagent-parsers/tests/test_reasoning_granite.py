
from pyagent_framework import registries
from pyagent_framework.testing.parsers import CharTokenizer, ReasoningParserContract

THINKING = {"chat_template_kwargs": {"thinking": True}}

SAMPLES = [
    "Here is my thought process:\nThe user wants the boiling point of water at sea level. It is 100 °C.\n"
    "Here is my response:\nWater boils at 100 °C (212 °F) at sea level.",
    "Here's my thought process:\n1. Parse the question.\n2. Answer briefly.\n\nHere's my response:\nDone.",
    "Here is my thought process:\n東京 is the capital 🗼; answer in Japanese.\nHere is my response:\n首都は東京です。",
    "Here is my thought process:\nStill weighing the options when the output was cut",  # cut off
    "The capital of France is Paris.",  # thinking off: no header
    "Here is my response: a header without a thought process first is just text.",
    "  \nHere is my thought process:\nHere is my response:\nNothing to think about.",
    "Here is my thought process:\nMixing Here's my response: and Here is my response: later.",
]


def make(request=None):
    tokenizer = CharTokenizer()
    parser = registries.reasoning_parsers.load("granite")(tokenizer)
    parser.prepare(tokenizer.encode("<|start_of_role|>assistant<|end_of_role|>"), request)
    return parser


def split(text: str, request=None):
    result = make(request).extract(text, request)
    return result.reasoning_content, result.content


class TestGraniteContract(ReasoningParserContract):
    parser_name = "granite"
    samples = SAMPLES
    pieces = [
        "Here is my thought process:",
        "Here's my thought process:",
        "Here is my response:",
        "Here's my response:",
        "Here is my",
        "Here's",
        "Here",
        "\n",
        " ",
        "response:",
        "🙂",
    ]


class TestGraniteThinkingContract(TestGraniteContract):
    request = THINKING


def test_thought_process_then_response():
    assert split(SAMPLES[0]) == (
        "The user wants the boiling point of water at sea level. It is 100 °C.",
        "Water boils at 100 °C (212 °F) at sea level.",
    )


def test_heres_variants():
    assert split(SAMPLES[1]) == ("1. Parse the question.\n2. Answer briefly.", "Done.")
    assert split("Here's my thought process: a Here is my response: b") == ("a", "b")
    assert split("Here is my thought process: a Here's my response: b") == ("a", "b")


def test_unicode():
    assert split(SAMPLES[2]) == ("東京 is the capital 🗼; answer in Japanese.", "首都は東京です。")


def test_no_response_header_is_all_reasoning():
    assert split(SAMPLES[3]) == ("Still weighing the options when the output was cut", None)
    assert split("Here is my thought process:") == (None, None)
    assert split("Here is my thought process: hmm Here is my resp") == ("hmm Here is my resp", None)


def test_no_thought_process_header_is_all_content():
    for text in (SAMPLES[4], SAMPLES[5], "Here is my thought", " x Here is my thought process: y", "  "):
        assert split(text) == (None, text)
        assert split(text, THINKING) == (None, text)


def test_empty_reasoning():
    assert split(SAMPLES[6]) == (None, "Nothing to think about.")


def test_first_response_header_ends_the_reasoning():
    assert split(SAMPLES[7]) == ("Mixing", "and Here is my response: later.")


def test_streaming_holds_only_partial_headers():
    parser = make(THINKING)
    text = ""
    sent = []
    pieces = ["Here", " is", " my", " thought", " process", ":", "\n", "Think", ".\n", "Here", " is my", " response", ":", "\n", "Ok"]
    for piece in pieces:
        previous, text = text, text + piece
        delta = parser.extract_streaming(previous, text, piece, [], [], [])
        sent.append(None if delta is None else (delta.reasoning_content, delta.content))
    assert sent == [None] * 7 + [("Think", None), (".", None)] + [None] * 5 + [(None, "Ok")]
    assert parser.finish_streaming(text) is None


def test_is_reasoning_end_with_thinking_is_true_at_once():
    """The output, not the prompt, opens Granite's reasoning: a grammar cannot wait
    for the header without letting tokens escape it, so it applies at once."""
    parser = make(THINKING)
    assert parser.is_reasoning_end([])
    assert parser.is_reasoning_end([ord(c) for c in "Here is my thought process:\nhm"])


def test_is_reasoning_end_without_thinking_is_true_at_once():
    assert make().is_reasoning_end([])
    assert make({"chat_template_kwargs": {"thinking": False}}).is_reasoning_end([])
