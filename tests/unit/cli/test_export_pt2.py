"""A `.pt2` of a transformers model: `torch.export.save` on the model as it is makes a file that a process
without transformers cannot load (its CausalLMOutputWithPast is registered with torch's pytree only on
`import transformers`). The command line names that cause and the fix in one line, where torch says only
"check the warnings above", and `ckpt-planner export` / `ckpt_planner.export_for_cli` make a `.pt2` that
loads and plans. A failed export leaves no file behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ckpt_planner.capture.pt2.archive import load_pt2_safely
from ckpt_planner.cli.commands import main
from ckpt_planner.cli.export import export_for_cli
from ckpt_planner.errors import InputError, OutputError
from torch.utils import _pytree as pytree

transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[3]
VOCAB, SHAPE = 128, (2, 16)

FACTORY = f'''
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def make():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                        num_key_value_heads=2, vocab_size={VOCAB}))
'''
INPUTS = [f"input_ids={SHAPE[0]},{SHAPE[1]}:int64:0-{VOCAB}", f"labels={SHAPE[0]},{SHAPE[1]}:int64:0-{VOCAB}"]
# plan on fake tensors: loading is what is tested, and nothing has to run
PLAN = ["--activation-budget", "0.9", "--device", "meta", "--curve-points", "0", "--solver", "uniform"]


def _tiny_llm() -> torch.nn.Module:
    namespace: dict = {}
    exec(FACTORY, namespace)
    return namespace["make"]()


def _inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, SHAPE, generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("export_pt2")
    (d / "llm.py").write_text(FACTORY)
    return d


@pytest.fixture(scope="module")
def raw(work) -> Path:
    """The recipe that fails: the transformers model exported and saved as it is."""
    path = work / "raw.pt2"
    model = _tiny_llm().train()
    model.config.use_cache = False  # as the README's GPT-2 factory has it: no cache object in the output
    torch.export.save(torch.export.export(model, (), _inputs()), path)
    return path


@pytest.fixture
def no_transformers_types(monkeypatch) -> None:
    """This process as the command line sees it where transformers is not imported: torch's pytree cannot
    rebuild transformers' output types by name."""
    for name in [n for n in pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE if n.startswith("transformers.")]:
        monkeypatch.delitem(pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE, name)


def run(argv: list, capsys) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckpt-planner: "), err
    return lines[0]


def test_export_for_cli_makes_a_pt2_that_loads_and_plans(work, no_transformers_types, capsys) -> None:
    model = _tiny_llm()
    names = set(model.state_dict())
    path = work / "helper.pt2"
    program = export_for_cli(model, _inputs(), path)
    assert model.training and set(model.state_dict()) == names  # the model is left as it was
    # the program's names are the model's own, not a wrapper's
    assert set(program.state_dict) <= names and "model.embed_tokens.weight" in program.state_dict
    assert not [p.name for p in work.iterdir() if p.name.startswith(".helper.pt2")]  # no temporary file left
    loaded = load_pt2_safely(path)
    out = loaded.module()(**_inputs())
    assert isinstance(out, torch.Tensor) and out.dim() == 0  # the loss alone: labels were given
    plan = work / "helper-plan.json"
    code, _, err = run(["plan", path, *PLAN, "--quiet", "-o", plan], capsys)
    assert code == 0, err
    assert json.loads(plan.read_text())["regions"]


def test_export_subcommand_writes_a_loadable_pt2(work, no_transformers_types, capsys) -> None:
    out = work / "cli.pt2"
    code, stdout, err = run(["export", f"{work / 'llm.py'}:make", *sum((["--input", i] for i in INPUTS), []),
                             "-o", out, "--json"], capsys)
    assert code == 0, err
    assert json.loads(stdout)["returns"] == "loss"
    program = load_pt2_safely(out)
    assert set(program.example_inputs[1]) == {"input_ids", "labels"}  # the inputs `plan` takes by default
    assert program.module()(**_inputs()).dim() == 0


