import os
import random
import threading
import time
from pathlib import Path

import pytest
from pyagent_kv_disk.connector import DiskConnector, default_path

from pyagent_framework import registries
from pyagent_framework.testing import check_registration


def k(i: int) -> bytes:
    """A 32-byte key like the framework's block hashes."""
    return i.to_bytes(4, "big") * 8


def value(i: int, size: int = 100) -> bytes:
    return bytes([i % 256]) * size


def open_store(path: Path, **config) -> DiskConnector:
    return DiskConnector({"path": str(path), **config})


def on_disk(path: Path) -> set[bytes]:
    """The keys whose files exist under ``path``."""
    return {bytes.fromhex(p.name[:-3]) for p in path.glob("??/*.kv")}


def temp_files(path: Path) -> list[Path]:
    return sorted(path.glob("??/.*.tmp"))


def live(store: DiskConnector, n: int) -> set[int]:
    """Which of k(0)..k(n-1) are stored."""
    return {i for i, ok in enumerate(store.contains([k(i) for i in range(n)])) if ok}


# ------------------------------------------------------------------ basics


def test_put_get_contains_round_trip(tmp_path):
    store = open_store(tmp_path)
    items = {k(1): b"\x00\x01\x02", k(2): bytes(range(256)) * 40, b"x": b"short key"}
    store.put(items)
    keys = [k(2), k(3), k(1), b"x"]
    assert store.contains(keys) == [True, False, True, True]
    assert store.get(keys) == [items[k(2)], None, items[k(1)], b"short key"]
    assert store.get([]) == [] and store.contains([]) == []
    assert store.stats() == {
        "files": 3,
        "bytes": 3 + 256 * 40 + 9,
        "evictions": 0,
        "skipped_too_large": 0,
    }
    # the layout: <path>/<hex[:2]>/<hex>.kv, holding exactly the value's bytes
    hex_ = k(2).hex()
    assert store.file_of(k(2)) == tmp_path / hex_[:2] / f"{hex_}.kv"
    assert (tmp_path / hex_[:2] / f"{hex_}.kv").read_bytes() == items[k(2)]
    assert on_disk(tmp_path) == set(items)
    assert temp_files(tmp_path) == []


def test_missing_keys_are_none_and_false(tmp_path):
    store = open_store(tmp_path)
    assert store.contains([k(7), k(8)]) == [False, False]
    assert store.get([k(7)]) == [None]
    store.put({k(7): b"seven"})
    assert store.get([k(8), k(7), k(8)]) == [None, b"seven", None]


def test_overwrite_replaces_the_value_and_its_accounting(tmp_path):
    store = open_store(tmp_path)
    store.put({k(1): b"a" * 10})
    store.put({k(1): b"b" * 25})
    assert store.get([k(1)]) == [b"b" * 25]
    assert store.stats()["files"] == 1 and store.stats()["bytes"] == 25


def test_values_may_be_any_bytes_like(tmp_path):
    store = open_store(tmp_path)
    store.put({k(1): bytearray(b"ba"), k(2): memoryview(b"mv"), k(3): b""})
    assert store.get([k(1), k(2), k(3)]) == [b"ba", b"mv", b""]
    assert all(type(v) is bytes for v in store.get([k(1), k(2)]))


def test_bad_keys_and_values_are_rejected_before_anything_is_stored(tmp_path):
    store = open_store(tmp_path)
    with pytest.raises(TypeError, match="bytes-like"):
        store.put({k(1): b"ok", k(2): "text"})
    with pytest.raises(ValueError, match="1 to 64 bytes"):
        store.put({k(1): b"ok", b"": b"empty key"})
    with pytest.raises(ValueError, match="1 to 64 bytes"):
        store.put({k(1): b"ok", b"k" * 65: b"long key"})
    with pytest.raises(TypeError, match="keys must be bytes"):
        store.get(["text"])
    with pytest.raises(ValueError):
        store.contains([b""])
    assert store.contains([k(1)]) == [False]
    assert on_disk(tmp_path) == set()
    store.put({b"k" * 64: b"longest key"})
    assert store.get([b"k" * 64]) == [b"longest key"]


