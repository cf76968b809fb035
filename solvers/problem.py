"""Plain-data description of one training step, the input of every solver.

Nodes are the compute operations of the forward graph in topological order.
Storages are the memory blocks those nodes create; each knows which forward
node reads it last and which nodes' backward keeps it (autograd saved it).
Nothing here imports torch: a Problem can be built by hand for any graph.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Node", "Storage", "Cast", "Problem", "Solution", "ProblemError", "ProblemArrays"]


class ProblemError(ValueError):
    """A Problem or Solution that is not well formed; the message names the field."""


@dataclass(frozen=True)
class Node:
    """One forward operation."""

    name: str
    """Unique name (the fx node name)."""
    time: float = 0.0
    """Forward compute time in seconds; recomputing the node costs this again."""
    temp_bytes: int = 0
    """Transient bytes the op allocates and frees while it runs (beyond its outputs)."""
    grad_bytes: int = 0
    """Bytes of the gradient of the node's output (0 when it needs none)."""
    backward_temp_bytes: int = 0
    """Transient bytes at the node's backward step beyond the gradients the model holds then
    (the backward's own temporaries, gradient sums, a gradient kept alive by views of it).
    Gradients do not depend on the plan, so neither does this."""
    param_grad_bytes: int = 0
    """Bytes of parameter gradients first materialised by this node's backward."""
    inputs: tuple[int, ...] = ()
    """Indices of the nodes whose outputs this node reads (data dependencies)."""
    reads: tuple[int, ...] = ()
    """Indices of the storages this node reads, directly or through views."""
    is_output: bool = False
    """The node's value is part of the graph's output."""
    recomputable: bool = True
    """False for nodes that must not run twice (side effects the rewriter cannot undo)."""
    module: str = ""
    """Module path the node belongs to ('' for the root)."""
    flops: float = 0.0
    """Floating-point operations of the forward, where known."""
    rng_state_bytes: int = 0
    """Bytes of random-generator state a recomputed region holding this node saves at its start
    and keeps until its backward (0 for nodes that draw no random numbers); a region saves the
    largest of its nodes'."""
    op: str = ""
    """What the node computes (an aten op or module type name, e.g. 'aten.mm.default'), for policies."""
    saveable: bool = False
    """A selective region may keep this node's output instead of recomputing it (the profiler sets
    it; False for in-place ops and outputs written in place later, whose cached value would be stale)."""
    saved_tensors: int = 0
    """Tensors the node's forward hands autograd to keep; inside a checkpoint region each one passes
    the region's pack and unpack hooks (`Problem.saved_overhead_s` apiece)."""
    dispatch_ops: int = 1
    """Aten ops the node's forward runs: when a selective region keeps the node, each is a call of
    the policy (`Problem.op_overhead_s` apiece, forward and recompute)."""


@dataclass(frozen=True)
class Storage:
    """A block of memory created by one node during the forward."""

    producer: int
    """Index of the node that allocates it."""
    nbytes: int
    """Size in bytes."""
    last_use: int
    """Index of the last node that reads it in the forward (>= producer)."""
    saved_by: tuple[int, ...] = ()
    """Nodes whose backward keeps it (autograd saved it for them), sorted."""
    is_output: bool = False
    """Part of the graph's output: alive for the whole step."""
    copyable: bool = True
    """A plan may offload it: it is one of its producer's outputs, where a copy can be started (False for a
    buffer an op makes inside itself and hands autograd, such as a dropout mask or attention statistics)."""


@dataclass(frozen=True)
class Cast:
    """A parameter cast to the autocast dtype that autocast keeps in its cache: made by its first reader,
    found there by the others. Its bytes are counted in `Problem.param_bytes`; `Problem.casts_cleared`
    says when it can go before the step ends."""

    nbytes: int
    """Size in bytes."""
    readers: tuple[int, ...]
    """Nodes whose forward uses it, sorted."""
    savers: tuple[int, ...] = ()
    """Readers whose backward keeps it (autograd saved it for them), sorted."""


