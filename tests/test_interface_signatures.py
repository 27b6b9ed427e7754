"""Entries are checked against their interface's method signatures and the
constructor the engine uses, not only member names (interfaces/_check.py), at
registration of an object and at the first load of a lazy target."""

from __future__ import annotations

import pytest

from pyagent_framework import registries
from pyagent_framework.interfaces import (
    EvictionPolicy,
    LogitsProcessor,
    Quantizer,
    Tokenizer,
    ToolParser,
    signature_problems,
)
from pyagent_framework.registry import InterfaceError, Provider, Registry

ALICE = Provider(plugin="alice", distribution="pyagent-alice", version="1.2")


class Policy:
    def __init__(self, capacity):
        self.capacity = capacity

    def insert(self, block): ...
    def touch(self, block): ...
    def release(self, block): ...
    def remove(self, block): ...

    def evict(self):
        return 0

    def __len__(self):
        return 0


def variant(**members):
    return type("Variant", (Policy,), members)


def test_a_conforming_entry_has_no_problems():
    assert signature_problems(Policy, EvictionPolicy) == []
    assert signature_problems(Policy(4), EvictionPolicy) == []  # an instance: bound methods


@pytest.mark.parametrize(
    "members",
    [
        {"release": lambda self, *args: None},  # *args accepts anything
        {"release": lambda self, *args, **kwargs: None},
        {"remove": lambda self, block, reason=None: None},  # an extra parameter with a default
        {"insert": staticmethod(lambda block: None)},
        {"insert": classmethod(lambda cls, block: None)},
        {"__init__": lambda self, capacity, *, seed=0: None},
        {"__init__": lambda self, *args: None},
    ],
)
def test_what_the_caller_can_call_is_accepted(members):
    assert signature_problems(variant(**members), EvictionPolicy) == []


@pytest.mark.parametrize(
    "members, expected",
    [
        ({"evict": lambda self, n: 0}, "evict(n) cannot be called as EvictionPolicy.evict() is: evict() fails with "
                                        "missing a required argument: 'n'"),
        ({"insert": lambda self: None}, "insert() cannot be called as EvictionPolicy.insert(block) is: insert(block) "
                                        "fails with too many positional arguments"),
        ({"touch": lambda self, block, extra: None}, "missing a required argument: 'extra'"),
        ({"remove": lambda self, *, block: None}, "remove(*, block) cannot be called as EvictionPolicy.remove(block)"),
        ({"__len__": 3}, "__len__ is not callable, but EvictionPolicy.__len__ is a method"),
        ({"__init__": lambda self: None}, "Variant() cannot be built as the engine builds every EvictionPolicy: "
                                          "Variant(capacity) fails with too many positional arguments"),
        ({"__init__": lambda self, capacity, seed: None}, "missing a required argument: 'seed'"),
    ],
)
def test_a_call_the_entry_cannot_take_is_a_problem(members, expected):
    [problem] = signature_problems(variant(**members), EvictionPolicy)
    assert expected in problem


def test_the_problem_points_at_the_offending_definition():
    class Bad(Policy):
        def evict(self, n):
            return n

    [problem] = signature_problems(Bad, EvictionPolicy)
    assert f'File "{__file__}"' in problem
    assert "in evict\n    def evict(self, n):" in problem


def test_optional_parameters_the_interface_passes_must_be_accepted():
    class Parser(ToolParser):
        def extract(self, text):  # the engine passes the request too
            return None

        def extract_streaming(self, *args):
            return None

        def finish_streaming(self, current_text, request=None):  # an optional method, overridden correctly
            return None

    [problem] = signature_problems(Parser, ToolParser)
    assert "extract(text) cannot be called as ToolParser.extract(text, request=None) is: extract(text, request)" in problem


def test_keyword_only_parameters_are_passed_by_name():
    class Tok:
        @classmethod
        def from_pretrained(cls, path, **options): ...
        vocab_size = bos_token_id = eos_token_ids = chat_template = None

        def encode(self, text, add_special_tokens=True): ...  # positional-or-keyword: fine
        def decode(self, ids, *, skip=True): ...  # the keyword is misnamed
        def token_bytes(self, token_id): ...

    [problem] = signature_problems(Tok, Tokenizer)
    assert "decode(ids, *, skip=True) cannot be called as Tokenizer.decode(ids, *, skip_special_tokens=True)" in problem
    assert "got an unexpected keyword argument 'skip_special_tokens'" in problem


