"""The README's first set-up command, run as written in a fresh copy of the repository, installs what the
README's examples need: in the virtual environment it makes, the Quickstart and every command line of the
"Command line" section run as written (test_readme.py runs every block in the development environment)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .test_readme import _blocks, _command_lines, _setup_commands

# A virtual environment installed from the package index, the demo, the Quickstart and the CLI: many minutes.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SKIP = shutil.ignore_patterns(".venv", ".git", "__pycache__", "*.egg-info", ".pytest_cache", "build", "*.pt2")


def _clean_env() -> dict[str, str]:
    """This process's environment without its virtual environment: `python3` is the system's, as on a
    fresh machine (the timing store and pip's cache and index settings stay)."""
    env = dict(os.environ)
    venv = env.pop("VIRTUAL_ENV", None)
    prefixes = [p for p in (venv, sys.prefix) if p]
    env["PATH"] = os.pathsep.join(
        p for p in env.get("PATH", "").split(os.pathsep) if not any(p.startswith(str(x)) for x in prefixes)
    )
    env.pop("PYTHONPATH", None)
    env.pop("PYTHONHOME", None)
    return env


def _bash(command: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True)


def test_readme_first_command_installs_what_the_readme_runs(tmp_path) -> None:
    install, tests = _setup_commands()
    assert "ckpt-planner demo" in install and "pytest" in tests  # exactly two: the main job, the tests
    clone = tmp_path / "ckpt-planner"
    shutil.copytree(ROOT, clone, ignore=SKIP)
    env = _clean_env()
    done = _bash(install, clone, env)  # the README's line, as written, from the repository's root
    assert done.returncode == 0, done.stderr[-3000:]
    assert "verified: outputs equal, gradients bitwise equal" in done.stdout, done.stdout[-3000:]

    work = tmp_path / "work"
    work.mkdir()
    activate = f". {clone / '.venv' / 'bin' / 'activate'} && "
    quickstart = next(b for b in _blocks() if "def make_model" in b)
    (work / "quickstart.py").write_text(quickstart)
    (work / "models.py").write_text(next(b for b in _blocks() if b.startswith("# models.py")))
    ran = _bash(activate + "python quickstart.py", work, env)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "predicted step time" in ran.stdout and (work / "plan.json").is_file()
    for line in _command_lines():
        ran = _bash(activate + line, work, env)
        assert ran.returncode == 0, f"{line}\n{ran.stderr[-3000:]}"
    assert (work / "report.html").is_file() and (work / "checkpointed" / "load.py").is_file()