def test_file_deleted_behind_its_back_is_a_miss_and_leaves_the_accounting(tmp_path):
    store = open_store(tmp_path)
    store.put({k(1): b"1" * 10, k(2): b"2" * 20})
    store.file_of(k(1)).unlink()
    assert store.get([k(1), k(2)]) == [None, b"2" * 20]
    assert store.stats()["files"] == 1 and store.stats()["bytes"] == 20
    store.file_of(k(2)).unlink()
    assert store.contains([k(2)]) == [False]
    assert store.stats()["files"] == 0 and store.stats()["bytes"] == 0


def test_other_read_errors_propagate(tmp_path):
    store = open_store(tmp_path)
    store.file_of(k(1)).parent.mkdir(exist_ok=True)
    store.file_of(k(1)).mkdir()  # a directory where the file should be
    with pytest.raises(OSError):
        store.get([k(1)])


def test_close_keeps_the_files_and_refuses_later_calls(tmp_path):
    store = open_store(tmp_path)
    store.put({k(1): b"kept"})
    store.close()
    store.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        store.get([k(1)])
    assert open_store(tmp_path).get([k(1)]) == [b"kept"]


# ------------------------------------------------------------------ atomic writes


def test_failed_rename_leaves_no_file_and_no_temp(tmp_path, monkeypatch):
    store = open_store(tmp_path)
    store.put({k(1): b"old"})

    def broken_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="No space"):
        store.put({k(2): b"new" * 100})
    with pytest.raises(OSError, match="No space"):
        store.put({k(1): b"replacement"})
    assert not store.file_of(k(2)).exists()
    assert temp_files(tmp_path) == []
    assert store.get([k(1), k(2)]) == [b"old", None]  # the old value is intact
    assert store.stats()["files"] == 1 and store.stats()["bytes"] == 3


def test_failed_write_leaves_no_file_and_no_temp(tmp_path, monkeypatch):
    store = open_store(tmp_path, fsync=True)

    def broken_fsync(fd):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="Input/output"):
        store.put({k(1): b"x" * 1000})
    assert on_disk(tmp_path) == set() and temp_files(tmp_path) == []
    assert store.stats()["files"] == 0


def test_value_is_complete_before_it_gets_its_name(tmp_path, monkeypatch):
    store = open_store(tmp_path, fsync=True)
    seen = []
    real_replace, real_fsync = os.replace, os.fsync
    fsynced = []

    def spy_fsync(fd):
        fsynced.append(fd)
        real_fsync(fd)

    def spy_replace(src, dst):
        # at rename time the temp file already holds the whole value (and was fsynced),
        # sits beside its final name, and the final name does not exist yet
        seen.append(
            (
                Path(src).parent == Path(dst).parent,
                Path(src).read_bytes(),
                Path(dst).exists(),
                len(fsynced),
            )
        )
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", spy_fsync)
    monkeypatch.setattr(os, "replace", spy_replace)
    store.put({k(1): b"v" * 5000})
    assert seen == [(True, b"v" * 5000, False, 1)]
    assert len(fsynced) == 2  # the file, then its directory
    assert store.get([k(1)]) == [b"v" * 5000]


# ------------------------------------------------------------------ size limit


def test_size_limit_evicts_least_recently_used_first(tmp_path):
    store = open_store(tmp_path, max_size=300)  # three 100-byte values
    store.put({k(0): value(0), k(1): value(1), k(2): value(2)})
    assert store.stats()["evictions"] == 0
    assert store.get([k(0)]) == [value(0)]  # k0 is now the most recently used
    assert store.contains([k(1)]) == [True]  # a lookup is not a use
    store.put({k(3): value(3)})  # k1 is the least recently used
    assert on_disk(tmp_path) == {k(0), k(2), k(3)}
    store.put({k(4): value(4)})  # then k2
    assert on_disk(tmp_path) == {k(0), k(3), k(4)}
    store.put({k(3): value(3)})  # storing k3 again is a use: k0 is now the oldest
    store.put({k(5): value(5)})
    assert on_disk(tmp_path) == {k(3), k(4), k(5)}
    store.put({k(6): value(6, 250)})  # 550 bytes: k4, then k3, then k5 go
    assert on_disk(tmp_path) == {k(6)}
    assert store.stats() == {
        "files": 1,
        "bytes": 250,
        "evictions": 6,
        "skipped_too_large": 0,
    }


