"""The conformance matrix's table (benchmarks/results/conformance.md) from its rows: counts per path, one table for
the architectures used while tuning the planner and one for the held-out ones, prediction-error figures, every FAIL
with the command that runs it again, the refusals, and the cells not run."""

from __future__ import annotations

from .conformance_models import FAMILY, HELD_OUT, MODELS

__all__ = ["PATHS", "COMPILE_PATHS", "COMPILE_MODELS", "default_cells", "markdown", "overhead_stats",
           "prediction_stats"]

PATHS = ("above", "below", "bf16_autocast", "bf16_model", "inexact", "compile_bytes", "compile_frac", "peft", "cli")
COMPILE_PATHS = ("compile_bytes", "compile_frac")
COMPILE_MODELS = ("gpt2", "llama", "bert", "vit", "tv_resnet", "tied_autoencoder", "custom_function", "gemma")
"""The compile paths run on these unless --all-compile: inductor builds C++ kernels on the CPU, minutes a cell."""


def _cell(r: dict | None) -> str:
    """One table cell: the result, the prediction error (predicted vs measured, %) and the planning time."""
    if r is None:
        return "not run"
    status = r["status"] + ("@min" if r.get("at_smallest") and r["status"] == "PASS" else "")
    parts = [status]
    if r.get("prediction_error") is not None:
        parts.append(f"{100 * r['prediction_error']:+.1f}%")
    if r.get("plan_s") is not None and r["status"] in ("PASS", "FAIL"):
        parts.append(f"{r['plan_s']:.1f}s")
    return " ".join(parts)


def _table(rows: list[dict], names: list[str], paths: list[str]) -> list[str]:
    by = {(r["model"], r["path"]): r for r in rows}
    lines = ["| model | family | " + " | ".join(paths) + " |", "|---|---|" + "---|" * len(paths)]
    for n in names:
        lines.append(f"| {n} | {FAMILY[n]} | " + " | ".join(_cell(by.get((n, p))) for p in paths) + " |")
    return lines


def _counts(rows: list[dict], paths: list[str]) -> list[str]:
    lines = ["| path | PASS | of which @min | REFUSE | SKIP | FAIL |", "|---|---|---|---|---|---|"]
    for p in [*paths, "all"]:
        rs = [r for r in rows if p == "all" or r["path"] == p]
        c = {s: sum(r["status"] == s for r in rs) for s in ("PASS", "REFUSE", "SKIP", "FAIL")}
        at_min = sum(r["status"] == "PASS" and bool(r.get("at_smallest")) for r in rs)
        lines.append(f"| {p} | {c['PASS']} | {at_min} | {c['REFUSE']} | {c['SKIP']} | {c['FAIL']} |")
    return lines


def prediction_stats(rows: list[dict]) -> dict:
    """Over the cells that planned and were measured, FAILs over budget included (compiled plans have no
    prediction of their own: they are judged on their measured peak)."""
    errs = [r["prediction_error"] for r in rows if r.get("prediction_error") is not None]
    if not errs:
        return {"cells": 0}
    worst = min(errs)
    return {"cells": len(errs), "within_2pct": sum(abs(e) <= 0.02 for e in errs) / len(errs),
            "under_1pct": sum(e < -0.01 for e in errs), "worst_under": worst, "worst_over": max(errs)}


