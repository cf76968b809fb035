"""Plan reports: one self-contained HTML (or Markdown) page with plots, and the data they need.

At plan time the CLI stores in `plan.stats`:

* ``timeline``: the simulator's memory timeline of the step for the plan and
  for no checkpointing (`timeline_data`),
* ``curves``: the memory/recompute curve of every registered solver
  (`curve_data`), with this plan's point.

A bench file (`ckpt-planner bench -o bench.json`) adds measured figures and
measured timelines (`planner.bench.measure_timeline`). Plots are matplotlib (Agg) PNGs
embedded as base64 data URIs, so the page needs nothing else.

One concept, so one module over 500 lines: the report page; HTML and Markdown render the same sections and
plots from the same plan data.
"""

from __future__ import annotations

import base64
import contextlib
import html
import io
import json
import re
from collections.abc import Iterator
from typing import Any

from ..plan_summary import autotune_rows
from .outputs import printable
from .report_data import _downsample, curve_data, plan_data, step_overhead, timeline_data  # noqa: F401 - re-exported

__all__ = [
    "measured_series",
    "step_overhead",
    "timeline_data",
    "curve_data",
    "plan_data",
    "summary_rows",
    "figures",
    "render",
]

_OWN_STATS = ("timeline", "curves", "cli", "verify", "autotune")


# -- rendering ------------------------------------------------------------------


def _fmt_bytes(n: Any) -> str:
    from ..plan_summary import fmt_bytes as fmt

    return fmt(n)


def summary_rows(plan: dict[str, Any]) -> list[tuple[str, str, Any, str]]:
    """(key, label, raw value, text) rows of the summary table; raw values are the plan file's."""
    base, pred = plan["baseline_peak_bytes"], plan["predicted_peak_bytes"]
    fwd = plan.get("baseline_step_s") or 0.0
    rec = plan["predicted_recompute_s"]
    budget = plan.get("budget_bytes")
    rows = [
        (
            "model",
            "model",
            plan.get("model") or "-",
            f"{plan.get('model') or '-'} ({plan.get('num_nodes', 0)} nodes, {plan.get('capture_method')})",
        ),
        ("solver", "solver", plan["solver"], f"{plan['solver']} (solved in {plan.get('solve_time_s', 0.0):.3f} s)"),
        ("budget_bytes", "budget", budget, _fmt_bytes(budget) if budget is not None else "none (knee of the curve)"),
        ("baseline_peak_bytes", "peak memory, no checkpointing (predicted)", base, _fmt_bytes(base)),
        ("predicted_peak_bytes", "peak memory, this plan (predicted)", pred, _fmt_bytes(pred)),
    ]
    if plan.get("baseline_measured_peak_bytes") is not None:
        v = plan["baseline_measured_peak_bytes"]
        rows.append(("baseline_measured_peak_bytes", "peak memory, no checkpointing (measured)", v, _fmt_bytes(v)))
    if plan.get("measured_peak_bytes") is not None:
        v = plan["measured_peak_bytes"]
        rows.append(("measured_peak_bytes", "peak memory, this plan (measured)", v, _fmt_bytes(v)))
    rows += [
        (
            "saved_bytes",
            "memory saved (predicted)",
            base - pred,
            f"{_fmt_bytes(base - pred)} ({100 * (base - pred) / max(1, base):.1f} %)",
        ),
        _overhead_row(plan, rec, fwd),
        (
            "regions",
            "recomputed regions",
            len(plan["regions"]),
            # the terminal summary's words and counts (Plan.summary)
            f"{len(plan['regions'])} ({sum(1 for r in plan['regions'] if r.get('depth'))} nested, "
            f"{sum(1 for r in plan['regions'] if r.get('saved_ops'))} selective, "
            f"{sum(len(r.get('saved_positions') or ()) for r in plan['regions'])} ops kept)",
        ),
        ("fingerprint", "graph fingerprint", plan["fingerprint"], plan["fingerprint"]),
    ]
    return rows