@dataclass(frozen=True)
class Problem:
    """A training step as solvers see it: nodes, storages and the fixed memory."""

    nodes: tuple[Node, ...]
    storages: tuple[Storage, ...]
    param_bytes: int = 0
    """Parameters and buffers, resident for the whole step."""
    input_bytes: int = 0
    """Graph inputs, resident for the whole step."""
    optimizer_bytes: int = 0
    """Optimizer state, resident for the whole step (0 when no optimizer is counted)."""
    name: str = ""
    region_overhead_s: float = 0.0
    """Fixed cost of one checkpoint call over a step, forward and backward (seconds), measured."""
    op_overhead_s: float = 0.0
    """Cost of the selective-policy dispatch per op run under it (a kept node's ops; seconds)."""
    saved_overhead_s: float = 0.0
    """Cost of a checkpoint region's saved-tensor hooks per tensor saved inside it, forward, recompute
    and backward (seconds), measured."""
    step_time_s: float = 0.0
    """Measured eager step time, forward and backward, no checkpointing (seconds; 0: unknown)."""
    graph_overhead_s: float = 0.0
    """Extra seconds per step of the captured graph against the eager model, measured."""
    d2h_bytes_per_s: float = 0.0
    """Measured copy bandwidth from the device to pinned host memory (bytes per second); 0: the device
    cannot offload (the CPU), and no solver offloads."""
    h2d_bytes_per_s: float = 0.0
    """Measured copy bandwidth from pinned host memory back to the device (bytes per second); 0: no offload."""
    host_budget_bytes: int = 0
    """Pinned host bytes the offloaded tensors may hold at once; 0: none, no solver offloads."""
    d2h_fixed_s: float = 0.0
    """Seconds each offloaded storage's copy to the host costs beyond its bytes: the copy's launch latency
    plus the offload hooks' host work at pack time (`solvers.copies.d2h_seconds`), measured."""
    h2d_fixed_s: float = 0.0
    """Seconds each fetch back to the device costs beyond its bytes: the copy's latency plus the hooks'
    host work at unpack time (`solvers.copies.h2d_seconds`), measured."""
    casts: tuple[Cast, ...] = ()
    """Autocast's cached casts of parameters (their bytes are in `param_bytes`); () outside autocast."""
    casts_cleared: bool = False
    """The backward runs on a thread of its own (autograd's device thread on CUDA), where the first
    recompute leaves autocast as that thread's outermost context and so empties the cache the whole
    process shares: from there a cast lives only while a saved tensor holds it, and every later recompute
    makes the casts it uses again. False: the cache holds every cast through the step (the backward on
    the caller's thread, inside its autocast context), and the solvers' fixed bytes are exact."""
    meta: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        n = len(self.nodes)
        for i, node in enumerate(self.nodes):
            for j in node.inputs:
                if not 0 <= j < i:
                    raise ProblemError(f"nodes[{i}].inputs: {j} is not an earlier node")
            for t in node.reads:
                if not 0 <= t < len(self.storages) or self.storages[t].producer >= i:
                    raise ProblemError(f"nodes[{i}].reads: {t} is not a storage made by an earlier node")
        for s, st in enumerate(self.storages):
            if not 0 <= st.producer < n:
                raise ProblemError(f"storages[{s}].producer: {st.producer} is not a node index")
            if not st.producer <= st.last_use < n:
                raise ProblemError(f"storages[{s}].last_use: {st.last_use} outside [producer, n)")
            if st.nbytes < 0:
                raise ProblemError(f"storages[{s}].nbytes: negative")
            for k in st.saved_by:
                if not st.producer <= k < n:
                    raise ProblemError(f"storages[{s}].saved_by: {k} is not a node at or after the producer")
        for name in ("d2h_bytes_per_s", "h2d_bytes_per_s", "host_budget_bytes", "d2h_fixed_s", "h2d_fixed_s"):
            value = getattr(self, name)
            if not value >= 0 or (name in ("host_budget_bytes", "d2h_fixed_s", "h2d_fixed_s") and value == float("inf")):
                raise ProblemError(f"{name}: {value} is not a non-negative number")
        for c, cast in enumerate(self.casts):
            if cast.nbytes < 0 or not cast.readers or not all(0 <= k < n for k in cast.readers + cast.savers):
                raise ProblemError(f"casts[{c}]: negative bytes, no reader, or a reader or saver that is not a node index")
        if sum(cast.nbytes for cast in self.casts) > self.param_bytes:
            raise ProblemError("casts: more bytes than param_bytes, which counts them")

    @property
    def n(self) -> int:
        return len(self.nodes)

    @property
    def fixed_bytes(self) -> int:
        """Memory resident for the whole step: parameters, inputs, optimizer state."""
        return self.param_bytes + self.input_bytes + self.optimizer_bytes

    @property
    def total_time(self) -> float:
        return sum(node.time for node in self.nodes)

    def region_time(self, i: int) -> float:
        """Seconds node i costs when a region recomputes it: its forward plus the region's hooks on
        the tensors it saves. # seconds"""
        node = self.nodes[i]
        return node.time + self.saved_overhead_s * node.saved_tensors

    @property
    def base_step_s(self) -> float:
        """Step time of the captured graph without checkpointing: measured eager step plus the graph's
        own overhead, else three forwards (forward + a backward of about twice its cost). # seconds"""
        eager = self.step_time_s if self.step_time_s > 0 else 3.0 * self.total_time
        return eager + self.graph_overhead_s

    @property
    def can_offload(self) -> bool:
        """Both copy directions have a bandwidth and the host has room: plans may offload kept tensors."""
        return self.d2h_bytes_per_s > 0 and self.h2d_bytes_per_s > 0 and self.host_budget_bytes > 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "param_bytes": self.param_bytes,
            "input_bytes": self.input_bytes,
            "optimizer_bytes": self.optimizer_bytes,
            "region_overhead_s": self.region_overhead_s,
            "op_overhead_s": self.op_overhead_s,
            "saved_overhead_s": self.saved_overhead_s,
            "step_time_s": self.step_time_s,
            "graph_overhead_s": self.graph_overhead_s,
            "d2h_bytes_per_s": self.d2h_bytes_per_s,
            "h2d_bytes_per_s": self.h2d_bytes_per_s,
            "host_budget_bytes": self.host_budget_bytes,
            "d2h_fixed_s": self.d2h_fixed_s,
            "h2d_fixed_s": self.h2d_fixed_s,
            "casts": [asdict(cast) for cast in self.casts],
            "casts_cleared": self.casts_cleared,
            "nodes": [asdict(node) for node in self.nodes],
            "storages": [asdict(st) for st in self.storages],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Problem:
        nodes = tuple(
            Node(**{**d, "inputs": tuple(d["inputs"]), "reads": tuple(d.get("reads", ()))}) for d in data["nodes"]
        )
        storages = tuple(Storage(**{**d, "saved_by": tuple(d["saved_by"])}) for d in data["storages"])
        return cls(
            nodes=nodes,
            storages=storages,
            param_bytes=data.get("param_bytes", 0),
            input_bytes=data.get("input_bytes", 0),
            optimizer_bytes=data.get("optimizer_bytes", 0),
            name=data.get("name", ""),
            region_overhead_s=float(data.get("region_overhead_s", 0.0)),
            op_overhead_s=float(data.get("op_overhead_s", 0.0)),
            saved_overhead_s=float(data.get("saved_overhead_s", 0.0)),
            step_time_s=float(data.get("step_time_s", 0.0)),
            graph_overhead_s=float(data.get("graph_overhead_s", 0.0)),
            # absent from problems saved before offloading existed: they cannot offload
            d2h_bytes_per_s=float(data.get("d2h_bytes_per_s", 0.0)),
            h2d_bytes_per_s=float(data.get("h2d_bytes_per_s", 0.0)),
            host_budget_bytes=int(data.get("host_budget_bytes", 0)),
            # absent from problems saved before copies had a fixed cost: priced at their bytes alone
            d2h_fixed_s=float(data.get("d2h_fixed_s", 0.0)),
            h2d_fixed_s=float(data.get("h2d_fixed_s", 0.0)),
            casts=tuple(
                Cast(nbytes=int(d["nbytes"]), readers=tuple(d["readers"]), savers=tuple(d.get("savers", ())))
                for d in data.get("casts", ())
            ),
            casts_cleared=bool(data.get("casts_cleared", False)),
        )

    def fingerprint(self) -> str:
        """Hash of the graph's structure and sizes (not of the measured times)."""
        shape = [
            [node.name, list(node.inputs), list(node.reads), node.grad_bytes] for node in self.nodes
        ] + [[st.producer, st.nbytes, st.last_use, list(st.saved_by), st.is_output] for st in self.storages]
        return hashlib.sha256(json.dumps(shape).encode()).hexdigest()[:16]

    def users(self) -> list[list[int]]:
        """users[i]: the nodes that read node i's output, ascending."""
        out: list[list[int]] = [[] for _ in self.nodes]
        for i, node in enumerate(self.nodes):
            for j in node.inputs:
                out[j].append(i)
        return out

    def cut_bytes(self) -> list[int]:
        """cut_bytes[i]: bytes of storages produced at or before i and read after i.

        This is what a segment boundary between node i and i + 1 has to keep.
        """
        delta = [0] * (self.n + 1)
        for st in self.storages:
            end = self.n if st.is_output else st.last_use
            if end > st.producer:
                delta[st.producer] += st.nbytes
                delta[end] -= st.nbytes
        out, acc = [], 0
        for i in range(self.n):
            acc += delta[i]
            out.append(acc)
        return out

    def cut_counts(self) -> list[int]:
        """cut_counts[i]: how many storages cross the boundary after node i."""
        delta = [0] * (self.n + 1)
        for st in self.storages:
            end = self.n if st.is_output else st.last_use
            if end > st.producer and st.nbytes > 0:
                delta[st.producer] += 1
                delta[end] -= 1
        out, acc = [], 0
        for i in range(self.n):
            acc += delta[i]
            out.append(acc)
        return out

    def articulation_points(self) -> list[int]:
        """Positions i after which at most one activation storage is live: cheap cuts."""
        return [i for i, c in enumerate(self.cut_counts()) if c <= 1]

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "arrays"}  # derived: rebuilt on first use

    @functools.cached_property
    def arrays(self) -> ProblemArrays:
        """The problem as the arrays `simulate` sweeps over; built on first use, then kept (the Problem is
        frozen, so they never go stale)."""
        return ProblemArrays(self)


