"""The package's layout: imports point one way, by layer, with no cycle; `solvers/` imports neither torch nor
the planner; every import names the module that defines the name (no import through an alias or a package's
re-exports); every folder has a README that lists its files; no folder holds more than 12 modules; no module
is named after its folder."""

from __future__ import annotations

import ast
import functools
import pathlib

import networkx as nx
import pytest

ROOT = next(p for p in pathlib.Path(__file__).resolve().parents if (p / "pyproject.toml").exists())
PLANNER = ROOT / "planner"
SOLVERS = ROOT / "solvers"
PACKAGE = "ckpt_planner"
SOLVERS_PACKAGE = "ckpt_planner.solvers"
TREES = {PACKAGE: PLANNER, SOLVERS_PACKAGE: SOLVERS}
"""Each import package and the folder it installs from (pyproject.toml's package-dir)."""
MAX_MODULES = 12

FOUNDATION = {"errors", "model_state", "progress", "settings"}
LAYERS = {"capture": 1, "lower": 2, "profile": 3, "": 4, "choose": 5, "compile": 6, "api": 7, "cli": 8, "integrations": 8, "pipeline": 8}
"""Layer of each folder ('' = the plan layer: the other modules at the top of planner/)."""
SOLVER_LAYERS = {"problem": 0, "plans": 0, "copies": 0, "casts": 0, "figures": 0, "simulate": 0, "kept_search": 0, "costs": 0, "registry": 0, "heuristics": 1, "offload": 1, "exact": 2, "auto": 3, "sweep": 3}
"""Layer of each module or folder of solvers/: the data model and the simulator, the heuristics, the exact
solvers (which start from heuristic plans), what runs several solvers; the package's __init__ above all.
The offload step (offload.py) searches over the copy model like a heuristic, with `simulate` as its judge."""


# ---------------------------------------------------------------------------
# Modules and the imports between them.


@functools.cache
def _modules() -> dict[str, pathlib.Path]:
    """Every module of both trees by full dotted name (`ckpt_planner.capture.trace`) -> its file."""
    out = {}
    for package, folder in TREES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = [p for p in path.relative_to(folder).with_suffix("").parts if p != "__init__"]
            out[".".join([package, *parts])] = path
    return out


def _module_of(path: pathlib.Path) -> str:
    return next(name for name, p in _modules().items() if p == path)


def _package_of(path: pathlib.Path) -> str:
    """The package a relative import in `path` starts from."""
    name = _module_of(path)
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _is_package(module: str) -> bool:
    path = _modules().get(module)
    return path is not None and path.name == "__init__.py"


def _is_ours(module: str | None) -> bool:
    return module is not None and (module == PACKAGE or module.startswith(PACKAGE + "."))


def _target(path: pathlib.Path, node: ast.ImportFrom) -> str | None:
    """The module `from X import ...` names, by full dotted name; None for a module not of this project.
    A relative import that climbs above the top package resolves to '<above ckpt_planner>'."""
    if not node.level:
        return node.module if _is_ours(node.module) else None
    base = _package_of(path).split(".")
    if node.level - 1 >= len(base):
        return "<above ckpt_planner>"
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *(node.module.split(".") if node.module else [])])


@functools.cache
def _tree(path: pathlib.Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _imported(path: pathlib.Path) -> list[tuple[ast.AST, str]]:
    """(import node, module) for each module of ours that `path` imports, anywhere in it (function bodies
    included): `from X import sub` counts as an import of X.sub when that is a module, else of X."""
    out = []
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            out += [(node, a.name) for a in node.names if _is_ours(a.name)]
        elif isinstance(node, ast.ImportFrom):
            target = _target(path, node)
            if target is None:
                continue
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in _modules()]
            out += [(node, m) for m in subs]
            if len(subs) < len(node.names):
                out.append((node, target))
    return out


def _graph(modules) -> nx.DiGraph:
    g = nx.DiGraph()
    for name in modules:
        g.add_node(name)
        for _, target in _imported(_modules()[name]):
            if target in modules and target != name:
                g.add_edge(name, target)
    return g