def _overhead_row(plan: dict[str, Any], rec: float, fwd: float) -> tuple[str, str, Any, str]:
    """The summary's one overhead: the predicted step against eager with its parts (as Plan.summary), or,
    for a plan file without step times, the recompute against the forward."""
    eager, step = plan.get("eager_step_s") or 0.0, plan.get("predicted_step_s") or 0.0
    if eager > 0:
        return (
            "predicted_step_s",
            "predicted step time",
            step,
            f"{step * 1e3:.1f} ms against {eager * 1e3:.1f} ms eager: {100 * (step / eager - 1):+.1f} % = recompute "
            f"{rec * 1e3:.1f} ms (checkpoint calls {(plan.get('call_overhead_s') or 0.0) * 1e3:.1f} ms of it) + "
            f"captured graph {(plan.get('graph_overhead_s') or 0.0) * 1e3:.1f} ms"
            + (" (FLOP estimate)" if plan.get("time_source") == "flops" else ""),
        )
    return (
        "predicted_recompute_s",
        "recompute overhead",
        rec,
        f"{rec * 1e3:.2f} ms = {100 * rec / fwd if fwd > 0 else 0.0:.1f} % of the forward ({plan.get('time_source', 'measured')} times)",
    )


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return buf.getvalue()


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ImportError("the report needs matplotlib: pip install 'ckpt-planner[report]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plot_series(ax, series: dict[str, Any], label: str, style: str) -> None:
    """The series, with its peak marked where it happens (the recorded peak, if sampling missed it)."""
    values = list(series["bytes"])
    n = len(values)
    xs = [i / max(1, n - 1) for i in range(n)]
    peak = int(series.get("peak_bytes") or (max(values) if values else 0))
    if values and max(values) < peak:  # a series sampled between ops: put the recorded peak at its highest sample
        values[values.index(max(values))] = peak
    (line,) = ax.plot(xs, [b / 1e6 for b in values], style, label=f"{label} (peak {_fmt_bytes(peak)})", lw=1.2)
    if values:
        k = values.index(max(values))
        ax.plot([xs[k]], [values[k] / 1e6], "o", color=line.get_color(), ms=4)


@contextlib.contextmanager
def _field(name: str) -> Iterator[None]:
    """Malformed data under `name` (an edited or foreign file) becomes one PlanFileError naming it."""
    from ..errors import PlanFileError

    try:
        yield
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, OverflowError) as e:
        import matplotlib.pyplot as plt

        plt.close("all")
        raise PlanFileError(f"{name} is malformed ({type(e).__name__}: {str(e)[:120]})") from None


_MD_SPECIAL = re.compile(r"([\\`*_{}\[\]#!|~$])")


def _md(text: Any) -> str:
    """Text for a Markdown cell or heading: one line, HTML-escaped, Markdown punctuation backslash-escaped."""
    one_line = " ".join(str(text).splitlines())
    return _MD_SPECIAL.sub(r"\\\1", html.escape(one_line, quote=False))


def figures(plan: dict[str, Any], bench: dict[str, Any] | None = None) -> dict[str, bytes]:
    """PNG plots: 'timeline' (memory over the step) and 'curve' (memory vs recompute), where data exists.

    Labels are drawn as plain text (no mathtext: a `$` in a name is just a
    character); malformed data raises PlanFileError naming the field.
    """
    plt = _pyplot()
    with plt.rc_context({"text.parse_math": False, "text.usetex": False}):
        # names drawn with their control characters escaped: a glyph the font lacks is named in a warning
        # on the terminal, raw (an ESC there starts an escape sequence)
        return _figures(plt, _printable_strings(plan), _printable_strings(bench))