def test_a_method_called_on_the_class_must_be_a_classmethod():
    class Processor:
        def apply(self, logits, rows): ...

    [problem] = signature_problems(Processor, LogitsProcessor)
    assert "apply must be a classmethod or staticmethod: LogitsProcessor.apply is called on the class" in problem

    class Good:
        @staticmethod
        def apply(logits, rows): ...

    assert signature_problems(Good, LogitsProcessor) == []


def test_a_constructor_with_options_only_is_accepted_for_quantizers():
    class Quant:
        supported_devices = ("cpu",)

        def __init__(self, *, bits=8): ...
        def make_linear(self, weight, bias=None): ...

    assert signature_problems(Quant, Quantizer) == []

    class Needy(Quant):
        def __init__(self, bits): ...

    [problem] = signature_problems(Needy, Quantizer)
    assert "Needy(bits) cannot be built as the engine builds every Quantizer: Needy() fails" in problem


def test_members_without_a_readable_signature_are_not_checked():
    """A compiled extension's class (pybind11) has no signatures to read: its methods
    and constructor are taken as they are, while a Python method beside them is checked."""
    core = pytest.importorskip("pyagent_native._core")
    import inspect

    with pytest.raises(ValueError, match="no signature found"):
        inspect.signature(core.LRUPolicy)
    assert signature_problems(core.LRUPolicy, EvictionPolicy) == []

    class Mixed(core.LRUPolicy):
        def evict(self, n):
            return n

    [problem] = signature_problems(Mixed, EvictionPolicy)
    assert problem.startswith("evict(n) cannot be called as EvictionPolicy.evict() is")


def test_registry_rejects_an_object_with_a_bad_signature_at_registration():
    registry = Registry("eviction_policy", EvictionPolicy)
    bad = variant(evict=lambda self, n: 0)
    with pytest.raises(InterfaceError, match=r"eviction_policy 'bad' from pyagent-alice 1.2 \(plugin 'alice'\) does "
                                             r"not satisfy pyagent_framework.interfaces.eviction.EvictionPolicy: evict\(n\)"):
        registry.make_entry("bad", bad, ALICE)


def test_registry_rejects_a_lazy_target_with_a_bad_signature_at_first_load(tmp_path, monkeypatch):
    package = tmp_path / "sig_lazy_pkg"
    package.mkdir()
    (package / "__init__.py").write_text(
        "class Policy:\n"
        "    def __init__(self, capacity): ...\n"
        "    def insert(self, block): ...\n"
        "    def touch(self, block): ...\n"
        "    def release(self, block): ...\n"
        "    def remove(self, block): ...\n"
        "    def evict(self, count): ...\n"
        "    def __len__(self): return 0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = Registry("eviction_policy", EvictionPolicy)
    registry.add(registry.make_entry("lazy", "sig_lazy_pkg:Policy", ALICE))  # not imported yet: accepted
    with pytest.raises(InterfaceError, match=r"evict\(count\) cannot be called as EvictionPolicy.evict\(\) is") as info:
        registry.load("lazy")
    assert "sig_lazy_pkg/__init__.py\", line 7, in evict" in str(info.value)


def test_every_installed_entry_satisfies_its_interface_signatures():
    """The kernel's and first-party plugins' entries, as installed here, all load with
    the signature checks on (pyagent plugins --check does the same from the CLI)."""
    failures = []
    for registry in registries.REGISTRIES.values():
        for entry in registry.entries():
            try:
                registry.load(entry.name)
            except Exception as exc:
                failures.append(f"{registry.kind} {entry.name!r}: {exc}")
    assert failures == []


def test_a_callable_object_kept_as_a_class_attribute_takes_no_self():
    class Evict:
        def __call__(self):  # called as policy.evict(): no block, no self passed
            return 0

    assert signature_problems(variant(evict=Evict()), EvictionPolicy) == []

    class NeedsOne:
        def __call__(self, n):
            return n

    [problem] = signature_problems(variant(evict=NeedsOne()), EvictionPolicy)
    assert "evict(n) cannot be called as EvictionPolicy.evict() is" in problem