class ProblemArrays:
    """What `simulate` reads of a Problem that no plan changes, as numpy arrays. # bytes int64; indices int64"""

    def __init__(self, problem: Problem) -> None:
        import numpy as np  # a dependency of the package; imported here so that plain data needs none

        nodes, storages = problem.nodes, problem.storages
        n, m = len(nodes), len(storages)
        i64 = np.int64
        self.n, self.m = n, m
        self.producer = np.array([st.producer for st in storages], dtype=i64)
        self.nbytes = np.array([st.nbytes for st in storages], dtype=i64)
        self.last_use = np.array([st.last_use for st in storages], dtype=i64)
        self.is_output = np.array([st.is_output for st in storages], dtype=bool)
        self.by_producer = np.argsort(self.producer, kind="stable")  # storages in node order
        self.producer_ptr = np.searchsorted(self.producer[self.by_producer], np.arange(n + 1))
        pairs = [(t, k) for t, st in enumerate(storages) for k in st.saved_by]
        self.saved_t = np.array([t for t, _ in pairs], dtype=i64)  # storage t is saved by node saved_k
        self.saved_k = np.array([k for _, k in pairs], dtype=i64)
        self.read_ptr = np.cumsum([0] + [len(node.reads) for node in nodes], dtype=i64)  # node i reads read_t[ptr[i]:ptr[i+1]]
        self.read_t = np.array([t for node in nodes for t in node.reads], dtype=i64)
        self.read_producer = self.producer[self.read_t]
        saves = np.zeros(n, dtype=bool)
        saves[self.saved_k] = True
        self.savers = np.flatnonzero(saves)
        self.prev_saver = np.maximum.accumulate(np.where(saves, np.arange(n), -1)) if n else np.zeros(0, dtype=i64)
        """prev_saver[i]: the last node at or before i whose backward keeps something (-1: none)."""
        packs = saves | np.array([node.saved_tensors > 0 for node in nodes], dtype=bool)
        self.prev_packer = np.maximum.accumulate(np.where(packs, np.arange(n), -1)) if n else np.zeros(0, dtype=i64)
        """prev_packer[i]: the last node at or before i that hands autograd any tensor to keep, a parameter or a
        buffer included (-1: none). A checkpoint region with no such node keeps no inputs (simulate.replay)."""
        self.saveable = np.array([node.saveable for node in nodes], dtype=bool)
        self.temp = np.array([node.temp_bytes for node in nodes], dtype=i64)
        self.backward_temp = np.array([node.backward_temp_bytes for node in nodes], dtype=i64)
        self.rng = np.array([node.rng_state_bytes for node in nodes], dtype=i64)
        param = np.array([node.param_grad_bytes for node in nodes], dtype=i64)
        self.param_grad_nodes = np.flatnonzero(param > 0)
        self.param_grad_bytes = param[self.param_grad_nodes]
        last_consumer = np.full(n, -1, dtype=i64)
        for i, node in enumerate(nodes):
            last_consumer[list(node.inputs)] = i
        grad = np.array([node.grad_bytes for node in nodes], dtype=i64)
        self.grad_nodes = np.flatnonzero((grad > 0) & (last_consumer > np.arange(n)))
        self.grad_consumer = last_consumer[self.grad_nodes]  # the gradient appears at its last consumer's backward
        self.grad_bytes = grad[self.grad_nodes]
        # A backward step may hold less than the replay counts by at most its own output's gradient (bytes):
        # one passed on unchanged (a residual add's) is counted again as its inputs' (profile/backward.py).
        own = np.zeros(n, dtype=i64)
        own[self.grad_nodes] = self.grad_bytes
        self.nonnegative = not any((a < 0).any() for a in (self.temp, self.rng, param, grad)) and not (
            self.backward_temp + own < 0).any()
        """No size is negative beyond that: the condition under which the sweep equals the event-by-event replay."""
        self.cast_bytes = np.array([cast.nbytes for cast in problem.casts], dtype=i64)
        for kind in ("readers", "savers"):  # (node, cast) pairs in node order: node k reads or saves cast c
            pairs = sorted({(k, c) for c, cast in enumerate(problem.casts) for k in getattr(cast, kind)})
            setattr(self, f"cast_{kind}", np.array(pairs, dtype=i64).reshape(-1, 2))
        self.times = [node.time for node in nodes]  # seconds, kept as Python floats to sum as the replay does
        self.hook_prefix = [0, *itertools.accumulate(node.saved_tensors for node in nodes)]
        """Tensors saved by the nodes before i (exact integers)."""
        self.unrecomputable = [0, *itertools.accumulate(int(not node.recomputable) for node in nodes)]
        """Nodes before i that must not run twice."""
        self.layouts: dict[tuple[tuple[int, int], ...], Any] = {}
        """The simulator's layouts of the last few region plans (`figures.layout_of`), most recent last."""
        self.recompute_prefix: list[float] | None = None
        """`costs.recompute_time`'s running sum of recompute seconds with no node kept, once it is made."""


@dataclass(frozen=True)
class Solution:
    """Recomputed regions and the figures the simulator predicts for them.

    `regions` are inclusive (start, end) node-index ranges, sorted by start and
    then by decreasing length, each either disjoint from or nested inside the
    ones before it. `saved` are nodes inside regions whose outputs are kept
    (a selective region: its other ops are recomputed), ascending. `offloaded`
    are storages the plan keeps from the forward to the backward that it copies
    to pinned host memory in between (`solvers.copies`), ascending.
    """

    regions: tuple[tuple[int, int], ...]
    solver: str
    peak_bytes: int
    recompute_time: float
    """Predicted extra seconds per step: forward work re-run plus checkpoint-call and policy costs, plus
    the copy time offloads do not hide behind compute."""
    budget_bytes: int | None = None
    solve_time: float = 0.0
    stats: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    saved: tuple[int, ...] = ()
    offloaded: tuple[int, ...] = ()
    """Indices into `problem.storages` that the plan offloads, ascending; each one offloadable under the
    plan (`copies.offloadable`), which `simulate` checks (ProblemError naming `offloaded`)."""

    @property
    def feasible(self) -> bool:
        return self.budget_bytes is None or self.peak_bytes <= self.budget_bytes
