"""Every Python block of the README, then of docs/training.md (the README's training section, in full), runs as
written, in order, in one session (loops shortened to two steps), and the command-line examples on the
README's models.py run with exit code 0."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import tempfile
import warnings
from pathlib import Path

import pytest
import torch

# Every block plans and trains a model, and the CLI lines run: minutes on 2 cores.
pytestmark = pytest.mark.slow

README = Path(__file__).resolve().parents[2] / "README.md"
TRAINING = README.parent / "docs" / "training.md"
SHORTER = {"range(100)": "range(2)", "max_steps=100": "max_steps=2"}


def _blocks() -> list[str]:
    return [b for page in (README, TRAINING) for b in re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)]


def _command_section() -> list[str]:
    text = README.read_text()
    return text[text.index("## Command line") :].split("\n## ")[0].splitlines()


def _cli_lines() -> list[str]:
    """The README's command lines that run on its own models.py (and the report made from them)."""
    lines = [ln.split("#")[0].strip() for ln in README.read_text().splitlines() if ln.startswith("    ckpt-planner ")]
    return [ln for ln in lines if "models.py" in ln or ln.startswith("ckpt-planner report plan.json")]


def _command_lines() -> list[str]:
    """Every command line of the README's "Command line" section, in order: the models.py ones, the report,
    the one-line `torch.export` recipe that makes model.pt2, and the `.pt2` ones."""
    lines = [ln.strip() for ln in _command_section() if ln.startswith(("    ckpt-planner ", "    python -c "))]
    return [ln.split("  #")[0].strip() if ln.startswith("ckpt-planner") else ln for ln in lines]


def _setup_commands() -> list[str]:
    """The README's two set-up commands: install and run the demo; install and run the tests."""
    text = README.read_text()
    section = text[text.index("## Set up on a fresh machine") : text.index("## Quickstart")]
    return [ln.strip() for ln in section.splitlines() if ln.startswith("    python3 -m venv")]


@contextlib.contextmanager
def _process_group():
    """A one-process gloo group, for the FSDP2 block. It meets through a file of its own, not a port picked
    free beforehand, which another test (pytest-xdist runs two at once) could take meanwhile."""
    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as folder:
        dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


@contextlib.contextmanager
def _chdir(folder: Path):
    previous = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(previous)


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    """Run the blocks in order in one namespace; return what each left behind."""
    folder = tmp_path_factory.mktemp("readme")
    namespace: dict = {"__name__": "readme"}
    after: list[dict] = []
    with _chdir(folder), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for index, code in enumerate(_blocks()):
            for old, new in SHORTER.items():
                code = code.replace(old, new)
            torch.manual_seed(0)
            group = _process_group() if "fully_shard" in code else contextlib.nullcontext()
            with group:
                exec(compile(code, f"README block {index}", "exec"), namespace)
            after.append(dict(namespace))
    return after


def _block_index(text: str) -> int:
    return next(i for i, b in enumerate(_blocks()) if text in b)


def test_every_block_ran(session) -> None:
    assert len(session) == len(_blocks()) >= 8


def test_quickstart_budget_saves_memory(session) -> None:
    ns = session[_block_index("def make_model")]
    plan, report = ns["plan"], ns["report"]
    assert ns["loss"] is not None and torch.isfinite(ns["loss"])  # labels given: the model's own loss
    assert plan.regions, "the quickstart's budget is a no-op"
    assert plan.predicted_peak_bytes <= plan.budget_bytes < plan.baseline_peak_bytes
    assert report.grads_equal and report.measured_peak_bytes <= plan.budget_bytes
    assert report.measured_peak_bytes < report.baseline_measured_peak_bytes
    assert ns["module"] is not None  # rebuilt from the saved file on a fresh instance


@pytest.mark.parametrize("text", ["torch.optim.SGD(", "torch.optim.AdamW(model"])
def test_training_loops_count_the_optimizer_they_build(session, text) -> None:
    from ckpt_planner.distributed import optimizer_state_bytes

    index = _block_index(text)
    ns = session[index]
    planned = re.search(r'optimizer="([\w-]+)"', _blocks()[index]).group(1)
    model, optimizer = ns["model"], ns["optimizer"]
    assert optimizer.state, "the loop did not step its optimizer"
    built = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if t.dim())
    assert optimizer_state_bytes(model, planned) == built  # the state the loop allocates is the state planned
    assert ns["plan"].regions and torch.isfinite(ns["loss"])


def test_callbacks_blocks_planned_and_measured(session) -> None:
    # each runs the plan it chose, in place (or a named whole-module plan): its regions are the plan's
    trainer = session[_block_index("TrainerPlanCallback(")]["callback"]
    assert trainer.plan.regions and _runs_a_plan(trainer.application)
    assert trainer.measured_peak_bytes is not None
    lightning = session[_block_index("LightningPlanCallback(")]["callback"]
    assert lightning.plan.regions and _runs_a_plan(lightning.application)


def _runs_a_plan(applied) -> bool:
    return (applied.kind == "graph" and bool(applied.regions)) or (applied.kind == "modules" and bool(applied.modules))


def test_cli_examples_run(tmp_path, monkeypatch) -> None:
    """Every line of the README's command-line section, in order, as written: the `.pt2` ones on the
    model.pt2 that the README's own one-line recipe makes."""
    import subprocess
    import sys

    from ckpt_planner.cli.commands import main

    models = next(b for b in _blocks() if b.startswith("# models.py"))
    (tmp_path / "models.py").write_text(models)
    monkeypatch.chdir(tmp_path)
    lines = _command_lines()
    assert len(lines) >= 7 and any(".pt2" in ln for ln in lines)
    assert set(_cli_lines()) <= set(lines)
    for line in lines:
        if line.startswith("python -c "):
            subprocess.run([sys.executable, *shlex.split(line)[1:]], check=True, cwd=tmp_path)
            continue
        assert main(shlex.split(line)[1:]) == 0, line
    html = (tmp_path / "report.html").read_text()
    assert "<html" in html and "bench" in html.lower()
    assert (tmp_path / "checkpointed" / "load.py").is_file()  # the .pt2 plan, applied


def test_help_examples_are_the_readme_ones() -> None:
    """The --help epilogs' models.py examples are among the README's, which test_cli_examples_run runs."""
    from ckpt_planner.cli.cli_args import _EPILOGS

    readme = " ".join(" ".join(_cli_lines()).split())
    for text in _EPILOGS.values():
        for line in text.splitlines():
            line = line.strip()
            if "models.py" in line and line.startswith("ckpt-planner"):
                assert " ".join(line.replace("--verify ", "").split()) in readme.replace("--verify ", ""), line