def test_a_value_larger_than_the_limit_is_skipped(tmp_path):
    store = open_store(tmp_path, max_size=100)
    store.put({k(1): value(1, 60)})
    store.put({k(2): value(2, 101), k(3): value(3, 40)})
    assert store.contains([k(1), k(2), k(3)]) == [True, False, True]
    assert store.stats() == {
        "files": 2,
        "bytes": 100,
        "evictions": 0,
        "skipped_too_large": 1,
    }
    assert temp_files(tmp_path) == []


def test_capacity_is_the_number_of_values_that_fit(tmp_path):
    store = open_store(tmp_path, max_size="1KiB")
    assert store.max_size == 1024 and store.capacity is None  # built on first need
    store.put({k(0): value(0, 100)})
    assert store.capacity == 10
    reopened = open_store(tmp_path, max_size=2000)  # from the mean of the files found
    assert reopened.capacity == 20


def test_s3fifo_from_pyagent_eviction_keeps_reused_blocks(tmp_path):
    if "s3fifo" not in registries.eviction_policies:
        pytest.skip("pyagent-eviction is not installed")
    check_registration("eviction_policy", "s3fifo", "pyagent-eviction")
    store = open_store(tmp_path, max_size=1000, eviction_policy="s3fifo")  # capacity 10, small queue 1
    store.put({k(i): value(i) for i in range(10)})
    assert store.get([k(0)]) == [value(0)]  # k0 reused while on probation
    store.put({k(10): value(10)})  # k0 moves to the main queue, k1 is evicted
    assert live(store, 11) == set(range(11)) - {1}
    for i in range(11, 20):
        store.put({k(i): value(i)})  # new blocks leave through the small queue: k2 .. k10
    assert live(store, 20) == {0, *range(11, 20)}


def test_lru_drops_what_s3fifo_keeps(tmp_path):
    # the same trace as above: LRU forgets k0, the reused block
    store = open_store(tmp_path, max_size=1000)
    store.put({k(i): value(i) for i in range(10)})
    store.get([k(0)])
    for i in range(10, 20):
        store.put({k(i): value(i)})
    assert live(store, 20) == set(range(10, 20))


@pytest.mark.parametrize("policy", registries.eviction_policies.names())
def test_every_registered_policy_holds_the_limit(tmp_path, policy):
    store = open_store(tmp_path, max_size=1000, eviction_policy=policy)
    rng = random.Random(policy)
    for i in range(200):
        store.put({k(i): value(i, rng.randrange(50, 150))})
        store.get([k(rng.randrange(i + 1))])
    stats = store.stats()
    files = list(tmp_path.glob("??/*.kv"))
    assert stats["bytes"] == sum(f.stat().st_size for f in files) <= 1000
    assert stats["files"] == len(files) == len(store._policy)  # every file is evictable
    assert stats["evictions"] == 200 - len(files)


# ------------------------------------------------------------------ restarts