def _planner_modules() -> list[str]:
    return [m for m in _modules() if not (m == SOLVERS_PACKAGE or m.startswith(SOLVERS_PACKAGE + "."))]


def _solver_modules() -> list[str]:
    return [m for m in _modules() if m not in _planner_modules()]


def _short(module: str) -> str:
    """A planner module's name inside planner/ ('' for the package itself): `capture.trace`."""
    return module[len(PACKAGE) + 1 :] if module != PACKAGE else ""


def _layer(module: str) -> int:
    if module in FOUNDATION:
        return 0
    if module in ("__main__", ""):  # the package's own __init__ and __main__: above everything
        return 9
    head = module.split(".")[0]
    if "." in module:
        return LAYERS[head]
    return LAYERS.get(head, LAYERS[""])


def test_no_import_cycles():
    cycles = list(nx.simple_cycles(_graph(_planner_modules())))
    assert not cycles, f"import cycles: {cycles[:5]}"


def test_no_upward_imports():
    g = _graph(_planner_modules())
    upward = [(_short(a), _short(b)) for a, b in g.edges if _layer(_short(b)) > _layer(_short(a))]
    assert not upward, f"imports from a higher layer: {upward}"


def test_the_checker_sees_imports_in_function_bodies():
    # plan.py imports lower/apply.py, and api.py imports compile/compiled.py inside a function
    g = _graph(_planner_modules())
    assert g.has_edge("ckpt_planner.plan", "ckpt_planner.lower.apply")
    assert g.has_edge("ckpt_planner.api", "ckpt_planner.compile.compiled")
    assert _layer("compile.compiled") > _layer("plan") and _layer("api") > _layer("compile.compiled")


TIME_MODULES = ("profile.timing", "profile.timing_store")
"""The profile's time side: it times and fits what it is handed. The calibration, which lowers a plan to time
a real recompute, is choose/race/calibration.py, handed to the profile stage by the spine."""


def _lowering_imports(module: str) -> list[str]:
    g = _graph(_planner_modules())
    return [_short(b) for b in g.successors(f"{PACKAGE}.{module}") if _short(b).split(".")[0] == "lower"]


def test_the_profiles_timing_imports_nothing_of_the_lowering():
    bad = {m: _lowering_imports(m) for m in TIME_MODULES if _lowering_imports(m)}
    assert not bad, f"the profile's timing imports the lowering (hand it in from above): {bad}"
    # the calibration that does lower a plan sits where it may
    assert "lower.rewrite" in _lowering_imports("choose.race.calibration")


# ---------------------------------------------------------------------------
# solvers/: plain data, no torch, nothing from the planner.


def test_solvers_import_no_torch_and_nothing_of_the_planner():
    bad = []
    for name in _solver_modules():
        path = _modules()[name]
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                mods = [_target(path, node) if node.level else node.module]
            else:
                continue
            for mod in mods:
                torch = mod is not None and (mod == "torch" or mod.startswith("torch."))
                planner = _is_ours(mod) and not (mod == SOLVERS_PACKAGE or mod.startswith(SOLVERS_PACKAGE + "."))
                if torch or planner or mod == "<above ckpt_planner>":
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not bad, "solvers/ must stay torch-free and import only itself:\n" + "\n".join(bad)


def test_no_import_cycles_in_solvers():
    cycles = list(nx.simple_cycles(_graph(_solver_modules())))
    assert not cycles, f"import cycles in solvers/: {cycles[:5]}"


def _solver_layer(module: str) -> int:
    rel = module[len(SOLVERS_PACKAGE) + 1 :]
    return SOLVER_LAYERS[rel.split(".")[0]] if rel else max(SOLVER_LAYERS.values()) + 1


def test_no_upward_imports_in_solvers():
    g = _graph(_solver_modules())
    upward = [(a, b) for a, b in g.edges if _solver_layer(b) > _solver_layer(a)]
    assert not upward, f"imports from a higher layer of solvers/: {upward}"
    assert g.has_edge(f"{SOLVERS_PACKAGE}.exact.warm_starts", f"{SOLVERS_PACKAGE}.heuristics.greedy")