def _printable_strings(value: Any) -> Any:
    """`value` (parsed JSON) with every string in it, keys too, passed through `outputs.printable`."""
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, dict):
        return {_printable_strings(k): _printable_strings(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_printable_strings(v) for v in value]
    return value


def _figures(plt: Any, plan: dict[str, Any], bench: dict[str, Any] | None) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    stats = plan.get("stats") or {}
    with _field("plan file: stats.timeline"):
        timeline = stats.get("timeline") or {}
        if not isinstance(timeline, dict):
            raise TypeError("not an object")
    with _field("bench file: rows[].timeline"):
        measured = {r["solver"]: r["timeline"] for r in (bench or {}).get("rows", []) if r.get("timeline")}
    with _field("plan file: stats.timeline (or the bench file's timelines)"):
        _timeline_figure(plt, plan, timeline, measured, out)
    with _field("plan file: stats.curves"):
        _curve_figure(plt, plan, stats.get("curves") or {}, out)
    return out


def _timeline_figure(plt: Any, plan: dict[str, Any], timeline: dict, measured: dict, out: dict[str, bytes]) -> None:
    if timeline or measured:
        fig, ax = plt.subplots(figsize=(8, 3.6))
        if "baseline" in timeline:
            _plot_series(ax, timeline["baseline"], "no checkpointing, predicted", "C7-")
        if "plan" in timeline:
            _plot_series(ax, timeline["plan"], f"{plan['solver']}, predicted", "C0-")
            if timeline["plan"].get("host"):  # the copy streams: what the plan holds on the host meanwhile
                host = timeline["plan"]["host"]
                ax.plot([i / max(1, len(host) - 1) for i in range(len(host))], [b / 1e6 for b in host], "C2--",
                        lw=1.0, label="offloaded to the host (copy streams)")
            phases = timeline["plan"]["phase"]
            start = next((i for i, ph in enumerate(phases) if ph != "forward"), None)
            if start:
                ax.axvline(start / max(1, len(phases) - 1), color="C0", ls="-.", lw=0.8, label="backward starts (plan)")
        for label, series, style in measured_series(measured):
            _plot_series(ax, series, label, style)
        if plan.get("budget_bytes"):
            ax.axhline(plan["budget_bytes"] / 1e6, color="C1", ls=":", label="budget")
        ax.set_xlabel("progress through the step (forward, then backward with recompute)")
        ax.set_ylabel("live memory (MB)")
        ax.set_title("Memory over one training step (dots: each series' peak)")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
        out["timeline"] = _png(fig)


def measured_series(measured: dict[str, Any]) -> list[tuple[str, dict[str, Any], str]]:
    """(legend label, series, style) of every measured timeline a bench file holds, one per solver row."""
    out = []
    for i, (name, series) in enumerate(measured.items()):
        label = f"{'no checkpointing' if name == 'none' else name}, measured"
        out.append((label, series, "C7--" if name == "none" else f"C{3 + i % 6}--"))
    return out


def _curve_figure(plt: Any, plan: dict[str, Any], curves: dict, out: dict[str, bytes]) -> None:
    if curves.get("solvers"):
        fig, ax = plt.subplots(figsize=(6.5, 4))
        for i, (name, pts) in enumerate(sorted(curves["solvers"].items())):
            if pts:
                pts = sorted(pts, key=lambda p: p["peak_bytes"])
                ax.plot(
                    [p["peak_bytes"] / 1e6 for p in pts],
                    [100 * p["overhead"] for p in pts],
                    "o-",
                    color=f"C{i}",
                    label=name,
                    ms=3,
                )
        base = curves.get("baseline")
        if base:
            ax.plot([base["peak_bytes"] / 1e6], [0.0], "s", color="k", label="no checkpointing")
        mark = curves.get("plan")
        if mark:
            ax.plot(
                [mark["peak_bytes"] / 1e6],
                [100 * mark["overhead"]],
                "*",
                color="red",
                ms=14,
                label=f"this plan ({mark['solver']})",
            )
        if plan.get("budget_bytes"):
            ax.axvline(plan["budget_bytes"] / 1e6, color="C1", ls=":", label="budget")
        ax.set_xlabel("predicted peak memory (MB)")
        ax.set_ylabel("predicted step time over eager (%)" if curves.get("overhead") == "step"
                      else "recompute (% of forward time)")
        ax.set_title("Memory / overhead trade-off per solver")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
        out["curve"] = _png(fig)


def _region_rows(plan: dict[str, Any]) -> list[list[str]]:
    rows = []
    for i, r in enumerate(plan["regions"]):
        rows.append(
            [
                str(i),
                "  " * r.get("depth", 0) + f"{r['first_node']} .. {r['last_node']}",
                ", ".join(r.get("modules", ())) or "(root)",
                f"{r['end'] - r['start'] + 1}",
                _fmt_bytes(r.get("saved_bytes", 0)),
                f"{r.get('recompute_s', 0.0) * 1e3:.3f}",
            ]
        )
    return rows


_REGION_HEAD = ["#", "nodes (first .. last)", "modules recomputed", "nodes", "saved", "recompute ms"]
_BENCH_HEAD = [
    "solver", "status", "predicted peak", "measured peak", "fits budget", "step ms", "x no ckpt", "solve s", "exact"
]
_LONG = 90  # characters of a table cell shown before it is folded into a <details>


def fits_text(row: dict[str, Any], budget: Any) -> str:
    """'yes' / 'NO' for a row held to the budget; the baseline (`none`) is compared but not held to it."""
    if row.get("status") != "ok":
        return "-"
    if budget is None:
        return "no budget"
    fits = row["measured_peak_bytes"] <= budget
    if row["solver"] == "none":
        return "yes (baseline)" if fits else "no (baseline, not held to it)"
    return "yes" if fits and row.get("within_budget", True) else "NO"


def check_bench(plan: dict[str, Any], bench: dict[str, Any]) -> None:
    """Refuse a bench file measured on another model or input shape than the plan's."""
    from ..errors import PlanMismatchError

    theirs, ours = bench.get("fingerprint"), plan.get("fingerprint")
    if theirs is None or theirs != ours:
        raise PlanMismatchError(
            f"bench fingerprint: the bench file was made for {bench.get('model') or 'another model'} "
            f"(graph {theirs}), the plan for {plan.get('model') or 'a model'} (graph {ours}); "
            "run `ckpt-planner bench` on the plan's model and inputs"
        )


def _bench_rows(bench: dict[str, Any]) -> list[list[str]]:
    rows = []
    for r in bench.get("rows", []):
        ok = r.get("status") == "ok"
        rows.append(
            [
                r["solver"],
                r.get("status", "-") if ok else f"{r.get('status')}: {r.get('error', '')}",
                _fmt_bytes(r.get("predicted_peak_bytes")) if ok else "-",
                _fmt_bytes(r.get("measured_peak_bytes")) if ok else "-",
                fits_text(r, bench.get("budget_bytes")),
                f"{r['step_s'] * 1e3:.2f}" if ok else "-",
                f"{r['step_time_ratio']:.2f}" if ok else "-",
                f"{r['solve_time_s']:.3f}" if ok else "-",
                ("yes" if r.get("exact") else "NO") if ok else "-",
            ]
        )
    return rows


def _flat(prefix: str, value: Any) -> list[list[str]]:
    """One row per plain value: nested objects become dotted names, lists of plain values one text."""
    if isinstance(value, dict) and value:
        return [row for k, v in sorted(value.items(), key=lambda kv: str(kv[0])) for row in _flat(f"{prefix}.{k}", v)]
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, dict) for v in value):
        return [row for i, v in enumerate(value) for row in _flat(f"{prefix}[{i}]", v)]
    if isinstance(value, (list, tuple)):
        return [[prefix, ", ".join(str(v) for v in value) or "(none)"]]
    if isinstance(value, float):
        return [[prefix, f"{value:.6g}"]]
    return [[prefix, "(none)" if value is None or value == {} else str(value)]]