def test_reopening_reindexes_oldest_first_and_keeps_the_limit(tmp_path):
    store = open_store(tmp_path, max_size=1000)
    store.put({k(i): value(i) for i in range(5)})
    store.close()
    now = time.time()
    for i, age in enumerate([10, 50, 20, 40, 30]):  # oldest: k1, k3, k4, k2, k0
        os.utime(store.file_of(k(i)), (now - age, now - age))

    reopened = open_store(tmp_path, max_size=300)  # a lower limit: the two oldest go
    assert on_disk(tmp_path) == {k(0), k(2), k(4)}
    assert reopened.stats() == {
        "files": 3,
        "bytes": 300,
        "evictions": 2,
        "skipped_too_large": 0,
    }
    reopened.put({k(5): value(5)})  # then the oldest of the rest
    assert on_disk(tmp_path) == {k(0), k(2), k(5)}

    again = open_store(tmp_path, max_size=1000)
    assert again.stats() == {
        "files": 3,
        "bytes": 300,
        "evictions": 0,
        "skipped_too_large": 0,
    }
    assert again.get([k(0), k(2), k(5)]) == [value(0), value(2), value(5)]


def test_reopening_ignores_strays_and_deletes_stale_temp_files(tmp_path):
    store = open_store(tmp_path)
    store.put({k(1): b"one"})
    sub = store.file_of(k(1)).parent
    stale, fresh = sub / ".0101-abandoned.tmp", sub / ".0101-inflight.tmp"
    stale.write_bytes(b"partial")
    fresh.write_bytes(b"partial")
    two_hours_ago = time.time() - 7200
    os.utime(stale, (two_hours_ago, two_hours_ago))
    (tmp_path / "README").write_text("not a value")
    (sub / "not-hex.kv").write_bytes(b"?")
    (sub / "ffff.kv").write_bytes(b"?")  # in the wrong sub-directory
    (tmp_path / "zz").mkdir()

    reopened = open_store(tmp_path)
    assert reopened.stats()["files"] == 1 and reopened.stats()["bytes"] == 3
    assert not stale.exists() and fresh.exists()
    assert (tmp_path / "README").exists() and (sub / "not-hex.kv").exists()


# ------------------------------------------------------------------ sharing


def test_two_connectors_on_one_directory_see_each_others_values(tmp_path):
    a = open_store(tmp_path)
    b = open_store(tmp_path)
    a.put({k(1): b"from a"})
    assert b.contains([k(1)]) == [True]
    assert b.get([k(1)]) == [b"from a"]
    assert b.stats()["files"] == 1  # b adopted the file it read
    b.put({k(2): b"from b"})
    assert a.contains([k(1), k(2)]) == [True, True]
    assert a.get([k(2)]) == [b"from b"]
    b.put({k(1): b"b again"})  # a reader sees the whole new value
    assert a.get([k(1)]) == [b"b again"]
    assert temp_files(tmp_path) == []


def test_a_shared_file_evicted_by_the_other_connector_is_a_miss(tmp_path):
    a = open_store(tmp_path, max_size=200)
    b = open_store(tmp_path, max_size=200)
    a.put({k(1): value(1)})
    b.put({k(2): value(2), k(3): value(3)})  # b only knows its own two files
    assert on_disk(tmp_path) == {k(1), k(2), k(3)}  # the limit is per process view
    assert b.get([k(1)]) == [value(1)]  # b adopts k1 and evicts its oldest, k2
    assert on_disk(tmp_path) == {k(1), k(3)}
    b.put({k(4): value(4)})  # then k3 (k1 was used more recently)
    assert on_disk(tmp_path) == {k(1), k(4)}
    a.put({k(5): value(5)})  # a's view: k1, k5
    assert on_disk(tmp_path) == {k(1), k(4), k(5)}
    b.put({k(6): value(6)})  # b evicts k1 under a's feet
    assert a.get([k(1), k(5)]) == [None, value(5)]
    assert a.stats()["files"] == 1  # a dropped k1 from its view
    assert on_disk(tmp_path) == {k(4), k(5), k(6)}
    assert a.contains([k(4), k(6)]) == [True, True]


# ------------------------------------------------------------------ config


def test_unknown_config_key_is_named_with_the_known_ones(tmp_path):
    with pytest.raises(ValueError, match="'max_bytes'") as info:
        DiskConnector({"path": str(tmp_path), "max_bytes": 10})
    assert "path, max_size, eviction_policy, fsync" in str(info.value)


