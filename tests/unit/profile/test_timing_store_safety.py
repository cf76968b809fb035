"""The timing store is shared by concurrent runs and lives where anything may be put: writers lose none of
each other's entries, and a store path that is a fifo, a folder, a link or a huge file is ignored with one
warning, never a hang, a crash or a read of gigabytes. An empty CKPT_PLANNER_TIMINGS means the default
folder, never the working directory."""

from __future__ import annotations

import multiprocessing
import os
import stat
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
from ckpt_planner.cli.commands import main
from ckpt_planner.profile import timing_store
from ckpt_planner.profile.timing_store import STORE_ENV, TimingStore, TimingStoreWarning, open_store, store_dir

WRITERS, ENTRIES = 6, 60


def _writer(path: str, k: int, start) -> None:
    store = TimingStore(Path(path))
    start.wait()
    for i in range(ENTRIES):
        store.settle("ops", f"writer{k}-op{i}", 1e-3 * (1 + i), 0.7)
        store.save()  # one read-merge-write per entry: the most chances to lose another writer's


def test_concurrent_writers_keep_every_entry(tmp_path):
    path = tmp_path / "timings-x.json"
    ctx = multiprocessing.get_context("fork")  # the children only touch the file; no torch work in them
    start = ctx.Barrier(WRITERS)
    procs = [ctx.Process(target=_writer, args=(str(path), k, start)) for k in range(WRITERS)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0] * WRITERS
    assert len(TimingStore(path).data["ops"]) == WRITERS * ENTRIES


def _one_warning(path: Path, why: str) -> TimingStore:
    """The store at `path`, opened and saved to, with exactly one TimingStoreWarning naming it and `why`."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store = TimingStore(path)
        store.settle("ops", "mm", 0.002, 0.7)
        store.save()
        TimingStore(path).save()
    mine = [str(w.message) for w in caught if issubclass(w.category, TimingStoreWarning)]
    assert len(mine) == 1 and str(path) in mine[0] and why in mine[0], mine
    return store


def test_a_store_that_is_a_fifo_is_ignored_without_blocking(tmp_path):
    """Run apart, under a timeout: a blocking open of a fifo waits for a writer forever."""
    path = tmp_path / "timings-x.json"
    os.mkfifo(path)
    script = textwrap.dedent(f"""
        import sys, warnings
        from pathlib import Path
        from ckpt_planner.profile.timing_store import TimingStore, TimingStoreWarning
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            store = TimingStore(Path({str(path)!r}))
            store.settle("ops", "mm", 0.002, 0.7)
            store.save()
        mine = [str(w.message) for w in caught if issubclass(w.category, TimingStoreWarning)]
        print(len(mine), store.get("ops", "mm"), mine)
    """)
    try:
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("opening a timing store that is a fifo blocked")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("1 0.002 ") and "a fifo" in out.stdout, out.stdout
    assert stat.S_ISFIFO(os.lstat(path).st_mode)


def test_a_store_that_is_a_folder_is_ignored_with_one_warning(tmp_path):
    path = tmp_path / "timings-x.json"
    path.mkdir()
    (path / "mine.txt").write_text("the user's")
    store = _one_warning(path, "a folder")
    assert store.get("ops", "mm") == 0.002  # this run's own measurement still stands
    assert (path / "mine.txt").read_text() == "the user's"


def _bytes_read(monkeypatch) -> list[int]:
    real, counted = os.read, []
    monkeypatch.setattr(os, "read", lambda fd, n: counted.append(n) or real(fd, n))
    return counted


def test_a_link_to_a_huge_sparse_file_is_not_read(tmp_path, monkeypatch):
    huge = tmp_path / "huge"
    with open(huge, "wb") as f:
        f.truncate(4 << 30)  # 4 GiB, sparse: no disk used
    path = tmp_path / "timings-x.json"
    path.symlink_to(huge)
    counted = _bytes_read(monkeypatch)
    _one_warning(path, "a symbolic link")
    assert counted == [] and path.is_symlink() and huge.stat().st_size == 4 << 30


def test_a_store_file_beyond_the_size_bound_is_not_read(tmp_path, monkeypatch):
    path = tmp_path / "timings-x.json"
    with open(path, "wb") as f:
        f.truncate(timing_store.MAX_STORE_BYTES + 1)
    counted = _bytes_read(monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store = TimingStore(path)
    mine = [str(w.message) for w in caught if issubclass(w.category, TimingStoreWarning)]
    assert len(mine) == 1 and "bytes" in mine[0] and store.get("ops", "mm") is None, mine
    assert counted == []


@pytest.mark.parametrize("value", ["", "   "])
def test_an_empty_store_variable_means_the_default_folder(tmp_path, monkeypatch, value):
    monkeypatch.setenv(STORE_ENV, value)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    assert store_dir() == tmp_path / "cache" / "ckpt-planner"
    store = open_store("cpu")
    store.settle("ops", "mm", 0.002, 0.7)
    store.save()
    assert list(work.iterdir()) == [] and store.path.parent == tmp_path / "cache" / "ckpt-planner"
    assert TimingStore(store.path).get("ops", "mm") == 0.002


FACTORY = '''
import torch
from ckpt_planner.cli.examples import MLPChain


def make():
    torch.manual_seed(0)
    return MLPChain(d=16, blocks=2), (torch.randn(8, 16),)
'''


def test_the_command_line_says_one_line_and_goes_on(tmp_path, monkeypatch, capsys):
    """`profile` times the model, so it reads and writes the store: a folder there was exit 1."""
    monkeypatch.setenv(STORE_ENV, str(tmp_path / "store"))
    open_store("cpu").path.mkdir(parents=True)
    (tmp_path / "factory.py").write_text(FACTORY)
    code = main(["profile", f"{tmp_path}/factory.py:make"])
    _, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 0, err
    assert len(lines) == 1 and lines[0].startswith("ckpt-planner: warning: timing store") and "a folder" in lines[0], err