_AUTOTUNE_HEAD = ["candidate", "chosen", "fits budget", "predicted and measured (as the plan summary)"]


def _autotune_rows(plan: dict[str, Any]) -> list[list[str]]:
    """One row per plan autotune timed (stats["autotune"]), then how the race was run: the plan summary's own
    rows (`plan_summary.autotune_rows`), so the chosen row's predicted overhead is the plan's own (its step
    over eager, the step-time row's figure) and a measured one carries the race's noise band."""
    stats = plan.get("stats", {})
    rec = stats.get("autotune")
    if not isinstance(rec, dict):
        return []
    summary = autotune_rows(stats, float(plan.get("eager_step_s") or 0.0), float(plan.get("graph_overhead_s") or 0.0),
                            _float_or_none(plan.get("predicted_overhead")))
    if rec.get("skipped"):
        return [["(not run)", "", "", summary[0][1]]]
    cands = [c for c in rec.get("candidates", []) if isinstance(c, dict)]  # the summary's rows, one per candidate
    rows = [[str(c.get("label")), "yes" if c.get("chosen") else "", "yes" if c.get("fits") else "no", text]
            for c, (_, text) in zip(cands, summary[1:])]
    rows.append(["(race)", "", "", summary[0][1]])
    return rows


def _float_or_none(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) else None


def _solver_stats(plan: dict[str, Any]) -> list[list[str]]:
    stats = {k: v for k, v in plan.get("stats", {}).items() if k not in _OWN_STATS}
    rows = [row for k, v in sorted(stats.items()) for row in _flat(k, v)]
    rows += [row for k, v in sorted(plan.get("solver_options", {}).items()) for row in _flat(f"option {k}", v)]
    return rows


def render(plan: dict[str, Any], bench: dict[str, Any] | None = None, *, fmt: str = "html") -> str:
    """The report page for a plan (the plan file's dict) and an optional bench file's dict; control
    characters in its names are written as visible escapes (a report is also read with `cat`)."""
    return printable(_render(plan, bench, fmt))