@pytest.mark.parametrize("bad", ["lots", "-5", 0, -1, True, "", None, "1.5XB"])
def test_bad_max_size_is_named(tmp_path, bad):
    with pytest.raises(ValueError, match="max_size"):
        DiskConnector({"path": str(tmp_path), "max_size": bad})


@pytest.mark.parametrize(
    "size, expected",
    [(4096, 4096), ("10GiB", 10 * 1024**3), ("1.5K", 1500), ("512MB", 512 * 10**6)],
)
def test_max_size_accepts_bytes_and_units(tmp_path, size, expected):
    assert DiskConnector({"path": str(tmp_path), "max_size": size}).max_size == expected


def test_default_max_size_and_policy(tmp_path):
    store = DiskConnector({"path": str(tmp_path)})
    assert store.max_size == 4 * 1024**3 and store.eviction_policy == "lru" and store.fsync is False


def test_unknown_eviction_policy_is_named(tmp_path):
    with pytest.raises(ValueError, match="eviction_policy 'belady'") as info:
        DiskConnector({"path": str(tmp_path), "eviction_policy": "belady"})
    assert "lru" in str(info.value)  # lists what is registered


def test_fsync_must_be_a_bool(tmp_path):
    with pytest.raises(ValueError, match="fsync"):
        DiskConnector({"path": str(tmp_path), "fsync": "yes"})


def test_default_path_honours_xdg_cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    store = DiskConnector({})
    assert store.path == tmp_path / "xdg" / "pyagent" / "kv"
    assert store.path.is_dir()
    store.put({k(1): b"here"})
    assert store.file_of(k(1)).is_relative_to(tmp_path / "xdg")


def test_default_path_falls_back_to_home_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_path() == tmp_path / "home" / ".cache" / "pyagent" / "kv"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")  # not absolute: ignored
    assert default_path() == tmp_path / "home" / ".cache" / "pyagent" / "kv"


def test_path_is_created_private(tmp_path):
    store = DiskConnector({"path": str(tmp_path / "a" / "b")})
    store.put({k(1): b"secret prompt"})
    assert (tmp_path / "a" / "b").is_dir()
    assert store.file_of(k(1)).stat().st_mode & 0o077 == 0


# ------------------------------------------------------------------ threads


def test_concurrent_puts_and_gets_keep_the_index_consistent(tmp_path):
    store = open_store(tmp_path, max_size=2000)
    expected = {k(i): value(i, 50 + i % 50) for i in range(400)}
    errors = []
    start = threading.Barrier(3)

    def saver(keys):
        start.wait()
        for key in keys:
            store.put({key: expected[key]})

    def reader():
        rng = random.Random(1)
        start.wait()
        keys = list(expected)
        for _ in range(600):
            batch = rng.sample(keys, 3)
            for key, got in zip(batch, store.get(batch)):
                if got is not None and got != expected[key]:
                    errors.append(key)

    keys = list(expected)
    threads = [
        threading.Thread(target=saver, args=(keys[0::2],)),
        threading.Thread(target=saver, args=(keys[1::2],)),
        threading.Thread(target=reader),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    files = {bytes.fromhex(p.name[:-3]): p.stat().st_size for p in tmp_path.glob("??/*.kv")}
    stats = store.stats()
    assert stats["files"] == len(files) == len(store._policy)
    assert stats["bytes"] == sum(files.values()) <= 2000
    assert stats["evictions"] == 400 - len(files)
    assert store.get(list(files)) == [expected[key] for key in files]
    assert temp_files(tmp_path) == []


def test_a_shared_file_larger_than_the_limit_is_read_but_not_adopted(tmp_path):
    big = open_store(tmp_path, max_size=1000)
    small = open_store(tmp_path, max_size=100)
    small.put({k(1): value(1, 80)})
    big.put({k(2): value(2, 500)})
    assert small.get([k(2), k(1)]) == [value(2, 500), value(1, 80)]
    assert small.stats() == {"files": 1, "bytes": 80, "evictions": 0, "skipped_too_large": 0}
    assert on_disk(tmp_path) == {k(1), k(2)}
