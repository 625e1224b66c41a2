"""A build found in ``--out`` stays whole until a new one commits: a rebuild that is refused, fails or is
stopped (a disk-space check, a bad record, a config error, a chat template that raises, Ctrl-C, a kill)
leaves the folder as it found it, byte for byte (a kill: plus the staging folder, which the next build
removes, after putting back whatever a stopped commit had moved). The user's files beside it are never
touched, and at no moment is there a file in the folder that packer cannot prove its own.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import forked, make_build, one_line
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_crash import HOLD, Moment, acted, at, killed_at

from packer import BuildConfig, build
from packer.building import output
from packer.checking.verify import verify
from packer.cli import main
from packer.contract import schema
from packer.contract.schema import STAGING
from packer.errors import PackerError

USERS = {"notes.txt": b"mine", "sub/shard-00000.arrow": b"nested, mine"}
# several shards (format 1's 12 bytes a token, as in test_crash: the commit is the same code in every format)
OLD = ["flan", "--limit", "600", "--shard-size", "1", "--batch-size", "4", "--format", "1", "-q"]


def tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def found(tmp_path_factory) -> Path:
    """A finished build of several shards with the user's files beside it."""
    out = tmp_path_factory.mktemp("found") / "out"
    for name, data in USERS.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(data)
    result = CliRunner().invoke(main, ["build", *OLD, "--overwrite", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert len(list(out.glob("shard-*.arrow"))) >= 3
    return out


@pytest.fixture
def out(found, tmp_path) -> Path:
    shutil.copytree(found, tmp_path / "out")
    return tmp_path / "out"


def _inputs(tmp: Path) -> dict[str, list[str]]:
    good = [json.dumps({"prompt": f"q{i}?", "completion": f"a{i}."}) for i in range(40)]
    (tmp / "bad.jsonl").write_text("\n".join([*good, json.dumps({"prompt": "q?", "completion": 5})]) + "\n")
    (tmp / "chat.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                             {"role": "assistant", "content": "yo"}]}) + "\n")
    (tmp / "raise.jinja").write_text("{{ raise_exception('this template refuses') }}")
    long = json.dumps({"text": "x " * 15_000})
    (tmp / "long.jsonl").write_text("\n".join([long] * LONG_RECORDS) + "\n")
    return {
        "a bad record": [str(tmp / "bad.jsonl"), "--prompt-field", "prompt", "--completion-field", "completion"],
        "every example dropped": ["flan", "--limit", "20", "--max-len", "8", "--overlong", "drop"],
        "a chat template that raises": [str(tmp / "chat.jsonl"), "--messages-field", "messages", "--chat-template",
                                        str(tmp / "raise.jinja")],
        # 80 × 15,000 tokens × 10,000 epochs: 144 GB of shards at least
        "no room on the disk": [str(tmp / "long.jsonl"), "--text-field", "text", "--max-len", "16384",
                                "--epochs", "10000", "--format", "1"],
        "no such tokenizer": ["flan", "--limit", "20", "--tokenizer", str(tmp / "nothing")],
    }


LONG_RECORDS = 80
ROOM = 12 * LONG_RECORDS * 15_000 * 10_000  # bytes: what check_room counts for that case (format 1)


CASES = ["a bad record", "every example dropped", "a chat template that raises", "no room on the disk",
         "no such tokenizer"]


@pytest.mark.parametrize("case", CASES)
def test_a_refused_rebuild_leaves_the_build_it_found(out, tmp_path, case):
    if case == "no room on the disk" and shutil.disk_usage(tmp_path).free > ROOM:
        pytest.skip(f"the disk has more than the {ROOM:,} bytes that case needs")
    before = tree(out)
    args = _inputs(tmp_path)[case]
    one_line(CliRunner().invoke(main, ["build", *args, "--overwrite", "-q", "--out", str(out)]))
    assert tree(out) == before and not (out / STAGING).exists()
    assert verify(out).ok


# the moments of a rebuild's commit, from its start to its end (the names are those of the new build)
SHARD = schema.shard_name(1)
REBUILD_MOMENTS = [
    Moment("tokenizing", "open", f"{STAGING}/tokens/ids.bin"),
    Moment("the old manifest moved out", "os.rename", schema.MANIFEST_NAME),
    Moment("old files being moved out", "os.rename", SHARD),
    Moment("every old file moved out", "os.rename", f"{STAGING}/{output.REPLACING}"),
    Moment("new files being moved in", "os.rename", f"{STAGING}/{SHARD}"),
    Moment("before the commit point", "os.rename", f"{STAGING}/{schema.PENDING}"),
]
NEW = ["flan", "--limit", "300", "--shard-size", "1", "--batch-size", "2", "--format", "1", "-q", "--overwrite"]


@pytest.mark.parametrize(("action", "moment"), [
    *(("kill", m) for m in REBUILD_MOMENTS),
    *(("ctrl_c", m) for m in REBUILD_MOMENTS[::2]),  # Ctrl-C runs the same roll-back as the next build's
], ids=lambda v: v if isinstance(v, str) else v.name)
def test_a_rebuild_stopped_before_its_commit_point_leaves_the_build_it_found(out, moment, action):
    """Killed: whatever the kill left is packer's (nothing else appears), and the next build, even one
    that is refused under the lock, finds the old build back, byte for byte. Ctrl-C: the build rolls
    itself back at once."""
    before = tree(out)
    if action == "kill":  # a forked child: SIGKILL ends it wherever it is, whatever process it is
        code, err = killed_at(moment, out, NEW)[1], ""
    else:  # Ctrl-C through a fresh interpreter's own handling of it, as a terminal sends it
        proc = at(moment, action, out, NEW)
        err = proc.communicate(timeout=HOLD)[1]
        code = proc.returncode
    assert acted(out) is not None, (moment.name, code, err)
    assert code == (-signal.SIGKILL if action == "kill" else 130), err
    assert set(output.survey(out).foreign) == {"notes.txt", "sub"}
    assert {k: v for k, v in tree(out).items() if k in USERS} == USERS
    if action == "kill":
        args = ["flan", "--limit", "20", "--max-len", "8", "--overlong", "drop", "--overwrite"]  # fails in the lock
        one_line(CliRunner().invoke(main, ["build", *args, "-q", "--out", str(out)]))
    assert tree(out) == before and not (out / STAGING).exists()


def test_a_rebuild_killed_while_its_commit_is_rolled_back_is_rolled_back_by_the_next(out):
    before = tree(out)
    assert killed_at(REBUILD_MOMENTS[4], out, NEW)[1] == -signal.SIGKILL  # new files being moved in
    assert acted(out) is not None
    # the next build takes the lock and rolls back: killed as it moves an old file back in
    rolling_back = Moment("rolling back", "os.rename", f"{STAGING}/{output.REPLACING}/{SHARD}")
    assert killed_at(rolling_back, out, NEW)[1] == -signal.SIGKILL
    assert acted(out) is not None
    one_line(CliRunner().invoke(main, ["build", *OLD[:-1], "--max-len", "8", "--overlong", "drop", "--overwrite",
                                       "-q", "--out", str(out)]))
    assert tree(out) == before and not (out / STAGING).exists()


# -- the property ------------------------------------------------------------------------------------

# what a build does to the files under --out that a kill or Ctrl-C can land on (Python reports each)
EVENTS = {"open", "os.rename", "os.remove", "os.rmdir", "os.mkdir", "shutil.rmtree", "os.listdir", "os.scandir"}
CONFIGS = [dict(limit=6, batch_size=2), dict(limit=10, batch_size=4, seed=1), dict(limit=8, pack="bfd", max_len=512),
           dict(limit=12, batch_size=2, seed=2)]
BAD = "bad"  # a source whose last record is bad: the build fails as it tokenizes
REFUSED = "refused"  # no --overwrite beside the user's files: refused before the lock


def _run(config: BuildConfig, stop: tuple[str, int] | None) -> int:
    """Run the build in a forked child (a real process to kill, without a new interpreter's start-up),
    stopping it the nth time it touches a path under --out: SIGKILL, or Ctrl-C (KeyboardInterrupt at
    that moment). Its exit code: 0, 2 (a PackerError), 130, or -9."""

    def child() -> int:
        if stop is not None:
            action, nth = stop
            me, prefix, seen = os.getpid(), config.out, [0]

            def hook(name, args):
                if name not in EVENTS or os.getpid() != me or not args:
                    return
                first = os.fsdecode(args[0]) if isinstance(args[0], (str, bytes, os.PathLike)) else ""
                if first != prefix and not first.startswith(prefix + "/"):
                    return
                seen[0] += 1
                if seen[0] == nth:
                    if action == "kill":
                        os.kill(me, signal.SIGKILL)
                    raise KeyboardInterrupt

            sys.addaudithook(hook)
        try:
            build(config)
            return 0
        except PackerError:
            return 2
        except KeyboardInterrupt:
            return 130

    return forked(child)[1]


_REFERENCES: dict[int, dict[str, bytes]] = {}


def reference(k: int) -> dict[str, bytes]:
    """Config ``k``'s build made alone in a fresh folder: the bytes a committed build must have."""
    if k not in _REFERENCES:
        with tempfile.TemporaryDirectory() as tmp:
            _REFERENCES[k] = tree(make_build(Path(tmp) / "out", num_proc=1, **CONFIGS[k]))
    return _REFERENCES[k]


# a rebuild touches paths under --out about 70 times, its commit from about the 40th to the 60th
MOMENT = st.one_of(st.integers(1, 75), st.integers(38, 62))
STEP = st.tuples(st.sampled_from([*range(len(CONFIGS)), BAD, REFUSED]),
                 st.one_of(st.none(), st.tuples(st.sampled_from(["kill", "kill", "ctrl_c"]), MOMENT)))
# the quick suite's size; a wide sweep: PACKER_REBUILD_EXAMPLES=300
EXAMPLES = int(os.environ.get("PACKER_REBUILD_EXAMPLES", "10"))


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(STEP, min_size=1, max_size=3))
def test_any_sequence_of_builds_leaves_the_last_committed_one(steps):
    """Builds into one folder beside the user's files (random small configs; some refused, some failing
    on a bad record, some killed or interrupted at a random moment): after each that ran to its end,
    the folder holds the last committed build byte for byte (or nothing of packer's), and one refused
    before it takes the lock leaves the folder as it was; after a kill, nothing there that packer cannot
    prove its own, and once the next build takes the lock, the last committed build again."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        bad = Path(tmp) / "bad.jsonl"
        bad.write_text("".join(json.dumps({"prompt": f"q{i}?", "completion": "a."}) + "\n" for i in range(8))
                       + json.dumps({"prompt": "q?", "completion": 5}) + "\n")
        for name, data in USERS.items():
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            (out / name).write_bytes(data)
        committed: int | None = None

        def packers() -> dict[str, bytes]:
            return {k: v for k, v in tree(out).items() if k not in USERS}

        def expected() -> dict[str, bytes]:
            return {} if committed is None else reference(committed)

        for what, stop in steps:
            if what == BAD:
                config = BuildConfig(source=str(bad), out=str(out), prompt_field="prompt",
                                     completion_field="completion", overwrite=True, num_proc=1)
            else:
                config = BuildConfig(source="flan", out=str(out), overwrite=what != REFUSED, num_proc=1,
                                     **CONFIGS[0 if what == REFUSED else what])
            before = tree(out)
            # what a kill left (a commit halfway, a staging folder): put back by the next build to take the lock
            dirty = packers() != expected()
            code = _run(config, stop)
            event(f"{'refused' if what == REFUSED else 'bad' if what == BAD else 'build'}: {code}")
            assert code in (0, 2, 130, -signal.SIGKILL), code
            assert {k: v for k, v in tree(out).items() if k in USERS} == USERS
            assert set(output.survey(out).foreign) == {"notes.txt", "sub"}  # all else provably packer's
            manifest = out / schema.MANIFEST_NAME
            reached = code == 0 or (code == -signal.SIGKILL and not (out / STAGING / schema.PENDING).exists())
            if reached and isinstance(what, int) and manifest.exists() and \
                    manifest.read_bytes() == reference(what)[schema.MANIFEST_NAME]:
                committed = what  # it reached its commit point
            if what == REFUSED:  # refused before it takes the lock: it touches nothing
                assert tree(out) == before, (what, stop, code)
            elif code != -signal.SIGKILL and not (dirty and tree(out) == before):  # (or stopped before the lock)
                left = {k: v for k, v in packers().items() if not k.startswith(STAGING + "/")}
                assert left == expected(), (what, stop, code)
                # a staging folder stays only for an interrupted build's spill, with no build to keep
                assert not (out / STAGING).exists() or (code == 130 and committed is None), (what, stop, code)
        output.remove_stale_staging(out)  # what the next build does first: take the lock, put back, release
        assert packers() == expected()
        assert {k: v for k, v in tree(out).items() if k in USERS} == USERS
