
from pyagent_framework import registries
from pyagent_framework.testing.parsers import CharTokenizer, ReasoningParserContract

OPENED = "<|begin▁of▁sentence|><｜User｜>What is 17 * 23?<｜Assistant｜><think>\n"

SAMPLES = [
    "Okay, 17 * 23. 17 * 20 = 340, 17 * 3 = 51, so 391.\n</think>\n\n17 × 23 = **391**.",
    "<think>\nThe user greets me in French; answer in French.\n</think>\n\nBonjour ! Comment puis-je vous aider ?",
    "<think>\n\n</think>\n\nHello!",
    "Let me think: 東京 is Tokyo 🗼, and the\u00a0capital.\n</think>\n\n東京は日本の首都です。",
    "Hmm, the user asks about </thi tags. A partial tag is not a tag.\n</think>\n\nUse `</think>` to close.",
    "Still thinking about this long problem, step one, step two",  # cut off by max_tokens
    "Reasoning.</think>Answer right after the tag.</think> and a stray tag in the answer.",
    "   \n  ",
]


def make(prompt: str = OPENED, request=None):
    tokenizer = CharTokenizer()
    parser = registries.reasoning_parsers.load("deepseek_r1")(tokenizer)
    parser.prepare(tokenizer.encode(prompt), request)
    return parser


def split(text: str, prompt: str = OPENED):
    result = make(prompt).extract(text)
    return result.reasoning_content, result.content


class TestDeepSeekR1Contract(ReasoningParserContract):
    parser_name = "deepseek_r1"
    samples = SAMPLES
    pieces = ["<think>", "</think>", "</think", "<th", "\n", "\n\n", " ", "Answer", "é🙂", "<", ">"]
    prompts = ["", "<|im_start|>assistant\n<think>\n", OPENED]


def test_reasoning_then_answer():
    assert split(SAMPLES[0]) == ("Okay, 17 * 23. 17 * 20 = 340, 17 * 3 = 51, so 391.", "17 × 23 = **391**.")


def test_opening_tag_in_the_output_is_dropped():
    assert split(SAMPLES[1]) == (
        "The user greets me in French; answer in French.",
        "Bonjour ! Comment puis-je vous aider ?",
    )
    assert split("\n <think>x</think>y") == ("x", "y")


def test_opening_tag_later_in_the_reasoning_is_kept():
    assert split("a <think> b</think>c") == ("a <think> b", "c")


def test_empty_reasoning_is_none():
    assert split(SAMPLES[2]) == (None, "Hello!")
    assert split("</think>Hi") == (None, "Hi")


def test_unicode():
    assert split(SAMPLES[3]) == ("Let me think: 東京 is Tokyo 🗼, and the\u00a0capital.", "東京は日本の首都です。")


def test_partial_tags_are_text():
    assert split(SAMPLES[4]) == (
        "Hmm, the user asks about </thi tags. A partial tag is not a tag.",
        "Use `</think>` to close.",
    )


def test_cut_off_is_all_reasoning():
    assert split(SAMPLES[5]) == (SAMPLES[5], None)
    assert split("Thinking...\n</thi") == ("Thinking...\n</thi", None)
    assert split("") == (None, None)
    assert split(SAMPLES[7]) == (None, None)


def test_answer_after_the_first_end_tag_is_verbatim():
    assert split(SAMPLES[6]) == ("Reasoning.", "Answer right after the tag.</think> and a stray tag in the answer.")


def test_prompt_does_not_matter():
    for text in SAMPLES:
        assert split(text, "") == split(text, OPENED)


def test_reasoning_streams_at_once():
    parser = make()
    text = ""
    sent = []
    for piece in ["Okay", ",", " so", " 2", "+2", ".\n", "</", "think", ">", "\n\n", "4"]:
        previous, text = text, text + piece
        delta = parser.extract_streaming(previous, text, piece, [], [], [])
        sent.append(None if delta is None else (delta.reasoning_content, delta.content))
    assert sent == [
        ("Okay", None), (",", None), (" so", None), (" 2", None), ("+2", None), (".", None),
        None, None, None, None, (None, "4"),
    ]
    assert parser.finish_streaming(text) is None


def test_is_reasoning_end_on_char_ids():
    ids = [ord(c) for c in SAMPLES[0]]
    end = SAMPLES[0].index("</think>")
    assert not make().is_reasoning_end([])
    assert not make().is_reasoning_end(ids[: end + len("</think>") - 1])
    assert make().is_reasoning_end(ids[: end + len("</think>")])
    assert make().is_reasoning_end(ids)
    assert not make().is_reasoning_end([ord(c) for c in SAMPLES[5]])


def test_is_reasoning_end_step_by_step():
    """One call per decode step, as the engine makes them; and steps of several ids."""
    text = "<think>\nReasoning about </thi and </ tags.\n</think>\n\nAnswer"
    ids = [ord(c) for c in text]
    end = text.index("</think>") + len("</think>")
    for step in (1, 2, 3, 5, 8, 13):
        parser = make()
        seen = [parser.is_reasoning_end(ids[:n]) for n in range(0, len(ids) + 1, step)]
        expected = [n >= end for n in range(0, len(ids) + 1, step)]
        assert seen == expected, step
    # A shorter output than last time starts over.
    parser = make()
    assert parser.is_reasoning_end(ids)
    assert not parser.is_reasoning_end(ids[:5])
