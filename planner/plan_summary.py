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


def autotune_rows(stats: dict[str, Any]) -> list[tuple[str, str]]:
    """Rows for Plan.summary() from `stats["autotune"]`: the choice, the cost, each candidate's figures."""
    rec = stats.get("autotune")
    if not isinstance(rec, dict):
        return []
    if rec.get("skipped"):
        return [("autotune", f"not run: {rec['skipped']}")]
    how = "kept from an earlier run (timing store)" if rec.get("from_store") else (
        f"{rec.get('steps', 0)} model steps, {rec.get('rounds', 0)} rounds, noise band {100 * rec.get('band', 0):.0f} %")
    base = rec.get("graph_step_s") or 0.0
    # The step-time row is the plan's prediction against eager; these rows are the race's own figures, each
    # candidate's extra time over the captured graph's step without checkpointing, measured side by side.
    against = (f"; candidates' extra time against the captured graph's step without checkpointing, measured at "
               f"{base * 1e3:.1f} ms in the same rounds (not eager's)" if base > 0 else "")
    rows = [("autotune", f"chose {rec.get('chosen') or 'the solver plan (none fit on the clock)'}; {how}{against}")]
    for c in rec.get("candidates", []):
        if not isinstance(c, dict):
            continue
        pred = c.get("predicted_extra_s", 0.0)
        meas = c.get("measured_extra_s")
        pct = (lambda s: f"{100 * s / base:+.1f} %") if base > 0 else (lambda s: f"{s * 1e3:+.1f} ms")
        if c.get("failed"):
            rows.append((f"    {c.get('label')}", f"not raced: its step raised ({c['failed']})"))
            continue
        rows.append((
            f"  {'*' if c.get('chosen') else ' '} {c.get('label')}",
            f"predicted {pct(pred)}, {c.get('predicted_peak_bytes', 0) / 1e6:.1f} MB; measured "
            + (f"{pct(meas)}, " if meas is not None else "")
            + f"{c.get('measured_peak_bytes', 0) / 1e6:.1f} MB" + ("" if c.get("fits") else " (over the budget)"),
        ))
    return rows
