"""The package's layout: imports point one way, by layer, with no cycle; every folder has a README that
lists its files; no folder holds more than about 12 modules."""

from __future__ import annotations

import ast
import pathlib

import networkx as nx
import pytest

PLANNER = pathlib.Path(__file__).resolve().parents[1] / "planner"

FOUNDATION = {"errors", "model_state", "progress", "settings"}
LAYERS = {"capture": 1, "lower": 2, "profile": 3, "": 4, "choose": 5, "compile": 6, "api": 7, "cli": 8, "integrations": 8}
"""Layer of each folder ('' = the plan layer: the other modules at the top of planner/)."""


def _name(path: pathlib.Path) -> str:
    rel = path.relative_to(PLANNER).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join(parts)


def _layer(module: str) -> int:
    if module in FOUNDATION:
        return 0
    if module in ("__main__", ""):  # the package's own __init__ and __main__: above everything
        return 9
    head = module.split(".")[0]
    if "." in module:
        return LAYERS[head]
    return LAYERS.get(head, LAYERS[""])


def _imports(path: pathlib.Path) -> set[str]:
    """planner modules that `path` imports (anywhere in it, function bodies included), by dotted name."""
    name = _name(path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom) or not node.level:
            continue
        base = package[: len(package) - (node.level - 1)]
        target = [*base, *(node.module.split(".") if node.module else [])]
        if target and target[0] == "solvers":
            continue
        candidates = [".".join(target + [a.name]) for a in node.names] if not node.module or _is_package(target) else []
        found = [c for c in candidates if _exists(c)]
        out.update(found or ([".".join(target)] if _exists(".".join(target)) else []))
    out.discard(name)
    return out


def _is_package(parts: list[str]) -> bool:
    return (PLANNER.joinpath(*parts) / "__init__.py").exists() if parts else True


def _exists(dotted: str) -> bool:
    parts = dotted.split(".") if dotted else []
    return (PLANNER.joinpath(*parts).with_suffix(".py")).exists() if parts else False


def _graph() -> nx.DiGraph:
    g = nx.DiGraph()
    for path in PLANNER.rglob("*.py"):
        g.add_node(_name(path))
        for target in _imports(path):
            g.add_edge(_name(path), target)
    return g


def test_no_import_cycles():
    cycles = list(nx.simple_cycles(_graph()))
    assert not cycles, f"import cycles: {cycles[:5]}"


def test_no_upward_imports():
    upward = [(a, b) for a, b in _graph().edges if _layer(b) > _layer(a)]
    assert not upward, f"imports from a higher layer: {upward}"


def test_the_checker_sees_imports_in_function_bodies():
    # profile/timing.py imports lower/rewrite.py, and api.py imports compile/compiled.py inside a function
    g = _graph()
    assert g.has_edge("profile.timing", "lower.rewrite")
    assert g.has_edge("api", "compile.compiled")
    assert _layer("compile.compiled") > _layer("plan") and _layer("api") > _layer("compile.compiled")


@pytest.mark.parametrize("folder", sorted(p for p in PLANNER.iterdir() if p.is_dir() and (p / "__init__.py").exists()))
def test_each_folder_has_a_readme_listing_its_files(folder):
    readme = (folder / "README.md").read_text()
    modules = [p.name for p in folder.glob("*.py") if p.name != "__init__.py"]
    assert len(modules) <= 13, f"{folder.name}: {len(modules)} modules"
    missing = [m for m in modules if f"`{m}`" not in readme]
    assert not missing, f"{folder.name}/README.md does not list {missing}"


def test_the_top_readme_lists_its_files():
    readme = (PLANNER / "README.md").read_text()
    modules = [p.name for p in PLANNER.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
    assert len(modules) <= 13
    assert not [m for m in modules if f"`{m}`" not in readme]


def test_a_plan_saved_before_the_stage_folders_loads_and_rebuilds():
    """tests/fixtures/gpt_plan_flat_layout.json was saved by the flat layout (every module at the top of
    planner/): the same graph, regions and figures rebuild today, and the step is the model's, bitwise."""
    import torch
    from ckpt_planner import Plan
    from ckpt_planner.choose.safety_net import step_differences
    from ckpt_planner.cli.examples import gpt_example

    plan = Plan.load(pathlib.Path(__file__).parent / "fixtures" / "gpt_plan_flat_layout.json")
    model, x = gpt_example(batch=4, seq=32, layers=2, d=32)
    module = plan.rebuild(model, x)  # re-profiles and re-simulates: PlanMismatchError on any difference
    args = x if isinstance(x, tuple) else (x,)
    assert plan.regions and step_differences(model, module, args, {}) == []
    assert isinstance(module(*args), torch.Tensor)
