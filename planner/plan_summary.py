"""The rows of `Plan.summary()` that read the plan's own records (the autotune race)."""

from __future__ import annotations

from typing import Any

__all__ = ["autotune_rows", "fmt_bytes"]


def fmt_bytes(n: float | None) -> str:
    """Bytes as people read them (GB, MB, KB: powers of ten); "-" for none."""
    if n is None:
        return "-"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def autotune_rows(stats: dict[str, Any], eager_step_s: float = 0.0, graph_overhead_s: float = 0.0,
                  chosen_overhead: float | None = None) -> list[tuple[str, str]]:
    """Rows for Plan.summary() from `stats["autotune"]`: the choice, the cost, each candidate's figures.

    One figure per quantity: a candidate's predicted overhead is the summary's own (its predicted step, the
    captured graph's overhead `graph_overhead_s` plus its recompute, over the eager step `eager_step_s`;
    the chosen plan's is `chosen_overhead`, the plan's own figure), so the chosen row and the step-time row
    read the same number. The measured overhead is what the race measured, over the captured graph's plain
    step in the same rounds, with the rounds' noise band; one below zero is said to be within the noise, or
    beyond it. Without `eager_step_s` (a record alone) the predicted figures are over the race's graph step.
    """
    rec = stats.get("autotune")
    if not isinstance(rec, dict):
        return []
    if rec.get("skipped"):
        return [("autotune", f"not run: {rec['skipped']}")]
    band = float(rec.get("band") or 0.0)
    how = "kept from an earlier run (timing store)" if rec.get("from_store") else (
        f"{rec.get('steps', 0)} model steps, {rec.get('rounds', 0)} rounds, noise band +/-{100 * band:.1f} % "
        "(the spread of each plan's step over the plain graph's step of the same round)")
    base = rec.get("graph_step_s") or 0.0
    against = (f"; measured figures: candidates' extra time against the captured graph's step without "
               f"checkpointing, measured at {base * 1e3:.1f} ms (fastest of its rounds) in the same rounds"
               if base > 0 else "")
    if eager_step_s > 0:
        against += (f"; predicted figures: against the eager step ({eager_step_s * 1e3:.1f} ms, measured while "
                    "profiling), as the step-time row's")
    rows = [("autotune", f"chose {rec.get('chosen') or 'the solver plan (none fit on the clock)'}; {how}{against}")]
    for c in rec.get("candidates", []):
        if not isinstance(c, dict):
            continue
        if c.get("failed"):
            rows.append((f"    {c.get('label')}", f"not raced: its step raised ({c['failed']})"))
            continue
        rows.append((f"  {'*' if c.get('chosen') else ' '} {c.get('label')}",
                     _predicted(c, base, eager_step_s, graph_overhead_s, chosen_overhead) + "; "
                     + _measured(c, base, band)))
    return rows


def _predicted(c: dict[str, Any], base: float, eager_s: float, graph_s: float, chosen: float | None) -> str:
    extra = float(c.get("predicted_extra_s") or 0.0)
    peak = f"{(c.get('predicted_peak_bytes') or 0) / 1e6:.1f} MB"
    if eager_s > 0:  # the summary's figure: (graph overhead + recompute) over eager; a whole-module plan runs
        # as the model's own code, without the captured graph
        over = chosen if c.get("chosen") and chosen is not None else (
            (extra + (0.0 if c.get("modules") else graph_s)) / eager_s)
        return f"predicted {100 * over:+.1f} %, {peak}"
    if base > 0:
        return f"predicted {100 * extra / base:+.1f} % (of the graph's measured step), {peak}"
    return f"predicted {extra * 1e3:+.1f} ms, {peak}"


def _measured(c: dict[str, Any], base: float, band: float) -> str:
    meas = c.get("measured_extra_s")
    peak = f"{(c.get('measured_peak_bytes') or 0) / 1e6:.1f} MB" + ("" if c.get("fits") else " (over the budget)")
    if meas is None or base <= 0:  # no plain graph's step in the rounds: the plan's own step, fastest of its rounds
        step = c.get("measured_step_s")
        return (f"measured step {step * 1e3:.1f} ms +/-{100 * band:.1f} % (fastest of its rounds), {peak}"
                if isinstance(step, (int, float)) and step > 0 else f"measured {peak}")
    pct = meas / base
    text = f"measured {100 * pct:+.1f} % +/-{100 * band:.1f} %"
    if pct < 0:  # a plan that recomputes is not faster than the plain graph: what the rounds' noise says
        text += (" (within the noise: no faster than the plain graph)" if -pct <= band else
                 " (below the plain graph's step by more than the noise band: the rounds were not steady)")
    elif pct <= band and float(c.get("predicted_extra_s") or 0.0) > 0:
        text += " (within the noise)"
    return f"{text}, {peak}"
