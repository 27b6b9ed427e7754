"""The conformance kits of ``pyagent_framework.testing``: each passes on the kernel's
built-in entries (the plugins' own tests run them on theirs) and fails, showing
expected and actual, on a deliberately broken entry."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F

from pyagent_framework import registries, scaffold
from pyagent_framework.builtins.lru import LRUPolicy
from pyagent_framework.interfaces import EvictionPolicy, Proposer, Quantizer, ToolParser, WeightFormat
from pyagent_framework.paged_attention import TorchAttention
from pyagent_framework.testing import check_registration
from pyagent_framework.testing.attention import AttentionBackendContract, check_against_reference, make_case
from pyagent_framework.testing.chat_template import ChatTemplateContract, check_renders
from pyagent_framework.testing.eviction import EvictionPolicyContract, check_cost, check_walk
from pyagent_framework.testing.logits_processor import LogitsProcessorContract, check_processor
from pyagent_framework.testing.parsers import check_tool_streaming
from pyagent_framework.testing.proposer import check_engine_walk
from pyagent_framework.testing.quantizer import QuantizerContract, check_linear
from pyagent_framework.testing.tokenizer import check_every_id, check_incremental_decode, check_round_trips
from pyagent_framework.testing.weights import WeightFormatContract, check_reads, check_refuses
from pyagent_framework.types import Draft, ExtractedToolCalls, DeltaMessage


def fails(check, *args, **kwargs) -> str:
    """The message of the AssertionError ``check`` must raise."""
    with pytest.raises(AssertionError) as info:
        check(*args, **kwargs)
    return str(info.value)


# ---------------------------------------------------------------------- registration


@pytest.mark.parametrize("kind, name", [
    ("eviction_policy", "lru"), ("eviction_policies", "lru"), ("quantizer", "none"), ("quantizer", "fp32"),
    ("attention_backend", "torch"), ("weight_format", "dummy"), ("logits_processor", "min_length"),
])
def test_check_registration_passes_on_the_builtins(kind, name):
    loaded = check_registration(kind, name, "pyagent-framework")
    assert loaded is registries.get(kind).load(name)


def test_check_registration_shows_what_is_wrong():
    message = fails(check_registration, "eviction_policy", "lru", "pyagent-fifo")
    assert "expected: pyagent-fifo" in message and "actual:   pyagent-framework" in message
    assert "did you mean 'lru'" in fails(check_registration, "eviction_policy", "lur", "pyagent-framework")
    assert "unknown kind" in fails(check_registration, "eviction_polcy", "lru", "pyagent-framework")
    message = fails(check_registration, "eviction_policy", "lru", "pyagent-framework", target="x.y:LRU")
    assert "expected: x.y:LRU" in message and "actual:   pyagent_framework.builtins.lru:LRUPolicy" in message


def test_check_registration_reports_an_entry_that_does_not_load():
    registry = registries.eviction_policies
    registry.register("kit-broken", "tests.test_testing_kits:NotAPolicy")
    try:
        message = fails(check_registration, "eviction_policy", "kit-broken", None)
        assert "does not load" in message and "evict" in message
    finally:
        registry.unregister("kit-broken")


class NotAPolicy:
    def insert(self, block):
        pass


# ---------------------------------------------------------------------- eviction policies


class TestLRUContract(EvictionPolicyContract):
    policy_name = "lru"


class ScanningFIFO(EvictionPolicy):
    """FIFO whose evict scans every cached block: O(n) (the old scaffold)."""

    def __init__(self, capacity=0):
        self._order = OrderedDict()

    def insert(self, block):
        self._order.pop(block, None)
        self._order[block] = False

    def touch(self, block):
        self._order[block] = False

    def release(self, block):
        self._order[block] = True

    def remove(self, block):
        self._order.pop(block, None)

    def evict(self):
        for block, evictable in self._order.items():
            if evictable:
                del self._order[block]
                return block
        raise LookupError("no evictable block")

    def __len__(self):
        return sum(self._order.values())


class OldestCachedFirst(LRUPolicy):
    """Evicts the block cached earliest, in use or not (counts evictable blocks right)."""

    def __init__(self, capacity=0):
        super().__init__(capacity)
        self._cached = OrderedDict()

    def insert(self, block):
        super().insert(block)
        self._cached[block] = None

    def remove(self, block):
        super().remove(block)
        self._cached.pop(block, None)

    def evict(self):
        if not self._evictable:
            raise LookupError("no evictable block")
        block, _ = self._cached.popitem(last=False)
        self._evictable.pop(block, None)
        return block


class CountsEverything(LRUPolicy):
    def __len__(self):
        return len(self._evictable) + 1 if self._evictable else 0


class EmptyReturnsNone(LRUPolicy):
    def evict(self):
        return super().evict() if self._evictable else None


def test_an_o_n_fifo_fails_the_cost_bound():
    check_walk(ScanningFIFO)  # it is correct...
    message = fails(check_cost, ScanningFIFO, name="scanning-fifo")  # ...but slow
    assert "the cost of an event grows with the pool" in message
    assert "expected: at most 8x the time at 1024 blocks" in message and "actual:" in message


def test_the_scaffolds_fifo_is_correct_and_bounded(tmp_path):
    """The eviction scaffold's FIFO (a heap with lazy deletion) passes both."""
    path = scaffold.render_plugin("pyagent-kitfifo", "eviction_policy", tmp_path)
    spec = importlib.util.spec_from_file_location("kitfifo_entry", path / "pyagent_kitfifo" / "eviction_policy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cls = next(v for v in vars(module).values() if isinstance(v, type) and issubclass(v, EvictionPolicy) and v is not EvictionPolicy)
    check_walk(cls)
    ratios = check_cost(cls)
    assert all(r < 8 for r in ratios.values())


def test_a_policy_that_evicts_a_block_in_use_fails_the_walk():
    message = fails(check_walk, OldestCachedFirst, name="oldest-cached")
    assert "eviction policy 'oldest-cached'" in message and "which is in use" in message
    assert "expected: one of {" in message and "actual:" in message
    assert "last events, oldest first:" in message and "evict() -> " in message


def test_a_wrong_len_and_a_victim_from_nothing_fail_the_walk():
    message = fails(check_walk, CountsEverything)
    assert "len(policy) must be the number of evictable blocks" in message and "expected:" in message
    message = fails(check_walk, EmptyReturnsNone)
    assert "evict() returned a block while none was evictable" in message and "expected: LookupError" in message


# ---------------------------------------------------------------------- tool parsers


class ShoutingParser(ToolParser):
    """Whole text as content, but streams it upper-cased: streamed != whole."""

    def extract(self, text, request=None):
        return ExtractedToolCalls(content=text or None)

    def extract_streaming(self, previous_text, current_text, delta_text, previous_ids, current_ids, delta_ids, request=None):
        return DeltaMessage(content=delta_text.upper())


def test_a_tool_parser_streaming_other_text_fails_with_both_results():
    message = fails(check_tool_streaming, lambda: ShoutingParser(None), "call me", [2, 5])
    assert "differs from extract" in message
    assert "expected (extract of the whole text): {'content': 'call me', 'calls': []}" in message
    assert "actual (the stream's deltas, joined): {'content': 'CALL ME', 'calls': []}" in message


# ---------------------------------------------------------------------- tokenizers


class ByteTokenizer:
    """Bytes 0..255, EOS 256: round-trips everything."""

    vocab_size, bos_token_id, eos_token_ids, special_token_ids, chat_template = 257, None, frozenset({256}), frozenset({256}), None

    def encode(self, text, *, add_special_tokens=True):
        return list(text.encode("utf-8"))

    def decode(self, ids, *, skip_special_tokens=True):
        data = bytes(i for i in ids if i < 256)
        tail = "" if skip_special_tokens or 256 not in ids else "</s>"
        return data.decode("utf-8", errors="replace") + tail

    def token_bytes(self, token_id):
        return bytes([token_id]) if token_id < 256 else b"</s>"


class Latin1Tokenizer(ByteTokenizer):
    def encode(self, text, *, add_special_tokens=True):
        return list(text.encode("latin-1", errors="replace"))


class StrictTokenizer(ByteTokenizer):
    def decode(self, ids, *, skip_special_tokens=True):
        return bytes(i for i in ids if i < 256).decode("utf-8")  # raises on half a character


def test_tokenizer_checks_pass_on_a_byte_tokenizer_and_fail_on_broken_ones():
    for check in (check_round_trips, check_every_id, check_incremental_decode):
        check(ByteTokenizer())
    message = fails(check_round_trips, Latin1Tokenizer())
    assert "decode(encode(text)) must give the text back" in message and "expected: 'héllo" in message
    assert "token id 128 (below vocab_size 257) must decode" in fails(check_every_id, StrictTokenizer())


# ---------------------------------------------------------------------- weight formats


LLAMA = {"architectures": ["LlamaForCausalLM"], "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
         "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 12, "max_position_embeddings": 32,
         "rms_norm_eps": 1e-6, "tie_word_embeddings": False}


@pytest.mark.skipif("LlamaForCausalLM" not in registries.model_architectures, reason="needs pyagent-hf's Llama")
class TestDummyWeightsContract(WeightFormatContract):
    format_name = "dummy"

    @pytest.fixture
    def checkpoint(self, tmp_path):
        (tmp_path / "config.json").write_text(json.dumps(LLAMA))
        return str(tmp_path)


class TwiceNamed(WeightFormat):
    def matches(self, path):
        return True

    def load_config(self, path):
        return {"architectures": ["X"]}

    def iter_weights(self, path):
        yield "a", torch.zeros(2)
        yield "a", torch.ones(2)


class CrashesOnGarbage(TwiceNamed):
    def matches(self, path):
        return path.endswith("ok")

    def load_config(self, path):
        return {"architectures": ["X"], "bytes": open(path, "rb").read()[100]}  # IndexError on a short file

    def iter_weights(self, path):
        yield "a", torch.zeros(2)


def test_weight_format_checks_fail_on_broken_formats(tmp_path):
    assert "weight 'a' was yielded twice" in fails(check_reads, TwiceNamed(), str(tmp_path))
    (tmp_path / "short").write_bytes(b"abc")
    message = fails(check_refuses, CrashesOnGarbage(), str(tmp_path / "short"))
    assert "load_config(" in message and "crashed" in message and "actual:   IndexError" in message


# ---------------------------------------------------------------------- chat templates


class TestChatMLContract(ChatTemplateContract):
    template_name = "chatml"


@pytest.mark.parametrize("name", ["llama3", "mistral", "qwen"])
def test_builtin_templates_with_tools_pass(name):
    contract = type("Contract", (ChatTemplateContract,), {"template_name": name, "supports_tools": True})()
    contract.test_renders_plain_conversations()
    contract.test_other_conversations_render_or_raise_chat_template_error()
    contract.test_tools()


def test_a_template_that_drops_the_system_prompt_fails():
    source = "{% for m in messages if m['role'] != 'system' %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    message = fails(check_renders, source, "system and user", [{"role": "system", "content": "S-1"}, {"role": "user", "content": "U-1"}])
    assert "the system message's text is missing" in message and "expected: 'S-1'" in message


def test_a_generation_prompt_that_is_not_appended_fails():
    source = "{% if add_generation_prompt %}>>{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    message = fails(check_renders, source, "one", [{"role": "user", "content": "U-1"}])
    assert "add_generation_prompt=True must only append" in message and "actual:   '>>U-1'" in message


# ---------------------------------------------------------------------- proposers


class EagerProposer(Proposer):
    """Drafts the last token 9 times, whatever the limit."""

    def __init__(self, config=None):
        pass

    def propose(self, requests):
        return [Draft([r.token_ids[-1]] * 9) for r in requests]


class OutOfVocabulary(EagerProposer):
    def propose(self, requests):
        return [Draft([10**6][: r.max_tokens]) for r in requests]


class Meddling(EagerProposer):
    def propose(self, requests):
        for r in requests:
            r.token_ids.append(0)
        return [Draft([]) for _ in requests]


class Forgetful(EagerProposer):
    def propose(self, requests):
        return [Draft([]) for _ in requests[1:]]


def test_proposer_checks_fail_on_broken_proposers():
    assert "expected: <= " in fails(check_engine_walk, EagerProposer)
    assert "draft tokens must be ids in [0, 1000)" in fails(check_engine_walk, OutOfVocabulary)
    assert "changed the token_ids" in fails(check_engine_walk, Meddling)
    message = fails(check_engine_walk, Forgetful)
    assert "one draft per request" in message and "expected:" in message and "actual:" in message


# ---------------------------------------------------------------------- attention backends


class TestTorchContract(AttentionBackendContract):
    """The reference against itself: the kit's cases run and agree."""

    backend_name = "torch"
    heads = AttentionBackendContract.heads[:2]


class SwappedHeads(TorchAttention):
    """Reads key/value head ``h % kv_heads`` instead of ``h // group``: wrong for GQA."""

    def forward(self, query, key, value, kv_cache, metadata):
        group = self.num_heads // self.num_kv_heads
        order = torch.arange(self.num_heads).view(self.num_kv_heads, group).T.reshape(-1)
        out = super().forward(query[:, order], key, value, kv_cache, metadata)
        return out[:, torch.argsort(order)]


class WritesSlotMinusOne(TorchAttention):
    """Writes slot -1 too: Python's -1 is the cache's last slot."""

    def forward(self, query, key, value, kv_cache, metadata):
        flat = kv_cache.view(2, -1, *kv_cache.shape[3:])
        flat[0, metadata.slot_mapping] = key.to(kv_cache.dtype)
        flat[1, metadata.slot_mapping] = value.to(kv_cache.dtype)
        return super().forward(query, key, value, kv_cache, metadata)


def test_attention_checks_fail_on_broken_backends():
    case = make_case("mixed", 0, 6, 2, 8, 4)
    check_against_reference(TorchAttention, case, 6, 2, 8)
    message = fails(check_against_reference, SwappedHeads, case, 6, 2, 8, label="mixed")
    assert "the output differs from the torch reference backend's" in message and "heads 6/2" in message
    case = make_case("mixed", 0, 6, 2, 8, 4, unwritten=True)
    message = fails(check_against_reference, WritesSlotMinusOne, case, 6, 2, 8)
    assert "the cache after forward differs" in message and "slots that differ:" in message


# ---------------------------------------------------------------------- quantizers


class TestUnquantizedContract(QuantizerContract):
    quantizer_name = "none"
    relative_error = 0.0


class SignQuantizer(Quantizer):
    """1-bit weights (sign times the mean magnitude): far more error than declared."""

    supported_devices = ("cpu",)

    def make_linear(self, weight, bias=None):
        if weight.dim() != 2:
            raise ValueError("2-D")
        quantized = weight.sign() * weight.abs().mean()
        return lambda x: F.linear(x, quantized, bias)


class DropsBias(SignQuantizer):
    def make_linear(self, weight, bias=None):
        return lambda x: F.linear(x, weight)


class BatchScaled(SignQuantizer):
    """Rounds x to int8 with one scale for the whole batch: rows depend on each other."""

    def make_linear(self, weight, bias=None):
        def forward(x):
            scale = x.abs().max() / 127
            return F.linear((x / scale).round() * scale, weight, bias)
        return forward


def test_quantizer_checks_fail_on_broken_quantizers():
    g = torch.Generator().manual_seed(0)
    weight, bias, x = torch.randn(16, 64, generator=g), torch.randn(16, generator=g), torch.randn(5, 64, generator=g)
    message = fails(check_linear, SignQuantizer(), weight, bias, x, 0.05)
    assert "relative error against F.linear" in message and "expected: <= 0.05" in message
    assert "relative error" in fails(check_linear, DropsBias(), weight, bias, x, 1e-6)
    contract = QuantizerContract()
    contract.shapes = ((16, 64),)
    with pytest.raises(AssertionError, match="row 0 alone differs"):
        contract.test_rows_are_computed_on_their_own(BatchScaled())


# ---------------------------------------------------------------------- logits processors


class TestNoRepeatNGramContract(LogitsProcessorContract):
    processor_name = "no_repeat_ngram"
    args = [{"n": 1}, {"n": 2}, {"n": 3}]
    bad_args = [{"n": 0}, {"n": "2"}, {"m": 1}]


class TestMinLengthContract(LogitsProcessorContract):
    processor_name = "min_length"
    args = [{"min_new_tokens": 5}, {"min_new_tokens": 1, "token_ids": [3, 4]}]
    bad_args = [{"min_new_tokens": -1}, {"min_new_tokens": 2, "token_ids": []}]


class CountsCalls:
    """Bars a token that depends on how often it was called: state kept between steps."""

    calls = 0

    def __init__(self):
        pass

    @classmethod
    def apply(cls, logits, rows):
        cls.calls += 1
        logits[:, cls.calls % logits.shape[1]] = float("-inf")


class BarsTheRowIndex(CountsCalls):
    @classmethod
    def apply(cls, logits, rows):
        for i in range(len(rows)):
            logits[i, i] = float("-inf")


def test_logits_processor_checks_fail_on_broken_processors():
    assert "gave other logits the second time" in fails(check_processor, CountsCalls, [{}], 0)
    message = fails(check_processor, BarsTheRowIndex, [{}], 0)
    assert "row 1 applied alone differs from row 1 of the batch" in message and "expected:" in message


def test_importing_the_kits_package_imports_no_torch():
    import subprocess

    code = "import sys, pyagent_framework.testing as t; t.check_registration; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr
