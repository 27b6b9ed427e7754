"""The generic Registry on its own: no plugin loading involved."""

from __future__ import annotations

import logging
import sys

import pytest

from pyagent_framework.interfaces import EvictionPolicy, missing_members, required_members
from pyagent_framework.registry import (
    DuplicateEntryError,
    EntryLoadError,
    InterfaceError,
    Provider,
    Registry,
    UnknownEntryError,
)

ALICE = Provider(plugin="alice", distribution="pyagent-alice", version="1.2")
BOB = Provider(plugin="bob", distribution="pyagent-bob", version="0.3")


class Complete(EvictionPolicy):
    def __init__(self, capacity=0): ...  # built as cls(capacity), as the engine does
    def insert(self, block): ...
    def touch(self, block): ...
    def release(self, block): ...
    def remove(self, block): ...
    def evict(self):
        return 0
    def __len__(self):
        return 0


class DuckTyped:  # satisfies the interface without subclassing it
    __init__ = Complete.__init__
    insert = touch = release = remove = Complete.insert
    evict = Complete.evict
    __len__ = Complete.__len__


class HalfDone(EvictionPolicy):
    def insert(self, block): ...


class NoEvict:
    insert = touch = release = remove = Complete.insert
    __len__ = Complete.__len__


def make_registry() -> Registry:
    return Registry("eviction_policy", EvictionPolicy)


def add(registry: Registry, name, target, provider=ALICE, **kwargs):
    override = kwargs.pop("override", False)
    entry = registry.make_entry(name, target, provider, **kwargs)
    registry.add(entry, override=override)
    return entry


def test_eager_entry_loads_the_object_and_records_provenance():
    registry = make_registry()
    add(registry, "complete", Complete, description="all methods", metadata={"o1": True})
    entry = registry.get("complete")
    assert entry.provider == ALICE
    assert entry.provider.as_dict() == {"plugin": "alice", "distribution": "pyagent-alice", "version": "1.2"}
    assert entry.metadata == {"o1": True}
    assert entry.target_path() == f"{__name__}:Complete"
    assert registry.load("complete") is Complete
    assert registry.names() == ["complete"]
    assert [e.name for e in registry] == ["complete"]
    assert "complete" in registry and "other" not in registry
    assert len(registry) == 1


