"""The cost graph: a frozen, typed record of what profiling measured, and its solvers.Problem."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import networkx as nx

from ..lower.offload import STORAGE_OUTPUTS
from ..solvers.problem import Cast, Node, Problem, Storage

__all__ = ["NodeCost", "StorageCost", "CostGraph"]


@dataclass(frozen=True)
class NodeCost:
    """One compute node of the captured graph and its measured costs."""

    name: str
    op: str
    """fx op: call_function, call_method or call_module."""
    target: str
    module: str
    """Module path the node belongs to ('' for the root)."""
    time: float
    """Forward seconds (median of timed runs, or a FLOP/bandwidth estimate in meta mode)."""
    flops: float
    out_bytes: int
    """Bytes of new storages in the node's output (views add none)."""
    temp_bytes: int
    """Transient bytes while the node runs, beyond what it leaves allocated."""
    grad_bytes: int
    """Bytes of the gradient of the node's new outputs."""
    inputs: tuple[int, ...]
    reads: tuple[int, ...]
    """Storage indices the node reads."""
    recomputable: bool
    shapes: list = field(default_factory=list, compare=False, hash=False)
    dtype: str = ""
    is_output: bool = False
    param_grad_bytes: int = 0
    """Bytes of parameter gradients made first by this node's backward."""
    backward_temp_bytes: int = 0
    """Bytes the node's backward step holds beyond the modelled gradients (measured)."""
    rng_state_bytes: int = 0
    """Bytes of generator state a recomputed region holding this node saves (0: draws no random numbers)."""
    kind: str = ""
    """What it computes, for selective policies: the aten op, function, method or module class name."""
    saveable: bool = False
    """A selective region may keep its output (see selective.saveable_flags)."""
    saved_tensors: int = 0
    """Tensors its forward hands autograd to keep (each passes a checkpoint region's hooks)."""
    dispatch_ops: int = 1
    """Aten ops its forward runs (each a call of a selective region's policy)."""
    time_min: float = field(default=0.0, compare=False)
    """Its fastest timed run (seconds; 0 when not timed). Against `time`, how far its runs disagreed."""
    time_estimated: bool = False
    """`time` is the FLOP/bytes estimate: its timed runs disagreed (timing.anchor_times)."""


@dataclass(frozen=True)
class StorageCost:
    producer: int
    nbytes: int
    last_use: int
    saved_by: tuple[int, ...]
    is_output: bool
    output: int = -1
    """Which of the producer's output tensors holds it (position among its strided outputs); -1: made
    and saved inside the op (a dropout mask), no output of the graph's to find it by."""
    written: bool = False
    """A later node of the forward writes into it in place (an `inplace=True` ReLU after a BatchNorm): a
    copy made when its producer ran would hold a stale value, so it is never offloaded."""


