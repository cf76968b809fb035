"""The knapsack lowering of a compiled plan: our own solver inside torch.compile's partitioner.

The region lowering (compiled.py) recomputes whole checkpoint regions. This one compiles the model
without regions and lets the AOT partitioner recompute single ops, chosen by our knapsack:
`KnapsackSolver` is a `torch._inductor.custom_graph_pass.CustomKnapsackSolver`, set through
`torch._functorch.config.patch(activation_memory_budget=..., activation_memory_budget_solver=solver)`
around inductor (`inductor_backend`). The partitioner hands it the joint-graph nodes it may recompute
(`all_recomputable_banned_nodes`) with sizes normalised to its own units, and no runtimes. We price
each candidate's recompute with our own cost model (FLOPs from torch's FLOP formulas on the node's
`meta["val"]` shapes, and the bytes it reads and writes, on the roofline our FLOP-based profile uses)
and keep, exactly (a 0/1 MILP, HiGHS else CBC), the set of candidates that saves the most recompute
time within a *byte* target; the partitioner recomputes the rest where its min-cut finds it cheaper.

The target is bytes of candidates kept saved, not the fraction compile's knob takes: the fraction
given to the partitioner is only small enough that it always asks the solver. `KnapsackLowering`
searches targets for a peak budget: it compiles and measures one step per target (through the
callback it is given), from "keep every candidate" down (tighter while over the budget, looser while
well under, bisecting between), and knows each target's choice before compiling it (the candidates do
not depend on the target), so a target that would give a graph already measured is not compiled. It stops
when a tighter choice measures no lower than a looser one: from there inductor's buffers set the peak.

Random draws are never recomputed. Compile's partitioner counts dropout among the ops a memory budget lets it
recompute, and outside checkpoint regions nothing replays the forward's random state in the backward: a
recomputed dropout (or `bernoulli`, or an attention with `dropout_p`; with inductor's `fallback_random`
these stay aten ops) draws a second mask, and the gradient is not the forward's. `KeepRandomDraws`, a
joint-graph pass run before the partitioner, marks every node that draws random numbers must-save, so
it is neither a candidate nor recomputed; what follows it (a mask's compare, its scaling) may be, from
the saved draw. Without `fallback_random` inductor draws from a seed node, which is the one marked, and
the masks are recomputed from the saved seed.
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._inductor.custom_graph_pass import (
    CustomGraphPass,
    CustomKnapsackSolver,
    get_custom_graph_passes,
    get_hash_for_files,
)
from torch.utils import _pytree as pytree

from ..errors import InputError
from ..profile.profiler import ProfileConfig, _roofline
from ..profile.record import flop_formulas

__all__ = ["Candidate", "KeepRandomDraws", "KnapsackLowering", "KnapsackSolver", "KnapsackTry", "draws_random",
           "inductor_backend", "remembered", "solve_knapsack"]

PARTITIONER_FRACTION = 1e-4
"""activation_memory_budget given to the partitioner: below every set it can reach without the
solver, so that the solver always decides (our byte target, not this fraction, bounds the saving)."""


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One joint-graph node the partitioner may recompute."""

    name: str
    op: str
    nbytes: int  # bytes of its output, saved for backward unless recomputed
    seconds: float  # estimated time of one recompute (roofline of FLOPs and bytes moved)


def _tensor_bytes(x: Any) -> int:
    return x.numel() * x.element_size() if isinstance(x, torch.Tensor) else 0


def estimate_candidate(node: torch.fx.Node, config: ProfileConfig) -> Candidate:
    """Our recompute cost of one joint-graph node, from its shapes alone (nothing runs)."""
    from torch._functorch.partitioners import _size_of

    def val(x: Any) -> Any:
        return x.meta.get("val") if isinstance(x, torch.fx.Node) else x

    args, kwargs = pytree.tree_map(val, (node.args, node.kwargs))
    out = node.meta.get("val")
    flops = 0
    target = node.target
    formula = flop_formulas().get(getattr(target, "overloadpacket", None))
    if formula is not None:
        try:
            flops = int(formula(*args, **kwargs, out_val=out))
        except Exception:  # noqa: BLE001 - a formula that cannot read these shapes: priced by bytes alone
            flops = 0
    moved = sum(_tensor_bytes(t) for t in pytree.tree_leaves((args, kwargs, out)))
    device = next((t.device.type for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)), "cpu")
    return Candidate(node.name, str(target), int(_size_of(node)), _roofline(flops, moved, device, config))


