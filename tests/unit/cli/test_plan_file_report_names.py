"""Names read from a plan file reach no terminal raw: a solver named with ESC and BEL is drawn in the
report's plots with those characters escaped (the font's missing-glyph warning, printed on the
terminal, named them raw), and the page carries none either."""

from __future__ import annotations

import json
import warnings

from ckpt_planner.cli.commands import main

from tests.unit.plan.test_lying_plans import FACTORY

HOSTILE = "uni\x1b]0;owned\x07form\x1b[31m"


def test_control_characters_in_names_reach_neither_the_warnings_nor_the_page(tmp_path, capsys):
    (tmp_path / "factory.py").write_text(FACTORY)
    path = tmp_path / "plan.json"
    assert main(["plan", f"{tmp_path}/factory.py:make", "--solver", "uniform", "--activation-budget", "0.7",
                 "--curve-points", "2", "--curve-solvers", "uniform", "--quiet", "-o", str(path)]) == 0
    data = json.loads(path.read_text())
    curves = data["stats"]["curves"]
    curves["solvers"] = {HOSTILE: next(iter(curves["solvers"].values()))}
    curves["plan"]["solver"] = HOSTILE
    path.write_text(json.dumps(data))
    capsys.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["report", str(path), "--format", "md", "-o", str(tmp_path / "r.md")]) == 0
    said = [str(w.message) for w in caught]
    out = capsys.readouterr()
    for text in (*said, out.out, out.err, (tmp_path / "r.md").read_text()):
        assert "\x1b" not in text and "\x07" not in text, text[:300]
