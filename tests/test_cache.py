"""packer.cache: the one cache root, its limit, made-once entries under a lock, atomic placement, checks,
and least-recently-used eviction that never removes what a process has open (real processes, real flock)."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import time
from pathlib import Path

import pytest

from packer import cache
from packer.errors import ConfigError


def test_root_resolution_order(tmp_path, monkeypatch):
    monkeypatch.delenv("PACKER_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cache.root() == tmp_path / "home" / ".cache" / "packer"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")  # the XDG spec: a relative path is ignored
    assert cache.root() == tmp_path / "home" / ".cache" / "packer"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.root() == tmp_path / "xdg" / "packer"
    monkeypatch.setenv("PACKER_CACHE", str(tmp_path / "env"))
    assert cache.root() == tmp_path / "env"
    assert cache.root(tmp_path / "arg") == tmp_path / "arg"
    assert cache.root("~/c") == tmp_path / "home" / "c"


@pytest.mark.parametrize(("text", "expected"), [
    ("10GB", 10 * 10**9), ("512MiB", 512 * 2**20), ("1.5 gb", 1_500_000_000), ("1000", 1000), ("0", 0),
    (12345, 12345), (None, None), ("", None), ("2KiB", 2048), ("3t", 3 * 10**12),
])
def test_parse_limit(text, expected):
    assert cache.parse_limit(text) == expected


@pytest.mark.parametrize("bad", ["10 furlongs", "-5", "GB", -1, True, "1e9", 1.5])
def test_parse_limit_refuses_in_one_line(bad):
    with pytest.raises(ConfigError, match=r"cache_limit .*need a size") as e:
        cache.parse_limit(bad)
    assert "\n" not in str(e.value)


def test_limit_from_the_environment(monkeypatch):
    monkeypatch.setenv("PACKER_CACHE_LIMIT", "2MB")
    assert cache.limit() == 2_000_000
    assert cache.limit("1KB") == 1000  # an argument wins
    monkeypatch.setenv("PACKER_CACHE_LIMIT", "lots")
    with pytest.raises(ConfigError, match=r"\$PACKER_CACHE_LIMIT 'lots'"):
        cache.limit()


def _writer(data: bytes, calls: list | None = None):
    def make(tmp: Path) -> None:
        if calls is not None:
            calls.append(tmp)
        tmp.write_bytes(data)
    return make


def _check(data: bytes):
    digest = hashlib.sha256(data).hexdigest()
    return lambda p, full: cache.file_problem(p, len(data), digest if full else None)


def test_an_entry_is_made_once_checked_and_remade_when_damaged(tmp_path):
    c = cache.Cache("shards", tmp_path)
    data, calls = b"x" * 1000, []
    with c.open("k1", _writer(data, calls), _check(data)) as e:
        assert e.path == tmp_path / "shards" / "k1" and e.path.read_bytes() == data
    with c.open("k1", _writer(data, calls), _check(data)) as e:
        pass
    assert len(calls) == 1 and e.closed
    (tmp_path / "shards" / "k1").write_bytes(data[:500])  # partial: found by size on any open
    with c.open("k1", _writer(data, calls), _check(data)) as e:
        assert e.path.read_bytes() == data
    assert len(calls) == 2
    (tmp_path / "shards" / "k1").write_bytes(b"y" * 1000)  # same size, other bytes: found by a full check
    with c.open("k1", _writer(data, calls), _check(data)) as e:
        assert e.path.read_bytes() == b"y" * 1000  # a cheap open trusts the size
    with c.open("k1", _writer(data, calls), _check(data), full=True) as e:
        assert e.path.read_bytes() == data
    assert len(calls) == 3
    assert [p.name for p in (tmp_path / "shards").iterdir() if not p.name.startswith(".locks")] == ["k1"]


def test_a_failed_or_wrong_make_leaves_nothing(tmp_path):
    c = cache.Cache("shards", tmp_path)

    def dies(tmp: Path) -> None:
        tmp.write_bytes(b"half")
        raise OSError("connection reset")

    with pytest.raises(OSError, match="connection reset"):
        c.open("k", dies, _check(b"whole"))
    with pytest.raises(cache.CacheError, match=r"what was made is 5 bytes, expected 3"):
        c.open("k", _writer(b"wrong"), _check(b"abc"))
    assert sorted(p.name for p in (tmp_path / "shards").iterdir()) == [".locks"]


def test_a_crashed_makers_temporary_file_is_cleared_and_never_used(tmp_path):
    c = cache.Cache("shards", tmp_path)
    stale = tmp_path / "shards" / f"{cache.TMP_PREFIX}k.999.dead"
    stale.write_bytes(b"torn")
    with c.open("k", _writer(b"whole"), _check(b"whole")) as e:
        assert e.path.read_bytes() == b"whole"
    assert not stale.exists()


def test_folder_entries(tmp_path):
    c = cache.Cache("tokens", tmp_path)

    def make(tmp: Path) -> None:
        tmp.mkdir()
        (tmp / "a.bin").write_bytes(b"1" * 10)
        (tmp / "b.bin").write_bytes(b"2" * 20)

    with c.open("store", make, lambda p, full: None if (p / "b.bin").exists() else "incomplete") as e:
        assert sorted(x.name for x in e.path.iterdir()) == ["a.bin", "b.bin"]
    assert c.size() == 30


def _fill(c: cache.Cache, key: str, n: int) -> None:
    with c.open(key, _writer(b"z" * n)):
        pass


def test_lru_eviction_past_the_limit_spares_open_entries(tmp_path):
    c = cache.Cache("shards", tmp_path, cache_limit=3000)
    for i, key in enumerate(("a", "b", "c")):
        _fill(c, key, 1000)
        os.utime(c.path(key), (1000 + i, 1000 + i))  # a, b, c from least to most recent
    held = c.open("a", _writer(b""))  # opening touches it: now the most recent...
    os.utime(c.path("a"), (1, 1))  # ...made the oldest again, but it is open
    _fill(c, "d", 1000)  # needs room for 1000: "a" is open, so "b" goes
    assert sorted(p.name for p in c.folder.iterdir() if not p.name.startswith(".")) == ["a", "c", "d"]
    held.close()
    _fill(c, "e", 1500)  # now "a" (oldest, closed) and then "c" go
    assert sorted(p.name for p in c.folder.iterdir() if not p.name.startswith(".")) == ["d", "e"]
    assert c.size() <= 3000
    # one limit over every kind under the root
    other = cache.Cache("tokens", tmp_path, cache_limit=3000)
    _fill(other, "t", 2000)
    assert c.size() <= 3000 and other.path("t").exists()


def test_an_open_entry_is_exceeded_not_removed(tmp_path):
    c = cache.Cache("shards", tmp_path, cache_limit=100)
    with c.open("big", _writer(b"b" * 500)) as e:
        _fill(c, "other", 50)
        assert e.path.read_bytes() == b"b" * 500


def _slow_maker(root: str, counter: str, start: float) -> None:
    time.sleep(max(0.0, start - time.time()))

    def make(tmp: Path) -> None:
        with open(counter, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(0.2)  # long enough that every other process asks while this one makes it
        tmp.write_bytes(b"s" * 4096)

    with cache.Cache("shards", root).open("shared", make, _check(b"s" * 4096)) as e:
        assert e.path.read_bytes() == b"s" * 4096


def _holder(root: str, ready, release) -> None:
    with cache.Cache("shards", root).open("held", _writer(b"h" * 100)):
        ready.set()
        release.wait(10)


def test_processes_sharing_a_cache_make_an_entry_once(tmp_path):
    ctx = multiprocessing.get_context("fork")
    counter = tmp_path / "calls"
    start = time.time() + 0.3
    procs = [ctx.Process(target=_slow_maker, args=(str(tmp_path), str(counter), start)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(20)
    assert [p.exitcode for p in procs] == [0] * 4
    assert len(counter.read_text().splitlines()) == 1


def test_an_entry_another_process_has_open_is_not_evicted(tmp_path):
    ctx = multiprocessing.get_context("fork")
    ready, release = ctx.Event(), ctx.Event()
    p = ctx.Process(target=_holder, args=(str(tmp_path), ready, release))
    p.start()
    try:
        assert ready.wait(10)
        c = cache.Cache("shards", tmp_path, cache_limit=150)
        os.utime(c.path("held"), (1, 1))
        _fill(c, "new", 100)
        assert c.path("held").exists()  # open in the other process
        release.set()
        p.join(10)
        _fill(c, "newer", 100)  # now nobody holds it, and it is the least recently used
        assert not c.path("held").exists() and not c.path("new").exists() and c.path("newer").exists()
    finally:
        release.set()
        p.join(10)


def test_bad_keys_and_unwritable_roots(tmp_path):
    c = cache.Cache("shards", tmp_path)
    with pytest.raises(ConfigError, match="cache key '../x'"):
        c.path("../x")
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(cache.CacheError, match=r"cannot be made .*set \$PACKER_CACHE"):
        cache.Cache("shards", blocker)
