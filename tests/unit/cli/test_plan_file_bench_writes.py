"""Benchmarks write their results through one writer (benchmarks/_io.py) that never follows a link it did
not make: `--out DIR` may be a folder someone else made on a shared machine. A result name that is a
link, or an output folder that is one, is refused with one line and exit 2, and nothing is written."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import _io

ROOT = Path(__file__).resolve().parents[3]
RESULTS = ROOT / "benchmarks" / "results"


def test_compile_from_json_does_not_write_through_a_link(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    shutil.copy(RESULTS / "compile.json", out / "compile.json")
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    (out / "compile.md").symlink_to(victim)
    run = subprocess.run([sys.executable, "-m", "benchmarks.compile", "--from-json", "--out", str(out)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 2, run.stderr[-2000:]
    assert run.stderr.strip().count("\n") == 0 and "symbolic link" in run.stderr
    assert victim.read_text() == "keep me\n" and (out / "compile.md").is_symlink()


def test_every_name_is_checked_before_the_first_is_written(tmp_path, capsys):
    (tmp_path / "b.md").symlink_to(tmp_path / "elsewhere.md")
    with pytest.raises(SystemExit) as info:
        _io.write_files(tmp_path, {"a.json": "{}", "b.md": "# b"})
    assert info.value.code == 2 and "b.md" in capsys.readouterr().err
    assert not (tmp_path / "a.json").exists() and not (tmp_path / "elsewhere.md").exists()


def test_an_output_folder_that_is_a_link_is_refused(tmp_path, capsys):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "out").symlink_to(real)
    with pytest.raises(SystemExit) as info:
        _io.write_files(tmp_path / "out", {"a.json": "{}"})
    assert info.value.code == 2 and "symbolic link" in capsys.readouterr().err
    assert not any(real.iterdir())


def test_a_result_replaced_keeps_its_mode_and_a_new_one_is_made(tmp_path):
    (tmp_path / "a.json").write_text("old")
    os.chmod(tmp_path / "a.json", 0o640)
    _io.write_files(tmp_path / "new" / "deeper", {"x.md": "made"})
    _io.write_files(tmp_path, {"a.json": "new"})
    assert (tmp_path / "a.json").read_text() == "new"
    assert stat.S_IMODE((tmp_path / "a.json").stat().st_mode) == 0o640
    assert (tmp_path / "new" / "deeper" / "x.md").read_text() == "made"
