"""The installed package: one import name, `ckpt_planner`, that a user's own files cannot shadow."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def _run(code: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=str(cwd), capture_output=True, text=True, timeout=300)


def test_user_files_named_planner_and_solvers_do_not_shadow(tmp_path):
    """A `solvers.py` and a `planner.py` in the working directory are the user's; ours stay reachable."""
    (tmp_path / "solvers.py").write_text("raise SystemExit('the user solvers.py was imported')\n")
    (tmp_path / "planner.py").write_text("raise SystemExit('the user planner.py was imported')\n")
    code = (
        "import torch\n"
        "from ckpt_planner import optimize\n"
        "from ckpt_planner.solvers import Problem, solve\n"
        "plan = optimize(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)),"
        " (torch.randn(3, 4),), solver='none')\n"
        "print('planned', plan.solver)\n"
    )
    out = _run(code, tmp_path)
    assert out.returncode == 0, out.stderr
    assert "planned none" in out.stdout


def test_nothing_named_planner_or_solvers_is_importable(tmp_path):
    """Installing puts one top-level package into site-packages, not `planner` and `solvers`."""
    code = (
        "import importlib.util\n"
        "print(importlib.util.find_spec('planner'), importlib.util.find_spec('solvers'))\n"
        "print(importlib.util.find_spec('ckpt_planner') is not None)\n"
    )
    out = _run(code, tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["None None", "True"]


def test_top_level_import_is_torch_free_and_exports_functions(tmp_path):
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import ckpt_planner, ckpt_planner.solvers\n"
        "assert ckpt_planner.__version__\n"
        "print('ok')\n"
    )
    out = _run(code, tmp_path)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr
    code = (
        "import importlib, ckpt_planner\n"
        "importlib.import_module('ckpt_planner.verification'); importlib.import_module('ckpt_planner.capture.trace')\n"
        "from ckpt_planner import verify\n"
        "assert callable(verify) and verify.__name__ == 'verify', verify\n"
        "from ckpt_planner.capture import capture\n"
        "from ckpt_planner.profile import profile\n"
        "assert capture.__name__ == 'capture' and profile.__name__ == 'profile'\n"
        "assert set(ckpt_planner.__all__) <= set(dir(ckpt_planner))\n"
        "assert all(getattr(ckpt_planner, n) is not None for n in ckpt_planner.__all__)\n"
        "print('ok')\n"
    )
    out = _run(code, tmp_path)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr
