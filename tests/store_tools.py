"""The token store's entries as tests/test_token_store.py and tests/test_store_mix.py see them: listed, and damaged
between builds as a disk, a person or a kill would (one place, so both properties damage entries alike)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from packer.building import token_store

# what damage_entry does to an entry already there
ENTRY_DAMAGE = ("truncate", "flip", "no_meta", "torn_meta", "edited_meta", "foreign")


def entry_dirs() -> list[Path]:
    """The store's entries (not its locks, nor entries being written or evicted)."""
    root = token_store.folder()
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")) if root.is_dir() else []


@contextmanager
def own_cache() -> Iterator[Path]:
    """A fresh cache root for one hypothesis example (the fixture's is per test, not per example)."""
    before = os.environ["PACKER_CACHE"]
    folder = tempfile.mkdtemp(prefix="packer-cache-")
    os.environ["PACKER_CACHE"] = folder
    try:
        yield Path(folder)
    finally:
        os.environ["PACKER_CACHE"] = before
        shutil.rmtree(folder, ignore_errors=True)


def killed_writer() -> None:
    """A writer killed before its rename: a temporary folder of the store, half made."""
    temp = token_store.folder() / f".tmp-{'0' * 32}.{os.getpid()}.deadbeef"
    temp.mkdir(parents=True, exist_ok=True)
    (temp / "ids.bin").write_bytes(b"\x01\x02\x03")


def damage_entry(entry: Path, kind: str) -> None:
    """Damage ``entry`` in one of the ``ENTRY_DAMAGE`` ways: a file cut short or a bit flipped (sizes and hashes
    find it), its meta.json gone, torn or edited (its own sha256 finds it), or the meta of another identity under
    this key (never used)."""
    if kind == "truncate":
        with open(entry / "ids.bin", "r+b") as f:
            f.truncate(max(0, (entry / "ids.bin").stat().st_size - 4))
    elif kind == "flip":
        data = bytearray((entry / "trained.bin").read_bytes())
        data[len(data) // 2] ^= 1
        (entry / "trained.bin").write_bytes(bytes(data))
    elif kind == "no_meta":
        (entry / "meta.json").unlink()
    elif kind == "torn_meta":
        text = (entry / "meta.json").read_text()
        (entry / "meta.json").write_text(text[: len(text) // 2])
    elif kind == "edited_meta":  # what it says of its files changed, as JSON still well formed
        meta = json.loads((entry / "meta.json").read_text())
        meta["skips"] = {"at": [0], "reasons": ["malformed_json"]}
        (entry / "meta.json").write_text(json.dumps(meta))
    elif kind == "foreign":
        meta = json.loads((entry / "meta.json").read_text())
        meta["identity"]["config"]["train_on"] = "another"
        from packer.building.token_store import _meta_sha256

        meta["sha256"] = _meta_sha256(meta)  # an entry written so: sound, of another identity
        (entry / "meta.json").write_text(json.dumps(meta))
    else:
        raise ValueError(kind)
