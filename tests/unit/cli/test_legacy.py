"""Apply folders written by earlier releases load today: their data as it is, and their load.py, whose
imports name module paths that are gone, replaced by today's when byte for byte what an apply wrote."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

from ckpt_planner.choose.safety_net import step_differences
from ckpt_planner.cli.applied import _LOAD_PY
from ckpt_planner.cli.legacy import EARLIER_LOAD_SCRIPTS
from ckpt_planner.cli.loading import load_applied

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
STAGE_LAYOUT = FIXTURES / "apply_folder_stage_layout"  # written by `ckpt-planner apply` before the choose/ stage


def _copy(tmp_path: Path) -> Path:
    folder = tmp_path / "applied"
    shutil.copytree(STAGE_LAYOUT, folder)
    return folder


def _run_load_py(folder: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "load.py"], cwd=folder, capture_output=True, text=True, timeout=300)


def test_an_earlier_apply_folder_loads_and_its_step_is_the_models(tmp_path):
    folder = _copy(tmp_path)
    assert hashlib.sha256((folder / "load.py").read_bytes()).hexdigest() in EARLIER_LOAD_SCRIPTS
    applied = load_applied(folder)
    args = applied.example_inputs if isinstance(applied.example_inputs, tuple) else (applied.example_inputs,)
    assert applied.plan.regions and step_differences(applied.model, applied.module, args, {}) == []
    # its load.py imported paths that are gone: now today's, and the manifest records it as apply's own
    assert (folder / "load.py").read_text() == _LOAD_PY
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["written"]["load.py"] == hashlib.sha256(_LOAD_PY.encode()).hexdigest()
    out = _run_load_py(folder)
    assert out.returncode == 0 and "one training step" in out.stdout, out.stderr


def test_an_earlier_load_py_fails_today_until_it_is_refreshed(tmp_path):
    """The reason for the refresh: the stage layout's own script cannot run against today's modules."""
    out = _run_load_py(_copy(tmp_path))
    assert out.returncode != 0 and "ModuleNotFoundError" in out.stderr


def test_a_flat_layout_load_py_is_refreshed_too(tmp_path):
    folder = _copy(tmp_path)
    (folder / "load.py").write_text((FIXTURES / "load_py_flat_layout.txt").read_text())
    manifest = json.loads((folder / "manifest.json").read_text())
    del manifest["written"]  # the flat layout recorded no digests
    (folder / "manifest.json").write_text(json.dumps(manifest))
    load_applied(folder)
    assert (folder / "load.py").read_text() == _LOAD_PY


def test_a_load_py_the_user_edited_is_left_alone(tmp_path):
    folder = _copy(tmp_path)
    edited = (folder / "load.py").read_text() + "\n# my own line\n"
    (folder / "load.py").write_text(edited)
    load_applied(folder)
    assert (folder / "load.py").read_text() == edited


def test_todays_load_py_imports_one_module_of_ours():
    imports = [ln.strip() for ln in _LOAD_PY.splitlines() if "import" in ln and "ckpt_planner" in ln]
    assert imports and all(ln.startswith("from ckpt_planner.cli.loading import ") for ln in imports), imports