def overhead_stats(rows: list[dict]) -> dict:
    """The step-time model against the measured step, over the PASS plans with regions and a predicted overhead:
    how many predictions are within 1.5x of the overhead measured in process CPU time (and in wall time), where
    the measured one is at least 5 % (below that the ratio of two small numbers says nothing about the model).
    `noise`: the largest |overhead| measured for plans with no region (the same step twice: it should be 0)."""
    out: dict = {}
    for kind in ("cpu", "wall"):
        key = f"measured_overhead_{kind}"
        ok = [r for r in rows if r["status"] == "PASS" and r.get(key) is not None]
        pairs = [(r["predicted_overhead"], r[key]) for r in ok if r.get("regions") and r.get("predicted_overhead")]
        big = [(p, m) for p, m in pairs if m >= 0.05]
        within = [(p, m) for p, m in big if 1 / 1.5 <= p / m <= 1.5]
        ratios = sorted(p / m for p, m in big)
        plain = [abs(r[key]) for r in ok if not r.get("regions")]
        out[kind] = {"cells": len(pairs), "measured_5pct": len(big), "within_1_5x": len(within),
                     "median_ratio": ratios[len(ratios) // 2] if ratios else None,
                     "noise": max(plain) if plain else None}
    return out


def _commits(meta: dict) -> str:
    commits = meta.get("commits", [])
    if len(commits) == 1:
        return f"every cell on commit {commits[0]}"
    return f"over {len(commits)} commits of main as the code moved under the run (each row in conformance.json names its own)"


def default_cells() -> list[tuple[str, str]]:
    """The whole matrix as `python -m benchmarks.conformance` runs it: the compile paths on COMPILE_MODELS."""
    return [(n, p) for p in PATHS for n in MODELS if p not in COMPILE_PATHS or n in COMPILE_MODELS]


def markdown(rows: list[dict], meta: dict) -> str:
    paths = [p for p in meta["paths"] if any(r["path"] == p for r in rows)]
    seen = {r["model"] for r in rows}
    tuned = [n for n in MODELS if n in seen and n not in HELD_OUT]
    held = [n for n in MODELS if n in seen and n in HELD_OUT]
    lines = [
        "# Conformance matrix: architectures x paths",
        "",
        f"torch {meta['torch']}, CPU, {meta['platform']}; one torch thread per cell, {meta['jobs']} cell(s) at a "
        f"time; started {meta['started']}, {meta.get('seconds', 0):.0f} s, {_commits(meta)}. "
        "Generated by `python -m "
        "benchmarks.conformance` (paths and rules in its docstring). Each cell: PASS (within budget on the "
        "allocator, prediction within budget, gradients bitwise; allclose for `inexact` and `compile_*`), "
        "PASS@min (refused, naming a smallest budget; planned again there and that plan holds), REFUSE (one line "
        "from the planner's own errors), SKIP (the path does not apply), FAIL; then the prediction error "
        "(predicted - measured) / measured of the allocator's peak, and the planning time (FLOP-based times, "
        "no autotune race). Compiled cells show no prediction error: they are judged on their measured peak.",
        *(["", meta["note"]] if meta.get("note") else []),
        "",
        "## Counts", "", *_counts(rows, paths), "",
        f"## Architectures used while tuning the planner ({len(tuned)})", "", *_table(rows, tuned, paths), "",
        f"## Held-out architectures ({len(held)}): in no test, zoo or earlier sweep", "",
        *_table(rows, held, paths), "",
    ]
    for title, subset in (("all", rows), ("held out", [r for r in rows if r["held_out"]])):
        s = prediction_stats(subset)
        if s["cells"]:
            lines.append(f"Prediction error, {title}: {s['cells']} cells that planned, {100 * s['within_2pct']:.0f} % "
                         f"within 2 %, {s['under_1pct']} more than 1 % under the measured peak; worst under "
                         f"{100 * s['worst_under']:+.1f} %, worst over {100 * s['worst_over']:+.1f} %.")
    for title, subset in (("all", rows), ("held out", [r for r in rows if r["held_out"]])):
        o = overhead_stats(subset)
        for kind, how in (("cpu", "process CPU time, one torch thread"), ("wall", "wall time, on a shared machine")):
            c = o[kind]
            if c["measured_5pct"]:
                noise = "" if c["noise"] is None else (f"; plans with no region, the plain step twice, measured "
                                                        f"within {100 * c['noise']:.0f} % of it")
                lines.append(f"Step-time model, {title}, against the overhead measured in {how}: of {c['cells']} "
                             f"plans with regions, {c['measured_5pct']} measured at least 5 % slower than the plain "
                             f"step; the prediction (from the cells' FLOP-based times, not times measured here) is within 1.5x on {c['within_1_5x']} of them (median "
                             f"predicted/measured {c['median_ratio']:.2f}){noise}.")
    lines.append("The FLOP-based times these cells plan on are the fallback, not the step-time model a user gets by "
                 "default: that one, the measured profile, is judged on the held-out rows by `python -m "
                 "benchmarks.step_time` ([step_time.md](step_time.md)).")
    fails = [r for r in rows if r["status"] == "FAIL"]
    if fails:
        lines += ["", "## FAIL", ""]
        lines += [f"- {r['model']} / {r['path']}: {r.get('reason', '')} "
                  f"(`python -m benchmarks.conformance --models {r['model']} --paths {r['path']} --out /tmp/c`)"
                  for r in fails]
    refused = [r for r in rows if r["status"] == "REFUSE"]
    if refused:
        lines += ["", "## Refusals", ""]
        lines += [f"- {r['model']} / {r['path']}: {r.get('reason')}" for r in refused]
    at_min = [f"{r['model']}/{r['path']}" for r in rows if r.get("at_smallest") and r["status"] == "PASS"]
    if at_min:
        lines += ["", f"Refused at the budget asked, naming a smallest budget, and planned there within it, bitwise "
                      f"({len(at_min)}; their refusals in conformance.json): " + ", ".join(at_min) + "."]
    ran = {(r["model"], r["path"]) for r in rows}
    missing = [c for c in default_cells() if c not in ran]
    if missing:
        lines += ["", f"Not run ({len(missing)} of the {len(default_cells())} cells of `python -m "
                      "benchmarks.conformance`), by path: " + "; ".join(
                          f"{p}: " + ", ".join(n for n, q in missing if q == p) for p in PATHS
                          if any(q == p for _, q in missing)) + "."]
    return "\n".join(lines) + "\n"

