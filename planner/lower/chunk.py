"""Chunked token-wise regions: a group of token-wise nodes (capture/tokenwise.py) run k chunks at a time.

The group becomes one `ChunkedCall` node. It splits each chunked input along the axis into k pieces
and runs the group's subgraph on each piece under `torch.utils.checkpoint` (non-reentrant): after the
forward only the pieces (views of the inputs) are kept, and the backward recomputes one chunk at a time,
so the step holds one chunk's intermediates instead of the whole group's. Outputs are concatenated; a
cross-entropy with mean (or sum) reduction is computed per chunk as a sum over its tokens and divided by
the number of tokens whose target is not `ignore_index`, as the model's loss is.

The weight gradients are then sums over chunks: equal to the model's up to the order of summation,
which is why chunking is only planned with `optimize(..., exact=False)`. Each chunk's backward would make
a whole gradient of every weight its linears read and add it to the others', so the step would hold two
of them at once (a Llama's LM head: two vocabulary x width matrices, 2 GB at Llama-3-8B's in float32).
The chunks' linears therefore add their weight gradient into one buffer in place (`_LinearInto`), which
becomes the weight's gradient once every chunk is done (`_GradFrom`).
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import checkpoint

from ..capture.tokenwise import TokenGroup, axis_lengths, find_tokenwise, hint, view_sizes

__all__ = ["ChunkedCall", "ChunkSpec", "chunk_graph", "chunk_capture", "choose_chunks", "MAX_CHUNKS"]

aten = torch.ops.aten
MAX_CHUNKS = 32
"""The most chunks a region runs in (each chunk is one checkpoint call)."""
MIN_SHARE = 0.05
"""Groups whose transient is below this share of the largest group's are left whole (not worth a call)."""


@dataclass(frozen=True)
class ChunkSpec:
    """One chunked region of a plan: the group's nodes (in the unchunked graph) and its chunk count."""

    nodes: tuple[str, ...]
    chunks: int
    why: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"nodes": list(self.nodes), "chunks": self.chunks, "why": self.why}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ChunkSpec:
        return cls(tuple(str(x) for x in d["nodes"]), int(d["chunks"]), str(d.get("why", "")))