def _render(plan: dict[str, Any], bench: dict[str, Any] | None, fmt: str) -> str:
    if fmt not in ("html", "md"):
        raise ValueError(f"fmt: {fmt!r} is not 'html' or 'md'")
    if bench:
        check_bench(plan, bench)
    pngs = {k: base64.b64encode(v).decode() for k, v in figures(plan, bench).items()}
    summary = summary_rows(plan)
    sections: list[tuple[str, str, list[str], list[list[str]]]] = [
        ("regions", "Recomputed regions", _REGION_HEAD, _region_rows(plan)),
        ("solver-stats", "Solver statistics", ["statistic", "value"], _solver_stats(plan)),
    ]
    with _field("plan file: stats.autotune"):
        tuned = _autotune_rows(plan)
    if tuned:
        sections.insert(1, ("autotune", "Autotune: the plans timed on the device", _AUTOTUNE_HEAD, tuned))
    if bench:
        with _field("bench file: rows"):
            bench_rows = _bench_rows(bench)
        sections.append(
            (
                "bench",
                f"Bench ({bench.get('device', '?')}, budget {_fmt_bytes(bench.get('budget_bytes'))})",
                _BENCH_HEAD,
                bench_rows,
            )
        )
    captions = {"timeline": "Memory over one training step", "curve": "Memory / overhead trade-off"}
    title = f"ckpt-planner report: {plan.get('model') or 'model'}"
    if fmt == "md":
        lines = [f"# {_md(title)}", "", "| | |", "|---|---|"]
        lines += [f"| {_md(label)} | {_md(text)} |" for _, label, _, text in summary]
        lines += [f"\nnote: {_md(n)}" for n in plan.get("notes", [])]
        for key, png in pngs.items():
            lines += ["", f"## {captions[key]}", "", f"![{captions[key]}](data:image/png;base64,{png})"]
        for _, head, cols, rows in sections:
            lines += ["", f"## {_md(head)}", ""]
            if not rows:
                lines.append("(none)")
                continue
            lines += ["| " + " | ".join(_md(c) for c in cols) + " |", "|" + "---|" * len(cols)]
            lines += ["| " + " | ".join(_md(c) for c in row) + " |" for row in rows]
        return "\n".join(lines) + "\n"
    e = html.escape
    parts = [
        "<!DOCTYPE html>",
        f"<html><head><meta charset='utf-8'><title>{e(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{e(title)}</h1>",
        "<h2>Summary</h2>",
        "<table id='summary'>",
    ]
    for key, label, raw, text in summary:
        parts.append(
            f"<tr data-key='{e(key)}' data-value='{e(json.dumps(raw))}'><th>{e(label)}</th><td>{e(text)}</td></tr>"
        )
    parts.append("</table>")
    parts += [f"<p class='note'>note: {e(n)}</p>" for n in plan.get("notes", [])]
    for key, png in pngs.items():
        parts.append(
            f"<h2>{e(captions[key])}</h2><img id='plot-{key}' alt='{e(captions[key])}' src='data:image/png;base64,{png}'>"
        )
    for sid, head, cols, rows in sections:
        parts.append(f"<h2>{e(head)}</h2>")
        if not rows:
            parts.append("<p>(none)</p>")
            continue
        parts.append(f"<table id='{sid}'><tr>" + "".join(f"<th>{e(c)}</th>" for c in cols) + "</tr>")
        parts += ["<tr>" + "".join(f"<td>{_cell(c)}</td>" for c in row) + "</tr>" for row in rows]
        parts.append("</table>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def _cell(text: str) -> str:
    """A table cell's HTML: long text (error messages, raw statistics) folded after _LONG characters."""
    e = html.escape
    if len(text) <= 16:  # figures ("20.97 MB") stay on one line
        return f"<span class='n'>{e(text)}</span>"
    if len(text) <= _LONG:
        return e(text)
    cut = text.rfind(" ", 0, _LONG)
    cut = cut if cut > _LONG // 2 else _LONG
    return f"<details class='long'><summary>{e(text[:cut])}</summary>{e(text[cut:])}</details>"


# Cells wrap at spaces (the region column keeps its leading spaces for nesting); long text (error
# lines, raw statistics) is folded and may break anywhere, so no table is wider than the page.
_CSS = (
    "body{font-family:sans-serif;max-width:1000px;margin:2em auto;padding:0 1em;color:#222}"
    "table{border-collapse:collapse;margin:.5em 0;max-width:100%}"
    "th,td{border:1px solid #ccc;padding:3px 8px;text-align:left;vertical-align:top;font-size:13px;"
    "white-space:pre-wrap;overflow-wrap:break-word}"
    "th{background:#f4f4f4;white-space:nowrap}img{max-width:100%;height:auto}.note{color:#555;overflow-wrap:anywhere}"
    "details.long{overflow-wrap:anywhere;min-width:18em}details summary{cursor:pointer}details:not([open]) summary::after{content:' ...'}.n{white-space:nowrap}"
)