# ---------------------------------------------------------------------------
# Every import names the module that defines the name.


def _module_level(body):
    """The statements run at a module's top level: those of if/try/with/for/while blocks included, not
    those of functions and classes."""
    for stmt in body:
        yield stmt
        if isinstance(stmt, (ast.If, ast.For, ast.While, ast.With, ast.Try, ast.AsyncFor, ast.AsyncWith)):
            for field in ("body", "orelse", "finalbody"):
                yield from _module_level(getattr(stmt, field, []))
            for handler in getattr(stmt, "handlers", []):
                yield from _module_level(handler.body)


def _targets(node: ast.AST):
    if isinstance(node, ast.Name):
        yield node.id
    elif isinstance(node, (ast.Tuple, ast.List)):
        for elt in node.elts:
            yield from _targets(elt)
    elif isinstance(node, ast.Starred):
        yield from _targets(node.value)


@functools.cache
def _defined(module: str) -> frozenset[str]:
    """Names a module defines itself at its top level: def, class, assignment. A name it imports (from
    anywhere, under any name) is not among them: importing it from this module would go through an alias."""
    names = set()
    for stmt in _module_level(_tree(_modules()[module]).body):
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(stmt.name)
        elif isinstance(stmt, ast.Assign):
            names.update(n for t in stmt.targets for n in _targets(t))
        elif isinstance(stmt, (ast.AnnAssign, ast.AugAssign)) or (isinstance(stmt, (ast.For, ast.AsyncFor))):
            names.update(_targets(stmt.target))
        elif isinstance(stmt, (ast.With, ast.AsyncWith)):
            names.update(n for item in stmt.items if item.optional_vars for n in _targets(item.optional_vars))
    return frozenset(names)


@functools.cache
def _imported_names(module: str) -> dict[str, str]:
    """Names a module binds at its top level by importing them -> where from (for the messages)."""
    path, out = _modules()[module], {}
    for stmt in _module_level(_tree(path).body):
        if isinstance(stmt, ast.ImportFrom):
            origin = (_target(path, stmt) if stmt.level else stmt.module) or "?"
            out.update({a.asname or a.name: f"{origin}.{a.name}" for a in stmt.names})
        elif isinstance(stmt, ast.Import):
            out.update({a.asname or a.name.partition(".")[0]: a.name for a in stmt.names})
    return out


def _alias_problem(module: str, name: str) -> str | None:
    """Why `from module import name` goes through an alias, or None when `name` is a submodule of `module`
    or is defined in `module`'s own file."""
    if module not in _modules():
        return f"{module} is no module of the project"
    if name == "*":
        return "a star import"
    sub = f"{module}.{name}"
    rebound = name in _defined(module) or (name in _imported_names(module) and _imported_names(module)[name] != sub)
    if sub in _modules():
        return f"{module} rebinds {name!r}, which is also its submodule {sub}" if rebound else None
    if name in _defined(module):
        return None
    if name in _imported_names(module):
        return f"{module} only imports it (from {_imported_names(module)[name]})"
    return f"{module} does not define it"


def _module_aliases(path: pathlib.Path, body) -> dict[str, str]:
    """Names that the statements `body` bind to a module of ours (`from .. import solvers`,
    `import ckpt_planner.x as y`), nested functions left out."""
    out = {}
    for node in _scope(body):
        if isinstance(node, ast.ImportFrom) and (target := _target(path, node)) is not None:
            out.update({a.asname or a.name: f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in _modules()})
        elif isinstance(node, ast.Import):
            out.update({a.asname: a.name for a in node.names if a.asname and a.name in _modules()})
    return out


def _scope(body):
    """The nodes of one function's (or the module's) own scope: nested functions are scopes of their own."""
    stack = list(body)
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            stack += ast.iter_child_nodes(node)