def solve_knapsack(sizes: Sequence[int], values: Sequence[float], capacity: int, *, backend: str = "auto") -> frozenset[int]:
    """Indices of the items to keep: the most total value with total size <= capacity (exact 0/1 knapsack).

    Sizes are bytes (integers), values seconds. Solved as a MILP (HiGHS in-process when installed, else
    pulp's CBC, the other one if the first fails); the result is checked in integers.
    """
    from ..solvers.exact.milp_backend import ILPSolveError, _backend, _backends, native_stdout_dropped

    if len(sizes) != len(values):
        raise InputError(f"knapsack: {len(sizes)} sizes but {len(values)} values; give one of each per item")
    if any(s < 0 for s in sizes) or capacity < 0:
        raise InputError("knapsack: sizes and capacity must be >= 0 bytes")
    free = {i for i, s in enumerate(sizes) if s == 0}
    items = [i for i, s in enumerate(sizes) if 0 < s <= capacity and values[i] > 0]
    if sum(sizes[i] for i in items) <= capacity:
        return frozenset(free | set(items))
    import pulp

    vunit = max(values[i] for i in items)
    failures: list[str] = []
    for name in _backends(backend):
        prob = pulp.LpProblem("knapsack", pulp.LpMaximize)
        make = getattr(prob, "add_variable", None)  # pulp >= 3.3; LpVariable(...) directly is deprecated there
        x = {i: make(f"x{i}", 0, 1, cat="Binary") if make else pulp.LpVariable(f"x{i}", cat="Binary") for i in items}
        prob += pulp.lpSum(values[i] / vunit * x[i] for i in items)
        prob += pulp.lpSum(sizes[i] / capacity * x[i] for i in items) <= 1
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            _, solver = _backend(name, None, 0.0, "/dev/null", False)
            try:
                with native_stdout_dropped():
                    prob.solve(solver)
            except Exception as e:  # noqa: BLE001 - the other backend is tried
                failures.append(f"{name}: {type(e).__name__}: {str(e).strip()[:200]}")
                continue
        if prob.sol_status != pulp.LpSolutionOptimal:
            failures.append(f"{name}: status {pulp.LpStatus[prob.status]!r}")
            continue
        kept = sorted((i for i in items if (x[i].value() or 0) > 0.5), key=lambda i: values[i] / sizes[i])
        while sum(sizes[i] for i in kept) > capacity:  # the solver's tolerance let it over by a few bytes
            kept.pop(0)
        return frozenset(free | set(kept))
    raise ILPSolveError("knapsack: MILP backend failed (" + "; ".join(failures) + ")")


@dataclasses.dataclass(frozen=True)
class KnapsackCall:
    """What one call of the partitioner asked and what the solver kept."""

    candidates: tuple[Candidate, ...]
    kept: frozenset[int]

    @property
    def saved_bytes(self) -> int:
        return sum(self.candidates[i].nbytes for i in self.kept)

    @property
    def recompute_s(self) -> float:
        return sum(c.seconds for i, c in enumerate(self.candidates) if i not in self.kept)


class KnapsackSolver(CustomKnapsackSolver):
    """Keeps saved the candidates worth the most recompute time within `target_bytes`; the partitioner
    may recompute the others. `calls` records each call (one per compiled graph)."""

    def __init__(self, target_bytes: int, *, config: ProfileConfig | None = None, backend: str = "auto") -> None:
        if int(target_bytes) != target_bytes or target_bytes < 0:
            raise InputError(f"knapsack target_bytes: {target_bytes!r} must be a whole number of bytes >= 0")
        self.target_bytes = int(target_bytes)
        self.config = ProfileConfig.or_default(config)
        self.backend = backend
        self.calls: list[KnapsackCall] = []
        self.keep_random = KeepRandomDraws()
        """The pass `inductor_backend` runs with this solver: what it marked is what the solver never sees."""

    def __call__(self, memory: list[float], joint_graph: torch.fx.Graph, max_memory: float, node_info: Any,
                 all_recomputable_banned_nodes: list[torch.fx.Node]) -> tuple[list[int], list[int]]:
        cands = tuple(estimate_candidate(n, self.config) for n in all_recomputable_banned_nodes)
        kept = solve_knapsack([c.nbytes for c in cands], [c.seconds for c in cands], self.target_bytes,
                              backend=self.backend)
        self.calls.append(KnapsackCall(cands, kept))
        return sorted(kept), [i for i in range(len(cands)) if i not in kept]

    def uuid(self) -> Any:
        """Changes with the code, the target and the cost model: a compiled graph is reused only for the same choice."""
        c = self.config
        return (get_hash_for_files((__file__,)), self.target_bytes, c.peak_flops, c.bandwidth)


_NO_DRAW_IF_ZERO = ("dropout_p", "p")
"""Arguments that, at 0, make a seeded op draw nothing (an attention with `dropout_p=0.0`, `bernoulli(p=0)`)."""


