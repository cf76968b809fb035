"""`ckpt-planner report`: a self-contained page whose figures are the plan file's, with its plots embedded."""

from __future__ import annotations

import base64
import html
import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
from ckpt_planner.cli.commands import main
from ckpt_planner.cli.report import render
from ckpt_planner.plan import Plan
from ckpt_planner.plan_summary import fmt_bytes as _fmt_bytes

FACTORY = '''
import torch
from ckpt_planner.cli.examples import MLPChain


def make():
    torch.manual_seed(0)
    return MLPChain(d=32, blocks=4), (torch.randn(64, 32),)
'''

CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)


class Page(HTMLParser):
    """Summary rows (data-key -> data-value), images, and the text of every table by id."""

    def __init__(self) -> None:
        super().__init__()
        self.summary: dict[str, object] = {}
        self.images: list[str] = []
        self.tables: dict[str, list[list[str]]] = {}
        self._table: str | None = None
        self._cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "tr" and "data-key" in a:
            self.summary[a["data-key"]] = json.loads(a["data-value"])
        if tag == "img":
            self.images.append(a.get("src", ""))
        elif tag == "table":
            self._table = a.get("id")
            self.tables[self._table] = []
        elif tag == "tr" and self._table:
            self.tables[self._table].append([])
        elif tag in ("td", "th"):
            self._cell = []

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None and self._table:
            self.tables[self._table][-1].append("".join(self._cell))
            self._cell = None
        elif tag == "table":
            self._table = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("report")
    (d / "factory.py").write_text(FACTORY)
    spec = f"{d}/factory.py:make"
    assert main(["plan", spec, "--solver", "uniform", "--activation-budget", "0.7", "--verify", "--curve-points", "4",
                 "--quiet", "-o", str(d / "plan.json")]) == 0
    assert main(["bench", spec, "--solvers", "none,uniform", "--activation-budget", "0.7", "--quiet",
                 "-o", str(d / "bench.json")]) == 0
    return d


def test_plan_file_carries_the_report_data(made):
    plan = json.loads((made / "plan.json").read_text())
    stats = plan["stats"]
    # The stored timelines are the simulator's: their maxima are the plan's predicted figures.
    assert stats["timeline"]["plan"]["peak_bytes"] == plan["predicted_peak_bytes"] == max(stats["timeline"]["plan"]["bytes"])
    assert max(stats["timeline"]["baseline"]["bytes"]) == plan["baseline_peak_bytes"]
    assert {"forward", "backward", "recompute"} <= set(stats["timeline"]["plan"]["phase"])
    assert "recompute" not in stats["timeline"]["baseline"]["phase"]
    curves = stats["curves"]
    assert curves["plan"]["peak_bytes"] == plan["predicted_peak_bytes"]
    assert curves["plan"]["recompute_s"] == plan["predicted_recompute_s"]
    assert "uniform" in curves["solvers"] and "none" not in curves["solvers"]
    for name, points in curves["solvers"].items():
        assert points, name
        for p in points:
            assert p["peak_bytes"] <= p["budget_bytes"], (name, p)


def test_html_report_embeds_plots_and_shows_the_plan_figures(made, capsys):
    out = made / "report.html"
    assert main(["report", str(made / "plan.json"), "--bench", str(made / "bench.json"), "-o", str(out)]) == 0
    assert "report written to" in capsys.readouterr().out
    plan = json.loads((made / "plan.json").read_text())
    page = Page()
    page.feed(out.read_text())
    # the one overhead row is the predicted step (with the recompute as one of its parts), as in plan.summary()
    for key in ("solver", "budget_bytes", "baseline_peak_bytes", "predicted_peak_bytes", "predicted_step_s",
                "measured_peak_bytes", "baseline_measured_peak_bytes", "fingerprint"):
        assert page.summary[key] == plan[key], key
    assert page.summary["regions"] == len(plan["regions"])
    assert page.summary["saved_bytes"] == plan["baseline_peak_bytes"] - plan["predicted_peak_bytes"]
    rows = {r[0]: r[1] for r in page.tables["summary"]}
    assert rows["peak memory, this plan (predicted)"] == _fmt_bytes(plan["predicted_peak_bytes"])
    assert rows["peak memory, this plan (measured)"] == _fmt_bytes(plan["measured_peak_bytes"])

    assert len(page.images) == 2  # memory timeline and memory/overhead curve
    for src in page.images:
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n"

    regions = page.tables["regions"][1:]
    assert len(regions) == len(plan["regions"])
    for row, region in zip(regions, plan["regions"]):
        assert region["first_node"] in row[1] and row[2] == ", ".join(region["modules"])

    bench = json.loads((made / "bench.json").read_text())
    shown = {r[0]: r for r in page.tables["bench"][1:]}
    for r in bench["rows"]:
        assert shown[r["solver"]][3] == _fmt_bytes(r["measured_peak_bytes"])