def test_lazy_target_is_imported_only_on_first_load(tmp_path, monkeypatch):
    package = tmp_path / "lazy_entry_pkg"
    package.mkdir()
    (package / "__init__.py").write_text(
        "from pyagent_framework.builtins.lru import LRUPolicy as Policy\nLOADS = 1\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = make_registry()
    add(registry, "lazy", "lazy_entry_pkg:Policy")
    assert registry.get("lazy").is_lazy
    assert "lazy_entry_pkg" not in sys.modules
    loaded = registry.load("lazy")
    assert "lazy_entry_pkg" in sys.modules
    from pyagent_framework.builtins.lru import LRUPolicy

    assert loaded is LRUPolicy
    assert registry.load("lazy") is loaded  # cached
    monkeypatch.delitem(sys.modules, "lazy_entry_pkg")


def test_aliases_resolve_to_the_canonical_entry():
    registry = make_registry()
    add(registry, "complete", Complete, aliases=("full", "all"))
    assert registry.get("full").name == "complete"
    assert registry.load("all") is Complete
    assert registry.names() == ["complete"]


def test_unknown_name_lists_alternatives_and_the_nearest_match():
    registry = make_registry()
    for name in ("lru", "lfu", "s3fifo", "arc"):
        add(registry, name, Complete)
    with pytest.raises(UnknownEntryError) as info:
        registry.load("s3ffo")
    message = str(info.value)
    assert "unknown eviction_policy 's3fifo'" not in message
    assert "unknown eviction_policy 's3ffo'" in message
    assert "did you mean 's3fifo'?" in message
    assert "available: arc, lfu, lru, s3fifo" in message
    assert isinstance(info.value, KeyError)  # callers may catch KeyError


def test_unknown_name_without_a_close_match_still_lists_what_exists():
    registry = make_registry()
    add(registry, "lru", Complete)
    with pytest.raises(UnknownEntryError, match=r"unknown eviction_policy 'zzzzzz' \(available: lru\)$"):
        registry.get("zzzzzz")
    empty = make_registry()
    with pytest.raises(UnknownEntryError, match="none are registered"):
        empty.get("lru")


def test_duplicate_names_both_providers():
    registry = make_registry()
    add(registry, "lru", Complete, ALICE)
    with pytest.raises(DuplicateEntryError) as info:
        add(registry, "lru", DuckTyped, BOB)
    message = str(info.value)
    assert "pyagent-alice 1.2" in message and "pyagent-bob 0.3" in message
    assert registry.load("lru") is Complete  # the first one stays


def test_alias_clashing_with_a_name_is_a_duplicate():
    registry = make_registry()
    add(registry, "lru", Complete, ALICE)
    with pytest.raises(DuplicateEntryError, match="pyagent-alice"):
        add(registry, "other", DuckTyped, BOB, aliases=("lru",))
    assert registry.names() == ["lru"]


def test_override_replaces_and_logs(caplog):
    registry = make_registry()
    add(registry, "lru", Complete, ALICE, aliases=("least-recent",))
    with caplog.at_level(logging.WARNING, logger="pyagent_framework.registry"):
        add(registry, "lru", DuckTyped, BOB, override=True)
    assert registry.load("lru") is DuckTyped
    assert registry.get("lru").provider == BOB
    assert "least-recent" not in registry  # the replaced entry's aliases go with it
    assert any("pyagent-bob" in r.message and "pyagent-alice" in r.message for r in caplog.records)


def test_eager_entry_missing_members_is_refused_at_registration():
    registry = make_registry()
    with pytest.raises(InterfaceError) as info:
        add(registry, "noevict", NoEvict, BOB)
    message = str(info.value)
    assert "pyagent-bob" in message and "missing evict" in message
    assert "noevict" not in registry


def test_subclass_leaving_abstract_members_is_refused():
    assert missing_members(HalfDone, EvictionPolicy) == ["__len__", "evict", "release", "remove", "touch"]
    assert missing_members(Complete, EvictionPolicy) == []
    assert missing_members(DuckTyped, EvictionPolicy) == []
    assert missing_members(DuckTyped(), EvictionPolicy) == []
    assert required_members(EvictionPolicy) == ("__len__", "evict", "insert", "release", "remove", "touch")


def test_lazy_entry_is_checked_on_load_and_names_the_provider():
    registry = make_registry()
    add(registry, "noevict", f"{__name__}:NoEvict", BOB)
    with pytest.raises(InterfaceError, match=r"'noevict' from pyagent-bob 0.3 .*missing evict"):
        registry.load("noevict")


def test_lazy_import_failure_names_the_provider_and_target():
    registry = make_registry()
    add(registry, "ghost", "no_such_module_for_pyagent:Policy", BOB)
    with pytest.raises(EntryLoadError) as info:
        registry.load("ghost")
    message = str(info.value)
    assert "pyagent-bob" in message and "no_such_module_for_pyagent:Policy" in message
    assert "ModuleNotFoundError" in message


@pytest.mark.parametrize(
    "name, target, error",
    [
        ("", Complete, "non-empty"),
        (" lru", Complete, "surrounding spaces"),
        (3, Complete, "non-empty string"),
        ("x", "no_colon_here", "'module:attr'"),
        ("x", ":attr", "'module:attr'"),
        ("x", None, "target is None"),
    ],
)
def test_bad_registrations_are_refused(name, target, error):
    registry = make_registry()
    with pytest.raises(ValueError, match=error):
        registry.make_entry(name, target, ALICE)


def test_runtime_registration_and_unregister():
    registry = make_registry()
    entry = registry.register("mine", Complete, description="host-registered")
    assert entry.provider.plugin == "<runtime>"
    assert registry.unregister("mine").name == "mine"
    assert "mine" not in registry


def test_as_dict_is_json_ready():
    import json

    registry = make_registry()
    entry = add(registry, "lazy", "pkg.mod:Cls", aliases=("l",), description="d", metadata={"k": 1})
    assert json.loads(json.dumps(entry.as_dict())) == {
        "kind": "eviction_policy",
        "name": "lazy",
        "aliases": ["l"],
        "description": "d",
        "target": "pkg.mod:Cls",
        "provider": {"plugin": "alice", "distribution": "pyagent-alice", "version": "1.2"},
        "metadata": {"k": 1},
    }


def test_an_entry_may_satisfy_an_alternative_interface_instead():
    """A model architecture is a causal language model or an encoder."""
    from pyagent_framework.interfaces import EncoderArchitecture, ModelArchitecture

    class Encoder(EncoderArchitecture):
        def forward(self, input_ids, positions, query_start_loc, token_type_ids=None): ...
        def load_weights(self, weights):
            return set()

    class Neither:
        def forward(self, *args): ...

    registry = Registry("model_architecture", ModelArchitecture, alternatives=(EncoderArchitecture,))
    add(registry, "Encoder", Encoder, BOB)
    assert registry.load("Encoder") is Encoder
    with pytest.raises(InterfaceError, match=r"ModelArchitecture \(or pyagent_framework.interfaces.model.EncoderArchitecture\): "
                                             r"missing compute_logits, kv_cache_shape, load_weights"):
        add(registry, "Neither", Neither, BOB)
