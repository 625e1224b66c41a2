"""Shared fixtures: real builds of the bundled sample, made once per test session."""

from __future__ import annotations

import atexit
import gc
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

# One torch thread per process, in this process and (inherited) in every process a test starts. The
# models here are tiny, so a second intra-op thread buys nothing, and on a shared machine it costs
# ~4-10x: OpenMP's threads spin waiting for a core another process holds (test_attention + test_mixers:
# 5.4 s with one thread, 22-55 s with two, beside one other busy process). Set before torch is
# imported; a value given in the environment wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# botocore looks for credentials at the cloud's metadata address when none are set: the tests never leave the
# loopback (their S3 server sets its own credentials and endpoint: tests/loopback.py)
os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
# The cache (the token store, remote shards) is never the user's ~/.cache: each test has its own (``_own_cache``), in
# this process and in the processes it starts with the environment of the moment. An environment a module copied
# when it was imported (test_crash's ENV) gets the session's folder with a limit of 0 bytes, which keeps no tokens:
# no test re-plans from another test's tokens, whatever the order they run in.
os.environ["PACKER_CACHE"] = tempfile.mkdtemp(prefix="packer-test-cache-")
os.environ["PACKER_CACHE_LIMIT"] = "0"

from packer import BuildConfig, build

atexit.register(shutil.rmtree, os.environ["PACKER_CACHE"], True)

ROOT = Path(__file__).resolve().parent.parent
# The maintainers' GSM8K and tokenizers. PACKER_SHARED_DATA points the tests elsewhere (.ci/run points it at a
# missing folder to run, a second time, every test that used it: each must skip, as on a fresh clone).
SHARED_DATA = Path(os.environ.get("PACKER_SHARED_DATA") or ROOT.parent / "shared" / "data")
BUNDLED_TOKENIZER = ROOT / "packer" / "data" / "tokenizer"


def pytest_collection_finish(session) -> None:
    """What the test modules imported (torch, transformers, TRL: millions of objects that live as long as the
    process) is moved out of the collector's sight: the cyclic collector otherwise walks them all on each
    full collection, an eighth of the suite's time (measured over test_loader, test_context_parallel,
    test_chat and test_inspect: 4.1 s of 34 s collecting, 2.1 s after). Objects the tests make are
    collected as ever."""
    gc.collect()
    gc.freeze()


def files_signature(folder: Path) -> tuple:
    """What changes when a file under ``folder`` is rewritten (transformers also reads subfolders, e.g.
    ``additional_chat_templates/``): each file's path, size and mtime."""
    return tuple(sorted((str(p.relative_to(folder)), p.stat().st_size, p.stat().st_mtime_ns)
                        for p in folder.rglob("*") if p.is_file()))


@pytest.fixture(autouse=True)
def _own_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("PACKER_CACHE", str(tmp_path_factory.mktemp("cache")))
    monkeypatch.delenv("PACKER_CACHE_LIMIT")


@pytest.fixture(scope="session", autouse=True)
def _tokenizer_folders_loaded_once():
    """In this process, transformers loads each tokenizer folder once (0.2-0.6 s for a real vocabulary), not
    once per build: hundreds of builds use the same few folders. packer's own code then reads that load as
    it always does (``Tokenizer``); it never changes it. A folder whose files change (size or mtime), or a
    copy elsewhere, is loaded again, and a load that fails is not kept, so every refusal runs each time.
    Builds in subprocesses (the CLI, Ctrl-C, the wheel) load their own."""
    from packer.building import tokenization

    real = tokenization._tokenizer_class
    loaded: dict[tuple, object] = {}

    class Once:
        def __init__(self, cls):
            self.cls = cls

        def from_pretrained(self, path: str, **kwargs):
            key = (self.cls, str(Path(path).resolve()), files_signature(Path(path)), tuple(sorted(kwargs.items())))
            if key not in loaded:
                loaded[key] = self.cls.from_pretrained(path, **kwargs)
            return loaded[key]

    tokenization._tokenizer_class = lambda folder: Once(real(folder))
    yield
    tokenization._tokenizer_class = real


def rewrite_column(path: Path, column: str, change) -> None:
    """Rewrite the one-batch shard at ``path`` with ``change(flat_values, offsets)`` applied to one column
    (``offsets`` None for a scalar column); the other columns are written back as they were."""
    import pyarrow as pa

    table = pa.ipc.open_stream(pa.BufferReader(path.read_bytes())).read_all().combine_chunks()
    columns = []
    for name in table.schema.names:  # whichever format the shard is in, as it is
        col = table.column(name).chunk(0)
        if name == column:
            if isinstance(col, pa.ListArray):
                values = col.values.to_numpy(zero_copy_only=False).copy()
                change(values, col.offsets.to_numpy())
                col = pa.ListArray.from_arrays(col.offsets, pa.array(values, col.type.value_type))
            else:
                values = col.to_numpy().copy()
                change(values, None)
                col = pa.array(values, col.type)
        columns.append(col)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_batch(pa.RecordBatch.from_arrays(columns, schema=table.schema))