def test_export_without_labels_returns_the_logits(work, no_transformers_types, capsys) -> None:
    out = work / "logits.pt2"
    code, stdout, err = run(["export", f"{work / 'llm.py'}:make", "--input", INPUTS[0], "-o", out, "--json"], capsys)
    assert code == 0, err
    assert json.loads(stdout)["returns"] == "logits"
    logits = load_pt2_safely(out).module()(input_ids=_inputs()["input_ids"])
    assert logits.shape == (*SHAPE, VOCAB)


def test_raw_recipe_names_the_unregistered_type_and_the_fix(raw, no_transformers_types, capsys) -> None:
    code, _, err = run(["plan", raw, *PLAN], capsys)
    assert code == 2
    line = _one_line(err)
    assert "transformers.modeling_outputs.CausalLMOutputWithPast" in line and "not registered" in line
    assert "ckpt-planner export" in line and "export_for_cli" in line
    assert "warnings above" not in line


@pytest.mark.slow  # a fresh interpreter imports torch and the planner again: seconds on 2 cores
def test_raw_recipe_in_a_process_without_transformers(raw) -> None:
    """The same in the process a user runs, where nothing has imported transformers (the test above
    emulates that process by unregistering transformers' types)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "ckpt_planner", "plan", str(raw), *PLAN], capture_output=True,
                          text=True, timeout=120, cwd=raw.parent, env=env)
    assert done.returncode == 2, done.stderr
    line = _one_line(done.stderr)
    assert "CausalLMOutputWithPast" in line and "ckpt-planner export" in line


def test_returns_loss_without_labels_is_one_line(work, capsys) -> None:
    out = work / "noloss.pt2"
    code, _, err = run(["export", f"{work / 'llm.py'}:make", "--input", INPUTS[0], "--returns", "loss", "-o", out], capsys)
    assert code == 2
    assert "labels" in _one_line(err)
    assert not out.exists()


def test_export_refuses_the_meta_device(work, capsys) -> None:
    code, _, err = run(["export", f"{work / 'llm.py'}:make", "--input", INPUTS[0], "--device", "meta",
                        "-o", work / "meta.pt2"], capsys)
    assert code == 2 and "meta" in _one_line(err)


class _DataDependent(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return y * 2 if y.sum() > 0 else y  # branches on a value: torch.export cannot trace it


def test_failed_export_writes_nothing(tmp_path) -> None:
    path = tmp_path / "model.pt2"
    with pytest.raises(InputError, match="torch.export cannot export it"):
        export_for_cli(_DataDependent(), torch.randn(2, 4), path)
    assert list(tmp_path.iterdir()) == []


def test_failed_save_leaves_the_old_file_and_no_partial_one(tmp_path, monkeypatch) -> None:
    """A save that fails half-way (a full disk) leaves what was there, and no temporary file."""
    path = tmp_path / "model.pt2"
    path.write_bytes(b"earlier")

    def full_disk(program, f, *args, **kwargs) -> None:
        Path(f).write_bytes(b"PK\x03\x04 half an archive")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch.export, "save", full_disk)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    with pytest.raises(OutputError, match="nothing was written"):
        export_for_cli(model, torch.randn(2, 4), path)
    assert path.read_bytes() == b"earlier"
    assert [p.name for p in tmp_path.iterdir()] == ["model.pt2"]


def test_public_name() -> None:
    import ckpt_planner

    assert "export_for_cli" in ckpt_planner.__all__ and ckpt_planner.export_for_cli is export_for_cli


class _MaskBranch(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)[mask]  # u0 rows: as many as the mask selects
        return y.sum() if y.shape[0] == 1 else y.mean()  # a branch on Eq(u0, 1)


def test_branch_on_a_data_dependent_size_is_one_line_with_what_to_do(tmp_path, capfd) -> None:
    x, mask = torch.randn(8, 4), torch.arange(8) % 2 == 0
    with pytest.raises(InputError) as refused:
        export_for_cli(_MaskBranch(), (x, mask), tmp_path / "model.pt2")
    line = str(refused.value)
    assert "\n" not in line and "Eq(u0, 1)" in line and "ckpt_planner.optimize" in line, line
    assert "Size-like symbols" not in line and len(line) < 400, line
    assert capfd.readouterr().err == ""  # torch's own report of the failed trace stays off the terminal
    assert list(tmp_path.iterdir()) == []