def draws_random(node: torch.fx.Node) -> bool:
    """Whether a joint-graph node draws random numbers (torch tags such ops `nondeterministic_seeded`): run
    again in the backward, it would draw again."""
    target = node.target
    if node.op != "call_function" or torch.Tag.nondeterministic_seeded not in getattr(target, "tags", ()):
        return False
    schema = getattr(target, "_schema", None)
    args = schema.arguments if schema is not None else ()
    bound = {a.name: a.default_value for a in args if a.has_default_value()}  # an argument left out is its default
    bound.update(zip((a.name for a in args), node.args))
    bound.update(node.kwargs)
    return not any(isinstance(bound.get(k), (int, float)) and bound[k] == 0 for k in _NO_DRAW_IF_ZERO)


class KeepRandomDraws(CustomGraphPass):
    """A joint-graph pass (inductor's `joint_custom_post_pass`, run before the partitioner): every node that
    draws random numbers is marked must-save, which bans its recompute; `marked` names them, per graph."""

    def __init__(self) -> None:
        self.marked: list[list[str]] = []

    def __call__(self, graph: torch.fx.Graph) -> None:
        from torch.utils.checkpoint import CheckpointPolicy

        names = []
        for node in graph.nodes:
            # a checkpoint region's draws are the partitioner's own to replay (it saves their random state)
            if draws_random(node) and node.meta.get("recompute") not in (CheckpointPolicy.MUST_RECOMPUTE,
                                                                         CheckpointPolicy.PREFER_RECOMPUTE):
                node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
                names.append(node.name)
        self.marked.append(names)

    def uuid(self) -> Any:
        return get_hash_for_files((__file__,))


_REMEMBERED: weakref.WeakKeyDictionary[torch.nn.Module, dict[Any, dict[int, int]]] = weakref.WeakKeyDictionary()


def remembered(model: torch.nn.Module, capture: Any, options: dict[str, Any], extra_bytes: int,
               config: ProfileConfig | None) -> dict[int, int]:
    """This process's {target bytes: measured peak} for `model` compiled from `capture` (its graph and inputs)
    with these options, resident extra bytes and cost model, under inductor's `fallback_random` (aten's dropout
    or inductor's own); kept while the model lives. A target gives the same choice each time (the candidates
    and our costs do not change), so the same graph and the same peak."""
    import torch._inductor.config as inductor_config

    c = ProfileConfig.or_default(config)
    shapes = tuple((tuple(t.shape), t.dtype) for t in pytree.tree_leaves((capture.args, capture.kwargs))
                   if isinstance(t, torch.Tensor))
    key = (capture.graph_module.code, shapes, repr(sorted(options.items())), extra_bytes, c.peak_flops,
           c.bandwidth, inductor_config.fallback_random)
    return _REMEMBERED.setdefault(model, {}).setdefault(key, {})


def inductor_backend(solver: KnapsackSolver, options: dict[str, Any] | None = None) -> Callable:
    """A torch.compile backend: inductor with `solver` deciding what the partitioner recomputes, and no
    random draw recomputed (`KeepRandomDraws`, after any joint-graph pass `options` names).

    The AOT autograd cache is off inside, so that the solver runs (and reports its candidates) on every
    compile; inductor's own cache still keys on `solver.uuid()`.
    """
    import torch._functorch.config as fconfig
    from torch._inductor.compile_fx import compile_fx

    patches = dict(options or {})
    patches["joint_custom_post_pass"] = (*get_custom_graph_passes(patches.get("joint_custom_post_pass")),
                                         solver.keep_random)

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        with fconfig.patch(activation_memory_budget=PARTITIONER_FRACTION, activation_memory_budget_solver=solver,
                           enable_autograd_cache=False):
            return compile_fx(gm, example_inputs, config_patches=patches)

    return backend


@dataclasses.dataclass
class KnapsackTry:
    """One compiled and measured target."""

    target_bytes: int
    saved_bytes: int  # candidate bytes the choice keeps
    recompute_s: float  # estimated recompute time of the choice
    measured: int  # measured peak of the compiled step, bytes
    module: Any
    compile_s: float