def _attribute_violations(path: pathlib.Path, body, aliases: dict[str, str]) -> list[str]:
    """`X.name` on an imported module X where `name` is neither its submodule nor defined in its file:
    `solvers.solve(...)` goes through solvers/__init__.py's re-exports. Each function sees its own imports."""
    aliases = {**aliases, **_module_aliases(path, body)}
    bad = []
    for node in _scope(body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            bad += _attribute_violations(path, node.body, aliases)
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and not node.attr.startswith("__")):
            why = _alias_problem(aliases[node.value.id], node.attr)
            if why:
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: `{ast.unparse(node)}`: {node.attr}: {why}")
    return bad


def _alias_violations() -> list[str]:
    bad = []
    for path in _modules().values():
        where = path.relative_to(ROOT)
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.ImportFrom) and (target := _target(path, node)) is not None:
                for a in node.names:
                    why = _alias_problem(target, a.name)
                    if why:
                        bad.append(f"{where}:{node.lineno}: `{ast.unparse(node)}`: {a.name}: {why}")
            elif isinstance(node, ast.Import):
                bad += [f"{where}:{node.lineno}: `{ast.unparse(node)}`: no such module" for a in node.names
                        if _is_ours(a.name) and a.name not in _modules()]
        bad += _attribute_violations(path, _tree(path).body, {})
    return sorted(set(bad))


def test_imports_name_the_module_that_defines_the_name():
    """`from X import name` names a module that exists, and `name` is a submodule of X or defined in X's own
    file; the same for `X.name` on an imported module X. Importing through a module that only imports the
    name (a package __init__'s re-exports, planner/__init__.py's lazy names) is an alias: those are for users."""
    bad = _alias_violations()
    assert not bad, f"{len(bad)} imports through an alias:\n" + "\n".join(bad)


def test_the_alias_check_sees_re_exports():
    # solvers/__init__.py re-exports `solve` from registry.py; errors.py imports InfeasibleBudgetError
    assert _alias_problem(SOLVERS_PACKAGE, "solve")
    assert _alias_problem(f"{SOLVERS_PACKAGE}.registry", "solve") is None
    assert _alias_problem(f"{PACKAGE}.errors", "InfeasibleBudgetError")
    assert _alias_problem(PACKAGE, "Plan")  # planner/__init__.py's lazy names
    assert _alias_problem(f"{SOLVERS_PACKAGE}.simulate", "simulate") is None
    assert _alias_problem(SOLVERS_PACKAGE, "simulate")  # the function, rebound over the submodule
    assert _alias_problem(f"{PACKAGE}.nowhere", "x")


# ---------------------------------------------------------------------------
# Folders: a README listing the files, at most 12 modules, no module named after its folder.


def _folders() -> list[pathlib.Path]:
    return sorted(p.parent for folder in TREES.values() for p in folder.rglob("__init__.py"))