ABSENT = "is absent (the shared GSM8K and tokenizers)"  # the end of need_shared's one skip reason


def need_shared(path: Path | str) -> Path:
    """``path`` under ../shared/data (given relative to it, or whole), or this test skipped with one reason
    spelt one way for every such test: a tokenizer folder needs its tokenizer.json, a file itself."""
    path = SHARED_DATA / path
    if path.is_relative_to(SHARED_DATA):  # (a whole path elsewhere, the bundled tokenizer say, is no use of it)
        _shared_use.mark()
    there = path.is_file() if path.suffix else (path / "tokenizer.json").is_file()
    if not there:
        pytest.skip(f"../shared/data/{path.relative_to(SHARED_DATA)} {ABSENT}")
    return path


# -- which tests use the shared data, and whether they all skip without it (.ci/run) -------------------


def pytest_addoption(parser) -> None:
    group = parser.getgroup("packer")
    group.addoption("--shared-log", metavar="FILE",
                    help="write to FILE the ids of the tests that used ../shared/data (need_shared, a fixture "
                         "that called it, or a file opened or listed under it)")
    group.addoption("--shared-hidden", metavar="FILE",
                    help="run only the tests FILE lists (a --shared-log), with PACKER_SHARED_DATA pointing at a "
                         "missing folder: the run fails unless each skips with need_shared's reason")


class _SharedUse:
    """Which tests and fixtures touched the shared data during a run: need_shared called while they ran,
    or (an audit hook, so a test that forgot need_shared is found too) a path under it opened or listed."""

    def __init__(self) -> None:
        self.current: str | None = None  # the test or fixture now running
        self.tests: set[str] = set()
        self.fixtures: set[str] = set()
        self.logged: set[str] = set()  # the tests whose reports said they used it (pytest_runtest_logreport)

    def mark(self) -> None:
        if self.current is not None:
            (self.fixtures if self.current.startswith("fixture:") else self.tests).add(self.current.removeprefix("fixture:"))

    def audit(self, event: str, args: tuple) -> None:
        if event in ("open", "os.listdir", "os.scandir") and args and isinstance(args[0], str | bytes | os.PathLike):
            path = os.fsdecode(args[0])
            if path.startswith(self.root):
                self.mark()

    def start(self) -> None:
        self.root = str(SHARED_DATA)
        import sys

        sys.addaudithook(self.audit)  # for the rest of the process: only in a --shared-log run


_shared_use = _SharedUse()


def _is_xdist_worker(config) -> bool:
    return hasattr(config, "workerinput")


def pytest_configure(config) -> None:
    if config.getoption("--shared-log"):
        _shared_use.start()
    if config.getoption("--shared-hidden") and SHARED_DATA.exists():
        raise pytest.UsageError(f"--shared-hidden: PACKER_SHARED_DATA must name a missing folder, not {SHARED_DATA}")


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
    before, _shared_use.current = _shared_use.current, f"fixture:{fixturedef.argname}"
    try:
        return (yield)
    finally:
        _shared_use.current = before


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _shared_use.current = item.nodeid
    try:
        return (yield)
    finally:
        _shared_use.current = None


# The test files of the longest run time (seconds, measured on two workers, idle: test_crash 27, test_ecosystem 19,
# test_preference 18, ... down to 10), longest first. With -n 2 each worker takes one file at a time (loadfile, in
# the order collected: pytest_xdist_make_scheduler below), so these are handed out first and the workers
# end within seconds of each other, instead of one running a 20-second file alone at the end. Only an order: a
# file missing from the list, or one grown slow, costs time, never a result. A run on one process keeps pytest's
# order.
SLOW_FIRST = ("test_crash.py", "test_ecosystem.py", "test_preference.py", "test_rebuild.py", "test_images.py",
              "test_image_store.py", "test_token_store.py", "test_store_mix.py", "test_chat_tokenizer.py", "test_parallel.py",
              "test_remote.py", "test_train.py", "test_build_guards.py", "test_chat_turns.py", "test_stream_bounds.py")


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: a run without it (no -n, or no xdist) never calls it
def pytest_xdist_make_scheduler(config, log):
    """``-n N`` without a ``--dist`` of its own: each test file whole in one worker (its module fixtures made once:
    a Ray cluster, a build), the files handed out in the order collected (SLOW_FIRST first). Chosen here, not in
    pyproject's addopts, so that a plain ``python -m pytest`` runs where pytest-xdist is not installed."""
    if config.getvalue("dist") != "load":  # -n's default (as --dist load): another --dist is the runner's choice
        return None
    from xdist.scheduler import LoadFileScheduling

    config.option.loadscopereorder = False
    return LoadFileScheduling(config, log)