class KnapsackLowering:
    """Byte targets searched for a peak budget; `compile_measure(solver) -> (module, measured, seconds)`
    compiles the model with `solver` and measures one step. Tries are kept across budgets (a sweep)."""

    def __init__(self, compile_measure: Callable[[KnapsackSolver], tuple[Any, int, float]], *,
                 config: ProfileConfig | None = None, backend: str = "auto", max_tries: int = 5,
                 slack: float = 0.05, memory: dict[int, int] | None = None) -> None:
        self.compile_measure = compile_measure
        self.config = ProfileConfig.or_default(config)
        self.backend = backend
        self.max_tries = max_tries
        self.slack = slack
        self.candidates: tuple[Candidate, ...] | None = None
        self.tries: dict[frozenset[int] | None, KnapsackTry] = {}
        self.memory = memory if memory is not None else {}
        """{target bytes: measured peak} of earlier searches on the same graph (`remembered`): a budget that a
        refusal named (the least peak measured) is met by compiling that target again, not by a new search."""

    @property
    def total_bytes(self) -> int:
        return sum(c.nbytes for c in self.candidates or ())

    def choice(self, target: int) -> frozenset[int] | None:
        """The candidates kept at `target` (None until a compile has shown the candidates)."""
        if self.candidates is None:
            return None
        c = self.candidates
        return solve_knapsack([x.nbytes for x in c], [x.seconds for x in c], target, backend=self.backend)

    def _try(self, target: int) -> KnapsackTry:
        key = self.choice(target)
        if key is not None and key in self.tries:
            return self.tries[key]
        solver = KnapsackSolver(target, config=self.config, backend=self.backend)
        module, measured, seconds = self.compile_measure(solver)
        call = solver.calls[0] if solver.calls else None
        if call is not None and self.candidates is None:
            self.candidates = call.candidates
            key = call.kept
        saved = call.saved_bytes if call is not None else 0
        self.memory[target] = measured
        got = KnapsackTry(target, saved, call.recompute_s if call is not None else 0.0, measured, module, seconds)
        self.tries[key if call is not None else None] = got
        return got

    def _new_target(self, lo: KnapsackTry | None, hi: KnapsackTry | None, budget: int) -> int | None:
        """A target between the best fitting try and the least over one whose choice is not yet tried."""
        lo_s = lo.saved_bytes if lo is not None else -1
        hi_s = hi.saved_bytes if hi is not None else self.total_bytes + 1
        if lo is not None and hi is not None:  # secant on saved bytes -> measured peak
            slope = max(1e-9, (hi.measured - lo.measured) / max(1, hi.saved_bytes - lo.saved_bytes))
            guess = lo.saved_bytes + int((budget - lo.measured) / slope)
        elif hi is not None:  # bytes kept saved count one for one at the peak (at least)
            guess = hi.saved_bytes - (hi.measured - budget) - (hi.measured - budget) // 10
        else:
            guess = lo.saved_bytes + (budget - lo.measured)
        for _ in range(24):  # offline: each step is a knapsack solve, no compile
            guess = min(max(guess, lo_s + 1), hi_s - 1)
            if guess < 0 or guess <= lo_s:
                return None
            key = self.choice(guess)
            if key is not None and key not in self.tries:
                return guess
            guess = (guess + hi_s) // 2 if guess + 1 < hi_s else hi_s  # that choice is tried: look higher
        return None

    def fit(self, budget: int, fixed: int) -> tuple[KnapsackTry | None, list[dict[str, Any]]]:
        """The fitting try that keeps the most candidate bytes (least estimated recompute), and the tries
        made for this budget; None when none fits within `max_tries` compiles."""
        log: list[dict[str, Any]] = []
        for _ in range(self.max_tries + 1):
            known = list(self.tries.values())
            fits = [t for t in known if t.measured <= budget]
            lo = max(fits, key=lambda t: (t.saved_bytes, -t.measured), default=None)
            over = [t for t in known if t.measured > budget and (lo is None or t.saved_bytes > lo.saved_bytes)]
            hi = min(over, key=lambda t: t.saved_bytes, default=None)
            if not known:
                fitted = [t for t, m in self.memory.items() if m <= budget]  # the loosest remembered fit, if any
                target = max(fitted) if fitted else self.total_bytes if self.candidates is not None else 2**62
            elif self.candidates is None or len(log) >= self.max_tries:
                break
            elif lo is not None and (hi is None and lo.saved_bytes >= self.total_bytes
                                     or lo.measured >= budget - self.slack * (budget - fixed)):
                break  # fits with everything kept, or close enough to the budget
            else:
                target = self._new_target(lo, hi, budget)
                if target is None:
                    break
            t = self._try(target)
            log.append({"target_bytes": target, "saved_bytes": t.saved_bytes, "measured_peak_bytes": t.measured,
                        "estimated_recompute_s": t.recompute_s, "looser": bool(log) and target > log[-1]["target_bytes"]})
            if t.measured > budget and any(o.saved_bytes > t.saved_bytes and o.measured <= t.measured
                                           for o in self.tries.values()):
                # Keeping fewer bytes saved did not lower the peak: past this point inductor's own buffers, not
                # the saved activations, set it (a tiny Llama: 577 kB saved measured 1.580 MB, 529 kB 1.598 MB,
                # 464 kB 1.631 MB). Each further try is a compile of minutes on a CPU that cannot help.
                log[-1]["stopped"] = "the peak stopped falling as fewer bytes were kept"
                break
        fits = [t for t in self.tries.values() if t.measured <= budget]
        best = max(fits, key=lambda t: (t.saved_bytes, -t.measured), default=None)
        return best, log