@dataclass(frozen=True)
class CostGraph:
    """Per-node costs of one training step of a captured graph."""

    nodes: tuple[NodeCost, ...]
    storages: tuple[StorageCost, ...]
    param_bytes: int
    """Parameters and buffers (bytes), resident for the whole step; under autocast, with the casts of
    parameters its cache keeps (profile/record.py AutocastCasts)."""
    input_bytes: int
    time_source: str
    """'measured' (timed runs), 'fitted' (a model fitted to timed runs) or 'flops' (meta mode estimate)."""
    device: str
    region_overhead_s: float = 0.0
    """Fixed cost of one checkpoint call over a step (seconds), measured on the device."""
    op_overhead_s: float = 0.0
    """Selective-policy dispatch per op run under it (a kept node's ops; seconds), measured."""
    saved_overhead_s: float = 0.0
    """A checkpoint region's hooks per tensor saved inside it, over a step (seconds), measured."""
    step_time_s: float = 0.0
    """Eager step time without checkpointing (seconds; 0 when not measured)."""
    graph_overhead_s: float = 0.0
    """Extra step time of the captured graph against the eager model (seconds)."""
    recompute_scale: float = 1.0
    """The factor node times were scaled by so that a recompute costs what it does in a real step
    (choose/race/calibration.py with_step_times); 1.0 when not calibrated."""
    casts: tuple[Cast, ...] = ()
    """Autocast's cached casts of parameters (in `param_bytes`), with the nodes that read and save each."""
    casts_cleared: bool = False
    """The backward runs on autograd's device thread (CUDA), whose first recompute empties autocast's cache:
    see `solvers.Problem.casts_cleared`."""
    stages: tuple[tuple[int, int], ...] = ()
    """Node spans profiled one at a time on real tensors (profile/stagewise.py): the plain step was never
    run, so whatever runs the model after profiling compares with the step checkpointed per block.
    Empty when the step was profiled whole (or on fake tensors alone)."""
    notes: tuple[str, ...] = ()
    """What the plan's notes should say about how the profile took its figures (sizes that depend on values:
    profile/dynamic_shapes.py)."""

    @property
    def saved_bytes(self) -> list[int]:
        """Per node: bytes of the storages it made that autograd keeps for backward."""
        out = [0] * len(self.nodes)
        for st in self.storages:
            if st.saved_by:
                out[st.producer] += st.nbytes
        return out

    @property
    def total_saved_bytes(self) -> int:
        """All activation bytes autograd saves for backward, each storage counted once."""
        return sum(st.nbytes for st in self.storages if st.saved_by)

    @property
    def total_time(self) -> float:
        return sum(n.time for n in self.nodes)

    @property
    def param_grad_bytes(self) -> int:
        return sum(n.param_grad_bytes for n in self.nodes)

    def to_problem(self, *, optimizer_bytes: int = 0, name: str = "", d2h_bytes_per_s: float = 0.0,
                   h2d_bytes_per_s: float = 0.0, host_budget_bytes: int = 0) -> Problem:
        """The solvers' input. The copy bandwidths (bytes/s; 0: the device cannot offload) and the pinned host
        bytes offloaded tensors may hold are the device's and the caller's (profile/copy_bandwidth.py)."""
        nodes = tuple(
            Node(
                name=n.name,
                time=n.time,
                temp_bytes=n.temp_bytes,
                grad_bytes=n.grad_bytes,
                param_grad_bytes=n.param_grad_bytes,
                backward_temp_bytes=n.backward_temp_bytes,
                inputs=n.inputs,
                reads=n.reads,
                is_output=n.is_output,
                recomputable=n.recomputable,
                module=n.module,
                flops=n.flops,
                rng_state_bytes=n.rng_state_bytes,
                op=n.kind or n.target,
                saveable=n.saveable,
                saved_tensors=n.saved_tensors,
                dispatch_ops=n.dispatch_ops,
            )
            for n in self.nodes
        )
        storages = tuple(
            Storage(producer=s.producer, nbytes=s.nbytes, last_use=s.last_use, saved_by=s.saved_by, is_output=s.is_output,
                    copyable=s.output >= 0 and not s.written)
            for s in self.storages
        )
        offload = {"d2h_bytes_per_s": float(d2h_bytes_per_s), "h2d_bytes_per_s": float(h2d_bytes_per_s),
                   "host_budget_bytes": int(host_budget_bytes)}
        return Problem(
            nodes=nodes,
            storages=storages,
            param_bytes=self.param_bytes,
            input_bytes=self.input_bytes,
            optimizer_bytes=optimizer_bytes,
            name=name,
            region_overhead_s=self.region_overhead_s,
            op_overhead_s=self.op_overhead_s,
            saved_overhead_s=self.saved_overhead_s,
            step_time_s=self.step_time_s,
            graph_overhead_s=self.graph_overhead_s,
            casts=self.casts,
            casts_cleared=self.casts_cleared,
            # where each storage is found again as a node output when a plan offloads it (lower/offload.py)
            meta={STORAGE_OUTPUTS: tuple((self.nodes[s.producer].name, s.output) for s in self.storages)},
            **offload,
        )

    def fingerprint(self) -> str:
        """Structure and sizes of the graph (not the times): equal for the same model and shapes."""
        return self.to_problem().fingerprint()

    def digraph(self) -> nx.DiGraph:
        g = nx.DiGraph()
        for i, n in enumerate(self.nodes):
            g.add_node(i, name=n.name)
            for j in n.inputs:
                g.add_edge(j, i)
        return g

    def cut_bytes(self) -> list[int]:
        """Bytes live across the boundary after each node (see solvers.Problem.cut_bytes)."""
        return self.to_problem().cut_bytes()

    def articulation_points(self) -> list[int]:
        return self.to_problem().articulation_points()

    def to_dict(self) -> dict[str, Any]:
        return {
            "time_source": self.time_source,
            "device": self.device,
            "region_overhead_s": self.region_overhead_s,
            "op_overhead_s": self.op_overhead_s,
            "saved_overhead_s": self.saved_overhead_s,
            "step_time_s": self.step_time_s,
            "graph_overhead_s": self.graph_overhead_s,
            "recompute_scale": self.recompute_scale,
            "stages": [list(s) for s in self.stages],
            "param_bytes": self.param_bytes,
            "input_bytes": self.input_bytes,
            "casts": [asdict(c) for c in self.casts],
            "casts_cleared": self.casts_cleared,
            "nodes": [asdict(n) for n in self.nodes],
            "storages": [asdict(s) for s in self.storages],
        }

    def table(self) -> list[dict[str, Any]]:
        """One row per node for printing: name, op, module, saved/out bytes, time, FLOPs."""
        saved = self.saved_bytes
        return [
            {
                "node": n.name,
                "target": n.target,
                "module": n.module,
                "saved_bytes": saved[i],
                "out_bytes": n.out_bytes,
                "time_s": n.time,
                "flops": n.flops,
            }
            for i, n in enumerate(self.nodes)
        ]
