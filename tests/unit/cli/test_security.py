"""Files from elsewhere never run code: each test builds the hostile file and checks that nothing ran.

S1 pickled models / inputs (pickled members of a .pt2: tests/unit/capture/test_pt2_members.py), S2 apply folders whose
manifest names code or paths outside, S3 a plan that names an inputs file, S4 names
in Markdown reports, S5 a file named like a factory spec, S6 `apply -o` over a folder
that is not ours, and a failed final rename.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import sys
from pathlib import Path

import pytest
import torch
from ckpt_planner.cli.commands import main
from ckpt_planner.cli.loading import load_applied, model_kind
from ckpt_planner.errors import InputError

from tests.models.examples import MLPChain

from ..capture.pt2_checks import Payload, pickled_weight, rewrite

FACTORY = '''
import torch
from ckpt_planner.cli.examples import MLPChain


def make():
    torch.manual_seed(0)
    return MLPChain(d=32, blocks=4), (torch.randn(64, 32),)
'''


def run(argv: list, capsys) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# -- S1: .pt2 archives, pickled models and inputs ----------------------------------------------


def test_pickled_model_and_inputs_never_unpickle_code(tmp_path, capsys, monkeypatch):
    marker = tmp_path / "ran"
    (tmp_path / "model.pt").write_bytes(pickle.dumps(Payload(marker)))
    buf = io.BytesIO()
    torch.save(Payload(marker), buf)
    (tmp_path / "inputs.pt").write_bytes(buf.getvalue())
    (tmp_path / "factory.py").write_text(FACTORY)
    monkeypatch.chdir(tmp_path)

    code, _, err = run(["plan", "model.pt", "--input", "64,32", "--curve-points", "0"], capsys)
    assert code == 2 and "--trust-pickle" in one_line(err)
    code, _, err = run(["plan", "factory.py:make", "--inputs", "inputs.pt", "--curve-points", "0"], capsys)
    assert code == 2 and "weights_only=True" in one_line(err)
    assert not marker.exists()


# -- S2: apply folders --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def applied_pt2(clean_pt2, tmp_path_factory) -> Path:
    """An honest apply folder of the clean .pt2."""
    d = tmp_path_factory.mktemp("applied")
    plan, out = d / "plan.json", d / "applied"
    assert main(["plan", str(clean_pt2), "--solver", "uniform", "--activation-budget", "0.7", "--curve-points", "0",
                 "--quiet", "-o", str(plan)]) == 0
    assert main(["apply", str(clean_pt2), str(plan), "-o", str(out), "--quiet"]) == 0
    return out


def copy_folder(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def edit_manifest(folder: Path, **changes) -> None:
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest.update(changes)
    (folder / "manifest.json").write_text(json.dumps(manifest))


def test_honest_pt2_folder_loads_without_any_trust(applied_pt2):
    applied = load_applied(applied_pt2)
    assert applied.plan.regions and isinstance(applied.module, torch.nn.Module)


def test_pt2_folder_whose_archive_turned_hostile_runs_nothing(applied_pt2, clean_pt2, tmp_path):
    folder = copy_folder(applied_pt2, tmp_path / "f")
    marker = tmp_path / "ran"
    rewrite(clean_pt2, folder / "model.pt2", pickled_weight(marker))
    with pytest.raises(InputError, match="trust_pickle"):
        load_applied(folder)
    assert not marker.exists()


def test_manifest_naming_python_file_runs_nothing(applied_pt2, tmp_path):
    folder = copy_folder(applied_pt2, tmp_path / "f")
    marker = tmp_path / "ran"
    (folder / "evil.py").write_text(f"open({str(marker)!r}, 'w').close()\ndef make():\n    pass\n")
    edit_manifest(folder, model="evil.py:make", model_kind="pt2")
    with pytest.raises(InputError, match="model.pt2"):
        load_applied(folder)
    edit_manifest(folder, model=str(folder / "evil.py") + ":make", model_kind="factory")
    with pytest.raises(InputError, match="trust_code"):
        load_applied(folder)
    assert not marker.exists()


def test_manifest_paths_outside_the_folder_are_refused(applied_pt2, clean_pt2, tmp_path, monkeypatch):
    folder = copy_folder(applied_pt2, tmp_path / "deep" / "f")
    outside = tmp_path / "x.pt2"
    outside.write_bytes(clean_pt2.read_bytes())  # loadable: only the path makes it wrong
    reads: list[str] = []
    import ckpt_planner.cli.models as models  # what an apply folder's model is loaded with

    real = models.load_model
    monkeypatch.setattr(models, "load_model", lambda spec, **kw: reads.append(spec) or real(spec, **kw))
    edit_manifest(folder, model="../../x.pt2", model_kind="pt2")
    with pytest.raises(InputError, match="inside the folder"):
        load_applied(folder)
    edit_manifest(folder, model="model.pt2", model_kind="pt2")
    (folder / "model.pt2").unlink()
    (folder / "model.pt2").symlink_to(outside)
    with pytest.raises(InputError, match="outside the folder"):
        load_applied(folder)
    (folder / "state_dict.pt").unlink()
    (folder / "state_dict.pt").symlink_to(outside)
    assert reads == []  # nothing outside was opened


def test_recorded_working_directory_cannot_shadow_modules(tmp_path, monkeypatch, capsys):
    """A package.module:factory folder: code only with trust_code, and its directory never comes first on sys.path."""
    src = tmp_path / "src"
    src.mkdir()
    marker = tmp_path / "shadowed"
    (src / "mymodels.py").write_text(FACTORY + "\nimport colorsys  # a standard module\n")
    (src / "colorsys.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    monkeypatch.chdir(src)
    monkeypatch.delitem(sys.modules, "colorsys", raising=False)
    monkeypatch.delitem(sys.modules, "mymodels", raising=False)
    # `python -m`-like: while planning, the user's directory is importable (the user named the spec)
    assert main(["plan", "mymodels:make", "--solver", "uniform", "--activation-budget", "0.7", "--curve-points", "0",
                 "--quiet", "-o", str(tmp_path / "plan.json")]) == 0
    assert main(["apply", "mymodels:make", str(tmp_path / "plan.json"), "-o", str(tmp_path / "out"), "--quiet"]) == 0
    capsys.readouterr()
    marker.unlink(missing_ok=True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "colorsys", raising=False)
    monkeypatch.delitem(sys.modules, "mymodels", raising=False)

    with pytest.raises(InputError, match="trust_code"):
        load_applied(tmp_path / "out")
    assert "mymodels" not in sys.modules
    applied = load_applied(tmp_path / "out", trust_code=True)
    assert applied.plan.regions and "mymodels" in sys.modules
    assert not marker.exists() and str(src) not in sys.path[:-1]


# -- S3: a plan's recorded inputs file ----------------------------------------------------------


def test_plan_naming_an_inputs_file_is_not_read(tmp_path, capsys, monkeypatch):
    (tmp_path / "factory.py").write_text(FACTORY)
    secret = tmp_path / "elsewhere" / "secret.pt"
    secret.parent.mkdir()
    torch.save(torch.randn(64, 32), secret)  # readable: only its origin makes it wrong
    plan_path, out = tmp_path / "plan.json", tmp_path / "out"
    fac = f"{tmp_path}/factory.py:make"
    assert main(["plan", fac, "--solver", "uniform", "--activation-budget", "0.7", "--curve-points", "0", "--quiet",
                 "-o", str(plan_path)]) == 0
    data = json.loads(plan_path.read_text())
    data["stats"]["cli"] = {"model": fac, "model_kind": "factory", "inputs_file": str(secret)}
    plan_path.write_text(json.dumps(data))
    import ckpt_planner.cli.loading as loading

    opened: list[str] = []
    real = loading.load_inputs_file
    monkeypatch.setattr(loading, "load_inputs_file", lambda p: opened.append(str(p)) or real(p))
    code, _, err = run(["apply", fac, plan_path, "-o", out], capsys)
    assert code == 2 and "--inputs" in one_line(err)
    assert opened == [] and not out.exists()


# -- S4: names in reports -----------------------------------------------------------------------


def test_markdown_and_html_reports_escape_names(tmp_path, capsys):
    (tmp_path / "factory.py").write_text(FACTORY)
    plan_path = tmp_path / "plan.json"
    assert main(["plan", f"{tmp_path}/factory.py:make", "--solver", "uniform", "--activation-budget", "0.7",
                 "--curve-points", "2", "--curve-solvers", "uniform", "--quiet", "-o", str(plan_path)]) == 0
    data = json.loads(plan_path.read_text())
    hostile = "<img src=x onerror=alert(1)>[click](http://evil.example)|`x`"
    data["model"] = hostile
    data["regions"][0]["modules"] = ["<script>alert(2)</script>", "a|b"]
    data["notes"] = ["# heading\n<b>bold</b>"]
    plan_path.write_text(json.dumps(data))
    for fmt in ("md", "html"):
        out = tmp_path / f"r.{fmt}"
        code, _, err = run(["report", plan_path, "--format", fmt, "-o", out, "--quiet"], capsys)
        assert code == 0, err
        text = out.read_text()
        assert "<img src=x" not in text and "<script>" not in text and "<b>" not in text, fmt
        assert "&lt;img src=x" in text and "&lt;script&gt;" in text, fmt
    md = (tmp_path / "r.md").read_text()
    assert "[click](" not in md and "\\[click\\](" in md  # the link is text, not a link
    assert "\n# heading" not in md and "\\# heading" in md
    table = next(ln for ln in md.splitlines() if "script" in ln)
    assert table.count(" | ") == 5  # six cells: the | inside the names is escaped


# -- S5: a file that looks like a factory spec --------------------------------------------------


def test_file_named_like_a_factory_spec_is_never_imported(tmp_path, capsys, monkeypatch):
    marker = tmp_path / "imported"
    (tmp_path / "checkpoint.py").write_text(f"open({str(marker)!r}, 'w').close()\ndef latest():\n    pass\n")
    torch.save(MLPChain(d=32, blocks=4), tmp_path / "checkpoint:latest")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "checkpoint", raising=False)
    assert model_kind("checkpoint:latest") == "pickle"
    code, _, err = run(["plan", "checkpoint:latest", "--input", "64,32", "--curve-points", "0"], capsys)
    assert code == 2 and "--trust-pickle" in one_line(err)
    assert not marker.exists()
    code, _, err = run(["plan", "checkpoint:latest", "--input", "64,32", "--curve-points", "0", "--solver", "uniform",
                        "--trust-pickle", "--quiet"], capsys)
    assert code == 0, err
    assert not marker.exists()


# -- S6: apply -o over someone else's folder, and a failed final rename ------------------------


@pytest.fixture
def factory_plan(tmp_path) -> tuple[str, Path]:
    (tmp_path / "factory.py").write_text(FACTORY)
    fac = f"{tmp_path}/factory.py:make"
    plan = tmp_path / "plan.json"
    assert main(["plan", fac, "--solver", "uniform", "--activation-budget", "0.7", "--curve-points", "0", "--quiet",
                 "-o", str(plan)]) == 0
    return fac, plan


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_apply_never_replaces_a_folder_that_is_not_ours(factory_plan, tmp_path, capsys):
    fac, plan = factory_plan
    webapp = tmp_path / "webapp"
    webapp.mkdir()
    (webapp / "manifest.json").write_text(json.dumps({"name": "My web app", "start_url": "/"}))
    (webapp / "index.html").write_text("<html>the site</html>")
    before = snapshot(webapp)
    code, _, err = run(["apply", fac, plan, "-o", webapp], capsys)
    assert code == 2 and "webapp" in one_line(err)
    assert snapshot(webapp) == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_failed_final_rename_restores_the_previous_folder(factory_plan, tmp_path, capsys, monkeypatch):
    fac, plan = factory_plan
    out = tmp_path / "applied"
    assert main(["apply", fac, str(plan), "-o", str(out), "--quiet"]) == 0
    before = snapshot(out)
    real = os.replace

    def failing(src, dst, *a, **kw):
        if Path(dst) == out and Path(src).name.startswith(f".{out.name}-"):
            raise OSError(18, "Invalid cross-device link")
        return real(src, dst, *a, **kw)

    monkeypatch.setattr(os, "replace", failing)
    code, _, err = run(["apply", fac, plan, "-o", out], capsys)
    assert code == 2 and "previous folder was left as it was" in one_line(err)
    assert snapshot(out) == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # nothing hidden left behind
    monkeypatch.setattr(os, "replace", real)
    code, _, err = run(["apply", fac, plan, "-o", out, "--quiet"], capsys)  # ours: replaced
    assert code == 0, err
    assert load_applied(out, trust_code=True).plan.regions