def pytest_collection_modifyitems(config, items) -> None:
    if _is_xdist_worker(config):  # every worker collects, and orders, the same
        rank = {name: i for i, name in enumerate(SLOW_FIRST)}
        items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's own order kept
    listed = config.getoption("--shared-hidden")
    if listed:
        wanted = set(Path(listed).read_text().splitlines())
        keep = [item for item in items if item.nodeid in wanted]
        config.hook.pytest_deselected(items=[item for item in items if item.nodeid not in wanted])
        items[:] = keep


# Under pytest-xdist each worker is a session of its own and sees only its tests; the controller sees every
# test's reports. So a worker says on a test's last report whether that test used the shared data, and the
# process that sees every report (the controller, or the one process of a plain run) writes the log.
SHARED_USED = "packer_shared_data"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    # at teardown every fixture the test asked for has been set up (and marked itself if it used the data)
    if report.when == "teardown" and (item.nodeid in _shared_use.tests or _shared_use.fixtures & set(item.fixturenames)):
        report.user_properties.append((SHARED_USED, True))
    return report


def pytest_runtest_logreport(report) -> None:
    if (SHARED_USED, True) in report.user_properties:
        _shared_use.logged.add(report.nodeid)
    if report.skipped and ABSENT in str(report.longrepr):
        return
    if (report.when == "call" or not report.passed) and hasattr(_shared_use, "hidden_wrong"):
        _shared_use.hidden_wrong.append(f"{report.nodeid} {report.outcome} ({report.when})")


def pytest_sessionstart(session) -> None:
    if session.config.getoption("--shared-hidden"):
        _shared_use.hidden_wrong = []


def pytest_sessionfinish(session, exitstatus) -> None:
    if _is_xdist_worker(session.config):
        return  # the controller writes the log and judges the hidden run, from every worker's reports
    log = session.config.getoption("--shared-log")
    if log:
        Path(log).write_text("".join(f"{nodeid}\n" for nodeid in sorted(_shared_use.logged)))
    wrong = getattr(_shared_use, "hidden_wrong", None)
    if wrong:
        print("\nwith ../shared/data hidden, these tests did not skip with need_shared's reason "
              "(a fresh clone would see them so; call need_shared first):\n  " + "\n  ".join(wrong))
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def one_line(result) -> str:
    """The one stderr line of a CLI run (click's CliRunner) that failed as a user error: exit code 2."""
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert "Traceback" not in result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def forked(child) -> tuple[int, int]:
    """Run ``child()`` in a fork of this process (a real process to stop, without a new interpreter's seconds of
    start-up) and wait for it: (pid, its exit code: what ``child`` returns; 70 if it raised; -N if signal N ended
    it). The child leaves by ``os._exit``, so nothing of pytest runs in it after ``child``."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 70
        try:
            code = child()
        finally:
            os._exit(code)
    return pid, os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def make_build(out: Path, source: str = "flan", **options) -> Path:
    """Build into ``out`` through the library (the CLI tests go through click) and return ``out``."""
    build(BuildConfig(source=source, out=str(out), **options))
    return out


@pytest.fixture(scope="session")
def flan_batch(tmp_path_factory) -> Path:
    """300 bundled records, batch mode of 4, max_len 512 (so some examples are truncated)."""
    return make_build(tmp_path_factory.mktemp("flan_batch"), limit=300, batch_size=4, max_len=512)


@pytest.fixture(scope="session")
def flan_bfd(tmp_path_factory) -> Path:
    """300 bundled records, bfd into 1,024-token rows, over-long examples split."""
    return make_build(tmp_path_factory.mktemp("flan_bfd"), limit=300, pack="bfd", max_len=1024, overlong="split")


# several chunks (of spill.CHUNK records: three, the last of one) and several shards: what parallel engines split
PARALLEL = dict(source="flan", limit=2001, pack="bfd", max_len=1024, overlong="split", shard_size_mb=1)


@pytest.fixture(scope="session")
def parallel_reference(tmp_path_factory) -> Path:
    """PARALLEL built in one process (num_proc=1): the bytes every engine and worker count must give."""
    out = tmp_path_factory.mktemp("parallel_reference") / "one"
    build(BuildConfig(out=str(out), num_proc=1, **PARALLEL))
    assert len(list(out.glob("shard-*.arrow"))) > 1
    return out


@pytest.fixture(scope="session")
def llama2_tokenizer() -> Path:
    return need_shared("llama2-tokenizer")


@pytest.fixture(scope="session")
def gsm8k_file() -> Path:
    return need_shared("gsm8k_train.jsonl")


def shard_rows(path: Path) -> list[dict]:
    """A shard's rows as dicts, with ``labels`` whichever format it is in: a format-2 shard stores the
    loss as ``loss_mask``, whose labels are the ids where it is set and -100 elsewhere."""
    from packer.contract import schema

    out = schema.open_shard(path).to_pylist()
    for row in out:
        if schema.LOSS_MASK in row:
            row["labels"] = [t if m else schema.IGNORE_INDEX for t, m in zip(row["input_ids"], row[schema.LOSS_MASK],
                                                                             strict=True)]
    return out
