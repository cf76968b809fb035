"""The MILP backends of `ilp`: HiGHS in-process (highspy) or pulp's bundled CBC.

Which backend runs, how each is configured, how a failure is told apart from an
answer, and the proven bound each reports. CBC 2.10.3 segfaults when
warm-started (`-mips`) with a time limit (`-sec`) on a loaded machine, so it is
never warm-started under a time limit. HiGHS runs in the process: no
subprocess to crash.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import sys
from collections.abc import Iterator

__all__ = ["ILPBackendError", "ILPSolveError", "default_backend", "native_stdout_dropped"]


class ILPBackendError(ValueError):
    """The MILP backend named is unknown or not installed."""


class ILPSolveError(RuntimeError):
    """Every MILP backend failed (crashed, raised, or answered something that is not a plan)."""


class _BackendFailure(Exception):
    """One backend's solve failed; the message says how."""


@contextlib.contextmanager
def native_stdout_dropped() -> Iterator[None]:
    """Drop what native code writes to file descriptor 1 while inside.

    HiGHS prints its banner from C++ when a model is made, whatever `output_flag` says: on stdout it
    would corrupt a caller's machine-readable output (`ckpt-planner ... --json`), and on stderr it is
    noise in a library that says nothing unless asked. With `msg=False` nothing else is written there.
    What Python code wrote before is flushed first, so it is not lost.
    """
    try:
        # The process's own descriptor: a progress bar may stand in for sys.stdout with a proxy that has
        # no descriptor, while the native code still writes to descriptor 1.
        out = sys.__stdout__.fileno()
    except (AttributeError, OSError, ValueError):  # no real descriptor (captured streams): nothing to drop
        yield
        return
    sys.stdout.flush()
    sys.__stdout__.flush()
    _flush_c_stdio()
    saved = os.dup(out)
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, out)
        yield
    finally:
        _flush_c_stdio()  # a C library buffers a file's stdout: what it holds is dropped before the swap back
        os.dup2(saved, out)
        os.close(saved)
        os.close(null)


def _flush_c_stdio() -> None:
    try:
        import ctypes

        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError, TypeError):  # no C library to reach (not a POSIX system): nothing to flush
        pass


def _highs_available() -> bool:
    try:
        import highspy  # noqa: F401
    except ImportError:
        return False
    return True


def default_backend() -> str:
    """'highs' when highspy is installed (in-process, no subprocess to crash), else 'cbc'."""
    return "highs" if _highs_available() else "cbc"


def _backends(backend: str) -> list[str]:
    """The backends to try, in order: the one asked for, then the other one when it is installed."""
    if backend == "auto":
        backend = default_backend()
    if backend == "highs" and not _highs_available():
        raise ILPBackendError("backend 'highs' needs highspy: pip install highspy")
    if backend not in ("cbc", "highs"):
        raise ILPBackendError(f"backend: {backend!r} is not one of 'cbc', 'highs', 'auto'")
    other = "cbc" if backend == "highs" else "highs"
    return [backend] + ([other] if other == "cbc" or _highs_available() else [])


def _backend(
    name: str, time_limit: float | None, gap: float, log_path: str, warm: bool = False, presolve: bool = True,
    node_limit: int | None = None,
):
    """(name, pulp solver) for backend 'cbc' or 'highs'. `node_limit`: branch-and-bound nodes the search may
    take (None: no limit); like a time limit, reaching it is an answer, the best plan found so far."""
    import pulp

    if name == "cbc":
        # CBC 2.10.3 segfaults when warm-started (-mips) with a time limit (-sec) on a loaded machine.
        return "cbc", pulp.PULP_CBC_CMD(
            msg=False,
            timeLimit=time_limit,
            gapRel=gap,
            logPath=log_path,
            threads=1,
            warmStart=warm and time_limit is None,
            maxNodes=node_limit,
        )
    if name == "highs":
        return "highs", _highs_solver()(
            msg=False, timeLimit=time_limit, gapRel=gap, threads=1, node_limit=node_limit,
            presolve="on" if presolve else "off",
        )
    raise ILPBackendError(f"backend: {name!r} is not one of 'cbc', 'highs', 'auto'")


@functools.cache
def _highs_solver() -> type:
    """pulp's in-process HiGHS, stopped after `node_limit` branch-and-bound nodes with the best plan found as
    the answer (pulp has no status for that stop).

    It is not handed a start: pulp 3.3 never did (it passes `warmStart` on as an option HiGHS does not know),
    the plans `ilp` returns were chosen that way, and a started HiGHS proves flat optima that kept ops then
    improve less on some models (a ConvNeXt at a fifth of its memory). `ilp` compares
    its start with the MILP's answer itself."""
    import highspy
    import pulp

    class Highs(pulp.HiGHS):
        def __init__(self, *, node_limit: int | None = None, **options) -> None:
            if node_limit is not None:
                options["mip_max_nodes"] = int(node_limit)
            super().__init__(**options)

        def findSolutionValues(self, lp):  # noqa: N802 - pulp's name
            model = lp.solverModel
            if model.getModelStatus() != highspy.HighsModelStatus.kSolutionLimit:
                return super().findSolutionValues(lp)
            if model.getInfo().primal_solution_status == 0:  # stopped before any plan was found
                return pulp.LpStatusNotSolved, pulp.LpSolutionNoSolutionFound
            values = list(model.getSolution().col_value)
            for var in lp.variables():
                var.varValue = values[var.index]
            return pulp.LpStatusOptimal, pulp.LpSolutionIntegerFeasible

    return Highs


_HIGHS_ERRORS = frozenset({"kLoadError", "kModelError", "kPresolveError", "kSolveError", "kPostsolveError"})


def _highs_model_status(name: str, prob) -> str | None:
    """HiGHS's own model status ('kOptimal', 'kTimeLimit', 'kSolveError'...), where there is one."""
    if name != "highs":
        return None
    try:
        return str(prob.solverModel.getModelStatus()).rsplit(".", 1)[-1]
    except Exception:  # noqa: BLE001 - no solver model (a stand-in backend): nothing more to tell
        return None


def _best_bound(name: str, prob, log_path: str, objective: float) -> float | None:
    """The solver's proven lower bound on the objective, where it tells."""
    if name == "highs":
        try:
            return float(prob.solverModel.getInfo().mip_dual_bound)
        except Exception:  # noqa: BLE001 - older highspy: no bound, gap unknown
            return None
    try:
        with open(log_path) as fh:
            text = fh.read()
    except OSError:
        return None
    # CBC's closing summary: "Result - Optimal solution found" (search completed: the incumbent is proven),
    # or "Result - Stopped on time limit" followed by "Lower bound:". The "best possible" of the progress
    # lines is a snapshot taken during the search, stale once it completes.
    result = re.search(r"^Result - (.*)$", text, re.MULTILINE)
    lower = re.search(r"^Lower bound:\s+([-0-9.eE+]+)", text, re.MULTILINE)
    if lower:
        return float(lower.group(1))
    if result and result.group(1).startswith("Optimal solution found"):
        if "tolerance" not in result.group(1):
            return objective
        found = re.findall(r"best possible ([-0-9.eE+]+)", text)
        return float(found[-1]) if found else None
    return None