def test_markdown_report(made, capsys):
    out = made / "report.md"
    assert main(["report", str(made / "plan.json"), "-o", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["format"] == "md"
    plan = json.loads((made / "plan.json").read_text())
    text = out.read_text()
    assert f"| peak memory, this plan (predicted) | {_fmt_bytes(plan['predicted_peak_bytes'])} |" in text
    assert text.count("](data:image/png;base64,") == 2
    assert text.count("\n| ") >= len(plan["regions"]) + 10


def test_report_of_a_plan_without_report_data(tmp_path):
    """A plan saved from the Python API has no timeline or curves: the page still renders, without plots."""
    from ckpt_planner import optimize

    from tests.models.examples import MLPChain

    model = MLPChain(d=16, blocks=2)
    import torch

    plan = optimize(model, (torch.randn(8, 16),), solver="uniform", budget_bytes=10**9)
    plan.save(tmp_path / "plan.json")
    assert main(["report", str(tmp_path / "plan.json"), "-o", str(tmp_path / "r.html"), "--quiet"]) == 0
    page = Page()
    page.feed((tmp_path / "r.html").read_text())
    assert page.images == [] and page.summary["predicted_peak_bytes"] == plan.predicted_peak_bytes


_MEASURE = """<script>
const doc = document.documentElement, out = {scrollWidth: doc.scrollWidth, clientWidth: doc.clientWidth, wide: []};
for (const el of document.querySelectorAll("table, img, p, h1, h2")) {
  const r = el.getBoundingClientRect();
  if (r.right > doc.clientWidth + 1) out.wide.push(el.tagName + "#" + (el.id || "") + " right " + r.right);
}
out.images = [...document.images].map(i => [i.complete, i.naturalWidth]);
document.body.setAttribute("data-layout", JSON.stringify(out));
</script>"""


def _chromium(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
         f"--user-data-dir={tmp_path / 'profile'}", *args],
        capture_output=True, text=True, timeout=180,
    )


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (Debian package `chromium`)")
def test_report_renders_in_headless_chromium(made, tmp_path):
    """The page as a browser lays it out: the figures, nothing wider than the window, plots drawn."""
    from PIL import Image

    out = made / "report_browser.html"
    assert main(["report", str(made / "plan.json"), "--bench", str(made / "bench.json"), "-o", str(out), "--quiet"]) == 0
    width = 1000
    proc = _chromium(tmp_path, f"--window-size={width},3000", "--dump-dom", out.resolve().as_uri())
    assert proc.returncode == 0, proc.stderr[-2000:]
    page = Page()
    page.feed(proc.stdout)  # the DOM as the browser built it
    plan = json.loads((made / "plan.json").read_text())
    rows = {r[0]: r[1] for r in page.tables["summary"]}
    assert rows["peak memory, this plan (predicted)"] == _fmt_bytes(plan["predicted_peak_bytes"])
    assert rows["solver"].startswith("uniform")
    assert len(page.images) == 2

    # layout, measured in the browser by a copy of the page with a script appended
    probe = tmp_path / "probe.html"
    probe.write_text(out.read_text().replace("</body>", _MEASURE + "</body>"))
    proc = _chromium(tmp_path, f"--window-size={width},3000", "--dump-dom", probe.resolve().as_uri())
    layout = json.loads(html.unescape(re.search(r'data-layout="([^"]*)"', proc.stdout).group(1)))
    assert layout["wide"] == [], layout  # no table, plot or note past the right edge
    assert layout["scrollWidth"] <= layout["clientWidth"], layout  # no horizontal scrolling
    assert layout["images"] == [[True, w] for _, w in layout["images"]] and all(w > 300 for _, w in layout["images"])

    # the screenshot: a page that is not blank, with its content inside the window's width
    shot = tmp_path / "shot.png"
    proc = _chromium(tmp_path, f"--window-size={width},3000", f"--screenshot={shot}", out.resolve().as_uri())
    assert proc.returncode == 0 and shot.exists(), proc.stderr[-2000:]
    image = Image.open(shot).convert("L")
    assert image.size == (width, 3000)
    dark = sum(image.histogram()[:200])  # pixels clearly not background
    assert dark > 0.01 * width * 3000, "the page looks blank"
    right = image.crop((width - 8, 0, width, 3000))
    assert sum(right.histogram()[:200]) == 0, "something is drawn against the right edge (overflow)"


def test_legends_sit_beside_the_curves(made, monkeypatch):
    """Every legend is outside its axes, so no curve is hidden under it."""
    from ckpt_planner.cli import report as rep

    boxes = []
    real = rep._png

    def spy(fig):
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        for ax in fig.axes:
            legend = ax.get_legend()
            assert legend is not None
            boxes.append((ax.get_window_extent(renderer), legend.get_window_extent(renderer)))
        return real(fig)

    monkeypatch.setattr(rep, "_png", spy)
    rep.figures(json.loads((made / "plan.json").read_text()), json.loads((made / "bench.json").read_text()))
    assert len(boxes) == 2
    for axes, legend in boxes:
        assert not axes.overlaps(legend), (axes, legend)


def test_measured_timeline_keeps_the_true_peak():
    """The measured series reaches the step's peak as verify measures it, even after downsampling."""
    import torch
    from ckpt_planner import optimize
    from ckpt_planner.cli.bench import measure_timeline
    from ckpt_planner.cli.report import _downsample
    from ckpt_planner.verification import default_loss, measure_step

    from tests.models.examples import MLPChain

    torch.manual_seed(0)
    model, x = MLPChain(d=32, blocks=4), torch.randn(64, 32)
    plan = optimize(model, (x,), solver="uniform", activation_budget=0.7)
    state = list(model.parameters()) + list(model.buffers())
    peak, _ = measure_step(plan.module, (x,), {}, list(model.parameters()), state, default_loss, torch.device("cpu"))
    timeline = measure_timeline(plan.module, (x,), {}, default_loss, state)
    assert timeline["peak_bytes"] == peak
    assert max(timeline["bytes"]) == peak
    values = [1, 5, 2, 9, 3, 4] * 1000 + [50] + [1] * 999
    kept, _ = _downsample(values, ["f"] * len(values), limit=100)
    assert max(kept) == 50 and len(kept) == 100


def test_bench_of_another_model_is_refused(made, tmp_path, capsys):
    other = tmp_path / "other.py"
    other.write_text(FACTORY.replace("d=32, blocks=4", "d=16, blocks=2").replace("(64, 32)", "(64, 16)"))
    assert main(["bench", f"{other}:make", "--solvers", "none", "--quiet", "-o", str(tmp_path / "other.json")]) == 0
    out = tmp_path / "r.html"
    code = main(["report", str(made / "plan.json"), "--bench", str(tmp_path / "other.json"), "-o", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "bench fingerprint" in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_baseline_row_is_not_said_to_fit(made):
    from ckpt_planner.cli.bench import bench_table

    bench = json.loads((made / "bench.json").read_text())
    none = next(r for r in bench["rows"] if r["solver"] == "none")
    assert none["measured_peak_bytes"] > bench["budget_bytes"]  # 0.7 of the activations: the baseline is over
    assert none["within_budget"] is False
    line = next(ln for ln in bench_table(bench).splitlines() if ln.startswith("none "))
    assert line.endswith("no (baseline, not held to it)")
    from ckpt_planner.cli.report import render

    page = Page()
    page.feed(render(json.loads((made / "plan.json").read_text()), bench))
    head, *rows = page.tables["bench"]
    fits = {r[0]: r[head.index("fits budget")] for r in rows}
    assert fits["none"].startswith("no") and fits["uniform"] == "yes"


def test_autotune_candidates_are_a_table_of_their_own(made, tmp_path, capsys):
    """Every plan autotune timed, with its predicted and measured figures, and which one won."""
    plan = json.loads((made / "plan.json").read_text())
    spans = [[r["start"], r["end"]] for r in plan["regions"]]
    cands = [
        {"label": "auto plan", "regions": spans, "saved": [], "predicted_peak_bytes": 1_500_000,
         "predicted_extra_s": 0.002, "measured_peak_bytes": 1_400_000, "measured_step_s": 0.012,
         "measured_median_s": 0.013, "measured_extra_s": 0.002, "fits": True, "chosen": False},
        {"label": "every_2", "regions": spans[:1], "saved": [], "predicted_peak_bytes": 1_600_000,
         "predicted_extra_s": 0.003, "measured_peak_bytes": 1_450_000, "measured_step_s": 0.011,
         "measured_median_s": 0.011, "measured_extra_s": 0.001, "fits": True, "chosen": True},
    ]
    plan["stats"]["autotune"] = {"steps": 25, "rounds": 4, "band": 0.03, "seconds": 0.5, "budget_bytes": 1_500_000,
                                 "graph_step_s": 0.010, "chosen": "every_2", "candidates": cands, "from_store": False}
    src = tmp_path / "tuned.json"
    src.write_text(json.dumps(plan))
    out = tmp_path / "report.html"
    assert main(["report", str(src), "-o", str(out)]) == 0
    page = Page()
    page.feed(out.read_text())
    table = page.tables["autotune"]
    rows = {r[0]: r for r in table[1:]}
    assert rows["every_2"][1] == "yes" and rows["auto plan"][1] == "" and rows["auto plan"][2] == "yes"
    # the measured figure: over the plain graph's 10 ms, with the rounds' noise band
    assert "measured +10.0 % +/-3.0 %" in rows["every_2"][3] and "measured +20.0 % +/-3.0 %" in rows["auto plan"][3]
    assert "25 model steps" in rows["(race)"][3] and "3.0 %" in rows["(race)"][3]
    assert not any(r[0].startswith("autotune") for r in page.tables["solver-stats"])
    # a malformed record is one line naming the field
    cands[0]["predicted_extra_s"] = "fast"
    src.write_text(json.dumps(plan))
    assert main(["report", str(src), "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "stats.autotune" in err[0]


def test_the_reports_chosen_race_row_reads_the_plan_summarys_figures(made, tmp_path):
    """The race table's chosen row carries the plan's own predicted overhead over eager (the step-time row's
    figure), not the candidate's extra over the race's graph step, and the measured one with its noise band:
    the same text as the plan summary's row, in the HTML and the Markdown page."""
    plan = json.loads((made / "plan.json").read_text())
    plan["eager_step_s"], plan["graph_overhead_s"] = 0.020, 0.001  # 20 ms eager, 1 ms of captured graph
    spans = [[r["start"], r["end"]] for r in plan["regions"]]
    cands = [
        {"label": "auto plan", "regions": spans, "saved": [], "predicted_peak_bytes": 1_500_000,
         "predicted_extra_s": 0.004, "measured_peak_bytes": 1_400_000, "measured_step_s": 0.012,
         "measured_median_s": 0.013, "measured_extra_s": 0.002, "fits": True, "chosen": True},
        {"label": "every_2", "regions": spans[:1], "saved": [], "predicted_peak_bytes": 1_600_000,
         "predicted_extra_s": 0.003, "measured_peak_bytes": 1_450_000, "measured_step_s": 0.011,
         "measured_median_s": 0.011, "measured_extra_s": -0.0002, "fits": True, "chosen": False},
    ]
    plan["stats"]["autotune"] = {"steps": 25, "rounds": 4, "band": 0.03, "seconds": 0.5, "budget_bytes": 1_500_000,
                                 "graph_step_s": 0.010, "chosen": "auto plan", "candidates": cands,
                                 "from_store": False}
    summary = Plan.from_dict(plan)
    plan["predicted_overhead"] = summary.predicted_overhead  # as a saved plan file carries it
    lines = summary.summary().splitlines()
    chosen_line = next(line for line in lines if line.lstrip().startswith("* auto plan"))
    other_line = next(line for line in lines if line.lstrip().startswith("every_2"))
    page = Page()
    page.feed(render(plan))
    rows = {r[0]: r for r in page.tables["autotune"][1:]}
    assert rows["auto plan"][1] == "yes" and chosen_line.endswith(rows["auto plan"][3])
    assert f"predicted {100 * summary.predicted_overhead:+.1f} %" in rows["auto plan"][3]
    assert "+40.0 %" not in rows["auto plan"][3]  # the race's own figure: 4 ms over its 10 ms graph step
    assert other_line.endswith(rows["every_2"][3]) and "(within the noise" in rows["every_2"][3]
    assert "| auto plan | yes | yes | " + rows["auto plan"][3] + " |" in render(plan, fmt="md")


def test_the_reports_timeline_is_the_plans_with_the_copy_streams():
    """The report's timeline of an offloading plan peaks at the plan's predicted peak (its offloads counted),
    and its host series is zero before the first copy, the offloaded bytes at the forward's end, and back to
    zero once everything is fetched."""
    from ckpt_planner.cli.report_data import timeline_data
    from ckpt_planner.solvers import simulate, solve

    from tests.unit.solvers.test_offload import INF, mlp, offloading, smallest

    problem = offloading(mlp(8), INF)
    budget = (smallest(problem) + simulate(problem).peak_bytes) // 2
    plan = solve(problem, budget, solver="auto")
    assert plan.offloaded
    data = timeline_data(problem, plan.regions, plan.saved, plan.offloaded)
    assert data["peak_bytes"] == plan.peak_bytes == max(data["bytes"]) <= budget
    without = timeline_data(problem, plan.regions, plan.saved)
    assert without["peak_bytes"] > plan.peak_bytes and "host" not in without
    host, phases = data["host"], data["phase"]
    assert len(host) == len(data["bytes"]) and host[0] == 0 and host[-1] == 0
    last_forward = max(i for i, p in enumerate(phases) if p == "forward")
    assert host[last_forward] == sum(problem.storages[t].nbytes for t in plan.offloaded)