@pytest.mark.parametrize("folder", _folders(), ids=lambda p: str(p.relative_to(ROOT)))
def test_each_folder_has_a_readme_listing_its_files(folder):
    readme = (folder / "README.md").read_text()
    modules = [p.name for p in folder.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
    assert len(modules) <= MAX_MODULES, f"{folder.relative_to(ROOT)}: {len(modules)} modules"
    missing = [m for m in modules if f"`{m}`" not in readme]
    assert not missing, f"{folder.relative_to(ROOT)}/README.md does not list {missing}"
    subfolders = [p.name for p in folder.iterdir() if (p / "__init__.py").exists()]
    assert not [s for s in subfolders if f"{s}/" not in readme], f"{folder.relative_to(ROOT)}/README.md"


def test_no_module_is_named_after_its_folder():
    same = [str(p.relative_to(ROOT)) for p in _modules().values() if p.stem in (p.parent.name, _module_of(p.parent / "__init__.py").rpartition(".")[2])]
    assert not same, f"modules named after their folder (say what the file holds): {same}"


def test_pyproject_lists_every_package():
    import tomllib

    packages = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    ours = {m for m in _modules() if _is_package(m)}
    assert ours <= packages, f"not in pyproject.toml's [tool.setuptools] packages: {sorted(ours - packages)}"


def test_a_plan_saved_before_the_stage_folders_loads_and_rebuilds():
    """tests/fixtures/gpt_plan_flat_layout.json was saved by the flat layout (every module at the top of
    planner/): the same graph, regions and figures rebuild today, and the step is the model's, bitwise."""
    import torch
    from ckpt_planner import Plan
    from ckpt_planner.choose.safety_net import step_differences
    from ckpt_planner.cli.examples import gpt_example

    plan = Plan.load(ROOT / "tests" / "fixtures" / "gpt_plan_flat_layout.json")
    model, x = gpt_example(batch=4, seq=32, layers=2, d=32)
    module = plan.rebuild(model, x)  # re-profiles and re-simulates: PlanMismatchError on any difference
    args = x if isinstance(x, tuple) else (x,)
    assert plan.regions and step_differences(model, module, args, {}) == []
    assert isinstance(module(*args), torch.Tensor)


# ---------------------------------------------------------------------------
# One default profile, one conversion of the budget.


def _top_level_scope(tree: ast.Module, node: ast.AST) -> str:
    """The name of the top-level def or class of `tree` that holds `node` ('<module>' at the top level)."""
    for stmt in tree.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and any(
                n is node for n in ast.walk(stmt)):
            return stmt.name
    return "<module>"


def _calls(folder: pathlib.Path, name: str, *, bare: bool = False) -> set[str]:
    """`file:scope` of each top-level def or class under `folder` that calls `name` (as `name(...)` or
    `x.name(...)`); `bare`: only calls with no argument. The methods of one class are one place."""
    places = set()
    for path in sorted(folder.rglob("*.py")):
        tree = _tree(path)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            called = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
            if called == name and not (bare and (node.args or node.keywords)):
                places.add(f"{path.relative_to(folder)}:{_top_level_scope(tree, node)}")
    return places


def test_the_default_profile_is_made_in_one_place():
    """`ProfileConfig()` with no argument (the default profile) is written once, in `ProfileConfig.or_default`:
    every stage that may be given no profile asks it, and the test suite changes the default there alone."""
    assert _calls(PLANNER, "ProfileConfig", bare=True) == {"profile/profiler.py:ProfileConfig"}


@pytest.mark.parametrize("name", ["in_bytes", "within_device_limit", "inner_budget"])
def test_the_budget_is_converted_in_one_place(name):
    """A request's budget becomes bytes (`Budget.in_bytes`), is clamped to the device (`within_device_limit`)
    and loses its safety margin (`inner_budget`) in `ResolvedBudget` alone (choose/budget.py): every stage
    reads that record, so no two stages can hold different budgets for one request."""
    assert _calls(PLANNER, name) == {"choose/budget.py:ResolvedBudget"}


# ---------------------------------------------------------------------------
# Size: a function does one job; a long module holds one concept and says so.

MAX_FUNCTION_LINES = 120
LONG_MODULE_LINES = 500


def _long_functions(path: pathlib.Path) -> list[str]:
    name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    return [f"{name}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)"
            for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > MAX_FUNCTION_LINES]


def test_no_function_over_120_lines():
    long = [f for path in _modules().values() for f in _long_functions(path)]
    assert not long, "split along its jobs: " + "; ".join(long)


def test_a_module_over_500_lines_says_why_it_is_one():
    """Its docstring names it one concept ("One concept, so one module over 500 lines: ...")."""
    unexplained = []
    for path in _modules().values():
        if len(path.read_text().splitlines()) > LONG_MODULE_LINES:
            doc = ast.get_docstring(_tree(path)) or ""
            if "one concept" not in doc.lower():
                unexplained.append(str(path.relative_to(ROOT)))
    assert not unexplained, "split, or say in the docstring why it is one concept: " + ", ".join(unexplained)


def test_the_size_checks_see_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    path = tmp_path / "probe.py"
    path.write_text(f"def long():\n{body}\n")
    assert _long_functions(path) == [f"probe.py:1 long ({MAX_FUNCTION_LINES + 1} lines)"]