class ChunkedCall(torch.nn.Module):
    """Runs `fn` on k chunks of its first inputs (split along their axes), each chunk checkpointed."""

    def __init__(self, fn: fx.GraphModule, axes: list[tuple[int, int]], outputs: list[tuple[str, Any]],
                 chunks: int, loss_targets: dict[int, int] | None = None, weights: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.fn = fn
        self.axes = list(axes)
        """(dim, multiplier) of each chunked input, in order; the whole inputs follow them."""
        self.outputs = list(outputs)
        """('cat', (dim, multiplier)) or ('loss', (reduction, ignore_index)) per output of fn."""
        self.chunks = int(chunks)
        self.loss_targets = dict(loss_targets or {})
        """Output index of a loss -> index of its target among the chunked inputs."""
        self.weights = tuple(weights)
        """Indices (among the whole inputs) of the weights the chunks' linears read, in the order of `fn`'s
        last placeholders (a holder of each one's gradient buffer, or None)."""
        self.in_place = True
        """Accumulate those weights' gradients in place (`_LinearInto`); False: autograd sums the chunks'."""

    def forward(self, *inputs: Any) -> tuple[Any, ...]:
        split, rest = inputs[: len(self.axes)], inputs[len(self.axes):]
        # one buffer per weight whose gradient is accumulated in place; passed to the chunks as they are,
        # so a chunk's recompute takes the same path (and saves the same tensors) as its forward
        holders = {i: {} for i in self.weights if self.in_place and _accumulates(rest[i])}
        rest = tuple(_GradFrom.apply(x, holders[i]) if i in holders else x for i, x in enumerate(rest))
        rest = rest + tuple(holders.get(i) for i in self.weights)
        d0, m0 = self.axes[0]
        n = split[0].shape[d0] // m0  # the axis length N
        k = max(1, min(self.chunks, int(n)))
        sizes = [n // k + (1 if i < n % k else 0) for i in range(k)]
        pieces = [torch.split(x, [s * m for s in sizes], dim=d) for x, (d, m) in zip(split, self.axes)]
        results = []
        for i in range(k):
            args = [p[i] for p in pieces] + list(rest)
            results.append(checkpoint(self.fn, *args, use_reentrant=False, preserve_rng_state=False))
        out: list[Any] = []
        for j, (how, detail) in enumerate(self.outputs):
            parts = [r[j] for r in results]
            if how == "cat":
                out.append(parts[0] if k == 1 else torch.cat(parts, dim=detail[0]))
                continue
            total = parts[0]
            for p in parts[1:]:
                total = total + p
            reduction, ignore = detail
            if reduction == 1:  # mean over the tokens whose target counts
                target = split[self.loss_targets[j]]
                total = total / (target != ignore).sum()
            out.append(total)
        return tuple(out)


def _accumulates(w: Any) -> bool:
    """Whether a weight's gradient is accumulated in place: a float tensor that needs one, outside autocast
    (whose casts `_LinearInto` would have to make and keep as F.linear does)."""
    return (isinstance(w, torch.Tensor) and w.requires_grad and torch.is_grad_enabled() and w.dim() == 2
            and w.dtype.is_floating_point and not torch.is_autocast_enabled(w.device.type))


class _GradFrom(torch.autograd.Function):
    """The weight as the chunks see it (a view): its gradient is the buffer the chunks' `_LinearInto`
    filled, plus whatever reached it the usual way (another op of the chunks that reads the weight)."""

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, holder: dict) -> torch.Tensor:
        ctx.holder = holder
        ctx.set_materialize_grads(False)  # no zero gradient of the weight's size where none reached it
        return w.view_as(w)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> tuple[torch.Tensor | None, None]:
        # popped: the buffer's only reference is then the one handed to autograd, which makes it the
        # weight's .grad without a copy
        buf = ctx.holder.pop("grad", None)
        if buf is None:
            return grad, None
        return (buf if grad is None else buf.add_(grad)), None


class _LinearInto(torch.autograd.Function):
    """F.linear whose weight gradient is added in place into its holder's buffer (the first chunk's
    backward makes the buffer), so the chunks' backward holds one weight gradient, not two."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, holder: dict) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.holder = holder
        ctx.has_bias = bias is not None
        return torch.nn.functional.linear(x, w, bias)

    @staticmethod
    @once_differentiable  # a double backward through the in-place sum would be wrong: it raises instead
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, torch.Tensor | None, None]:
        x, w = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        buf = ctx.holder.get("grad")
        if buf is None:
            ctx.holder["grad"] = g2.t().mm(x2)
        else:
            buf.addmm_(g2.t(), x2)
        grad_x = grad.matmul(w) if ctx.needs_input_grad[0] else None
        grad_b = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, None, grad_b, None


def linear_into(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, holder: dict | None) -> torch.Tensor:
    """A chunk's linear: `_LinearInto` where its weight's gradient is accumulated in place (a holder is
    given: the weight came through `_GradFrom`), else F.linear."""
    if holder is not None and torch.is_grad_enabled():
        return _LinearInto.apply(x, w, bias, holder)
    return torch.nn.functional.linear(x, w, bias)


def choose_chunks(group: TokenGroup) -> int:
    """Chunks that bring the group's transient down to about its boundary's size: the smallest power of
    two at least interior / boundary, at most MAX_CHUNKS and the axis length. 1 means not worth it (also
    where the saving is not clearly above the parameter gradients each chunk's backward makes)."""
    ratio = group.interior_bytes / max(1, group.boundary_bytes)
    k = 1
    while k < ratio and k < MAX_CHUNKS:
        k *= 2
    k = max(1, min(k, hint(group.length)))
    # each chunk's backward makes a gradient as large as the parameters it reads: worth it only where
    # the chunks save clearly more than that transient
    if group.interior_bytes * (1 - 1 / k) <= 2 * group.param_bytes:
        return 1
    return k


def candidate_groups(gm: fx.GraphModule) -> list[TokenGroup]:
    """The token-wise groups along the axis (an input's dimension) that covers the most interior bytes."""
    best: list[TokenGroup] = []
    best_bytes = -1
    for length in axis_lengths(gm):
        groups = [g for g in find_tokenwise(gm, length) if choose_chunks(g) > 1]
        largest = max((g.interior_bytes for g in groups), default=0)
        groups = [g for g in groups if g.interior_bytes >= largest * MIN_SHARE]
        covered = sum(g.interior_bytes for g in groups)
        if covered > best_bytes:
            best, best_bytes = groups, covered
    return best


def chunk_graph(gm: fx.GraphModule, specs: list[ChunkSpec]) -> fx.GraphModule:
    """`gm` (changed in place: pass a fresh capture) with each spec's group replaced by a ChunkedCall node.
    Raises ValueError when a spec's group is not a token-wise group of the graph."""
    groups = {g.nodes: g for length in axis_lengths(gm) for g in find_tokenwise(gm, length)}
    out = gm
    moved: dict[str, fx.Node] = {}  # an earlier group's output -> the node that now gives it
    for i, spec in enumerate(specs):
        g = groups.get(tuple(spec.nodes))
        if g is None:
            raise ValueError(f"chunked region {spec.nodes[0]}..{spec.nodes[-1]}: not a token-wise group of this graph")
        _replace(out, g, spec.chunks, f"chunked_{i}", moved)
    _stable_toposort(out.graph)
    out.graph.lint()
    out.recompile()
    return out


def _replace(gm: fx.GraphModule, g: TokenGroup, chunks: int, name: str, moved: dict[str, fx.Node]) -> None:
    graph = gm.graph
    by_name = {n.name: n for n in graph.nodes} | moved
    members = [by_name[x] for x in g.nodes]
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    ins = [by_name[x] for x, _ in g.chunked_inputs] + [by_name[x] for x in g.whole_inputs]
    axes = {by_name[x]: ax for x, ax in g.chunked_inputs}
    for a in ins:
        env[a] = sub.placeholder(a.name)
        env[a].meta = dict(a.meta)
    member_axes = dict(g.axes)
    in_axes = member_axes | dict(g.chunked_inputs)  # the axis of every tensor a member reads along it
    whole = [by_name[x] for x in g.whole_inputs]
    # the whole inputs that the members' linears read as their weight, and a placeholder for each one's
    # gradient buffer (after the inputs: ChunkedCall passes them last)
    weights = sorted({whole.index(n.args[1]) for n in members if _linear_on(n, whole)})
    holder = {i: sub.placeholder(f"grad_into_{i}") for i in weights}
    outputs = {o[0]: o for o in g.outputs}
    loss_targets: dict[int, int] = {}
    for n in members:
        if n.target is aten._assert_tensor_metadata.default:
            continue  # a metadata check of the whole tensor; its chunks differ in size
        if n.name in outputs and outputs[n.name][1] == "loss":
            x, t = n.args[0], n.args[1]
            reduction, ignore = outputs[n.name][2]
            loss_targets[list(outputs).index(n.name)] = ins.index(t) if t in ins[: len(axes)] else -1
            env[n] = sub.call_function(aten.cross_entropy_loss.default, (env[x], env[t], None, 2, ignore, 0.0))
            continue
        if n.target in (aten.view.default, aten._unsafe_view.default, aten.reshape.default):
            env[n] = sub.call_function(aten.reshape.default, (env[n.args[0]], _chunk_shape(n, in_axes[n.args[0].name][0], member_axes[n.name][0], env, sub)))
        elif _linear_on(n, whole):
            args = tuple(env[a] if isinstance(a, fx.Node) else a for a in n.args)
            args = args + (None,) * (3 - len(args))
            env[n] = sub.call_function(linear_into, (*args, holder[whole.index(n.args[1])]))
        else:
            env[n] = sub.node_copy(n, lambda a: env[a])
        env[n].meta = dict(n.meta)
    sub.output(tuple(env[by_name[o[0]]] for o in g.outputs))
    fn = fx.GraphModule(torch.nn.Module(), sub)
    if any(v < 0 for v in loss_targets.values()):
        raise ValueError(f"chunked region {name}: a loss target is not a chunked input")
    mod = ChunkedCall(fn, [ax for _, ax in g.chunked_inputs], [(o[1], o[2]) for o in g.outputs], chunks,
                      loss_targets, tuple(weights))
    gm.add_submodule(name, mod)
    last = members[-1]
    with graph.inserting_after(last):
        call = graph.call_module(name, tuple(ins))
    call.meta["nn_module_stack"] = dict(members[0].meta.get("nn_module_stack", {}))
    call.meta["val"] = tuple(by_name[o[0]].meta.get("val") for o in g.outputs)
    prev = call
    for j, o in enumerate(g.outputs):
        src = by_name[o[0]]
        with graph.inserting_after(prev):
            get = graph.call_function(operator.getitem, (call, j))
        get.meta = dict(src.meta)
        moved[src.name] = get
        src.replace_all_uses_with(get, delete_user_cb=lambda u: u not in set(members))
        prev = get
    for n in reversed(members):
        graph.erase_node(n)


def _linear_on(n: fx.Node, whole: list[fx.Node]) -> bool:
    """A linear whose weight is one of the group's whole inputs (a parameter, as captured)."""
    return n.target is aten.linear.default and not n.kwargs and len(n.args) >= 2 and any(n.args[1] is w for w in whole)


def _chunk_shape(n: fx.Node, in_dim: int, ax: int, env: dict[fx.Node, fx.Node], sub: fx.Graph) -> list[Any]:
    """A reshape's target shape for one chunk: the axis -1, every other size as captured (a symbolic one
    given as -1 read off the chunk's input, whose other dimensions are the whole's)."""
    src = n.args[0]
    sizes = view_sizes(n, in_dim, ax)
    if sizes is None:  # find_tokenwise leaves such a reshape out of every group
        raise ValueError(f"{n.name}: a reshape with a symbolic size besides the axis cannot be chunked")
    shape: list[Any] = []
    for s in sizes:
        if s is None:
            shape.append(-1)
        elif isinstance(s, fx.Node):
            shape.append(env[s])
        elif isinstance(s, tuple):
            shape.append(sub.call_function(aten.sym_size.int, (env[src], s[1])))
        else:
            shape.append(s)
    return shape


def _stable_toposort(graph: fx.Graph) -> None:
    """Reorder nodes so every node follows its inputs, keeping the given order where it already does."""
    nodes = list(graph.nodes)
    done: set[fx.Node] = set()
    order: list[fx.Node] = []
    pending = list(nodes)
    while pending:
        rest = []
        for n in pending:
            if all(a in done for a in n.all_input_nodes) and (n.op != "output" or len(rest) == 0):
                order.append(n)
                done.add(n)
            else:
                rest.append(n)
        if len(rest) == len(pending):
            raise ValueError("chunked graph: a cycle")
        pending = rest
    for prev, n in zip(order, order[1:]):
        prev.append(n)


def chunk_capture(cap: Any, specs: list[ChunkSpec] | None = None) -> tuple[Any, list[ChunkSpec]]:
    """A capture (capture.Capture) with its token-wise groups chunked: the given specs (a loaded plan's),
    else every group worth it (candidate_groups, choose_chunks). Changes the capture's graph in place."""
    if specs is None:
        specs = []
        for g in candidate_groups(cap.graph_module):
            k = choose_chunks(g)
            outs = ", ".join(o[0] for o in g.outputs[:3]) + (" ..." if len(g.outputs) > 3 else "")
            why = (f"{len(g.nodes)} token-wise nodes ({g.nodes[0]}..{g.nodes[-1]}, out: {outs}) hold "
                   f"{g.interior_bytes / 1e6:.2f} MB inside against {g.boundary_bytes / 1e6:.2f} MB at their boundary")
            specs.append(ChunkSpec(g.nodes, k, why))
    if not specs:
        return cap, []
    gm = chunk_graph(cap.graph_module, specs)
    return dataclasses.replace(cap, graph_module=gm), specs
