"""Loading an apply folder changes nothing on disk before it has loaded: an earlier release's folder that
is then refused is left byte for byte and mode for mode as it was; one that loads has its load.py
replaced with each file's mode kept; and every read is bounded (a 10 GiB load.py is never read)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from ckpt_planner.cli.applied import _LOAD_PY
from ckpt_planner.cli.loading import load_applied
from ckpt_planner.errors import InputError

from tests.unit.cli.test_legacy import _copy


def _snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {p.name: (p.read_bytes(), stat.S_IMODE(p.stat().st_mode)) for p in folder.iterdir() if p.is_file()}


def test_an_earlier_folder_that_is_refused_is_left_as_it_was(tmp_path):
    folder = _copy(tmp_path)
    os.chmod(folder / "load.py", 0o755)
    os.chmod(folder / "manifest.json", 0o644)
    (folder / "inputs.pt").write_bytes(b"not a tensor file")
    before = _snapshot(folder)
    with pytest.raises(InputError, match="cannot read its tensors"):
        load_applied(folder)
    assert _snapshot(folder) == before


def test_an_earlier_folder_that_loads_keeps_its_modes(tmp_path):
    folder = _copy(tmp_path)
    os.chmod(folder / "load.py", 0o755)
    os.chmod(folder / "manifest.json", 0o644)
    load_applied(folder)
    assert (folder / "load.py").read_text() == _LOAD_PY  # replaced, as an earlier release's script is
    assert stat.S_IMODE((folder / "load.py").stat().st_mode) == 0o755
    assert stat.S_IMODE((folder / "manifest.json").stat().st_mode) == 0o644


def test_a_load_py_that_is_a_link_is_not_written_through(tmp_path):
    folder = _copy(tmp_path)
    target = tmp_path / "elsewhere.py"
    target.write_bytes((folder / "load.py").read_bytes())
    (folder / "load.py").unlink()
    (folder / "load.py").symlink_to(target)
    before = target.read_bytes()
    load_applied(folder)
    assert (folder / "load.py").is_symlink() and target.read_bytes() == before


def test_a_huge_load_py_is_never_read(tmp_path):
    """A 10 GiB sparse load.py under an address-space limit a little above what the process holds: loading
    the folder reads none of it (it cannot be an earlier release's script) and leaves it as it is."""
    folder = _copy(tmp_path)
    with open(folder / "load.py", "r+b") as f:
        f.truncate(10 << 30)
    script = textwrap.dedent(f"""
        import resource, sys
        import torch
        from ckpt_planner.cli.loading import load_applied
        from ckpt_planner.lower.rewrite import rewrite
        from ckpt_planner.plan import Plan
        size = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
        resource.setrlimit(resource.RLIMIT_AS, (size + (3 << 30), size + (3 << 30)))
        load_applied({str(folder)!r})
        print("loaded")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0 and "loaded" in out.stdout, out.stderr[-2000:]
    assert (folder / "load.py").stat().st_size == 10 << 30
