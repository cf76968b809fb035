"""Token-wise work in a captured (aten-level, torch.export) graph.

A node is *token-wise* along an axis of length N (the sequence or the batch of an input) when each
slice of its output along that axis depends only on the same slice of its inputs: linear/matmul over
the last dimension, pointwise ops, norms and softmax over other dimensions, views that keep the axis
(tracked through reshapes that merge it with the dimensions after it), and the per-token
cross-entropy (its mean or sum over tokens is the one reduction allowed, as the last op of a group).
Attention, reductions over the axis, convolutions along it, random ops and in-place writes mix tokens.

`find_tokenwise` groups token-wise nodes into maximal convex subgraphs: connected token-wise nodes
separated by the same number of token-mixing ops from the inputs (so no path leaves a group and comes
back). Each `TokenGroup` says which tensors enter it split along the axis and which whole, and how each
output is put back together (concatenated, or the loss summed over chunks). `planner/lower/chunk.py`
runs such a group in chunks.

One concept, so one module over 500 lines: the token-wise analysis; the per-op axis rules and the grouping
read each other's results and are checked together.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

__all__ = ["Axis", "TokenGroup", "find_tokenwise", "axis_lengths", "hint", "view_sizes"]

aten = torch.ops.aten

Axis = tuple[int, int]
"""(dimension, multiplier): the tensor's size along `dimension` is N * multiplier (a reshape that merged
the axis with the dimensions after it multiplies it)."""


class _Mixing(Exception):
    """The node is not token-wise along the axis."""


@dataclass(frozen=True)
class TokenGroup:
    """A convex set of token-wise nodes that can run in chunks along one axis."""

    nodes: tuple[str, ...]
    """Member nodes, in graph order."""
    chunked_inputs: tuple[tuple[str, Axis], ...]
    """Tensors from outside split along the axis: (node name, axis)."""
    whole_inputs: tuple[str, ...]
    """Everything else the members read from outside (parameters, broadcast tensors, sizes)."""
    outputs: tuple[tuple[str, str, Any], ...]
    """(node name, how, detail): 'cat' with its axis, or 'loss' with (reduction, ignore_index)."""
    length: Any
    """N: the axis length (an int, or the capture's symbolic size)."""
    interior_bytes: int
    """Bytes of the members' outputs that stay inside (what one chunk holds a k-th of); a view owns none,
    and a member that an output views counts at the boundary (its pieces are held until concatenated)."""
    boundary_bytes: int
    """Bytes of the chunked inputs and the outputs (what stays whole)."""
    axes: tuple[tuple[str, Axis], ...] = ()
    """The axis of each member's output (members that have one)."""
    param_bytes: int = 0
    """Bytes of the trainable parameters the members read: each chunk's backward makes a gradient of that
    size before it is added to the others (an embedding table's twice: its backward starts from zeros), but
    for the linears' weights outside autocast, which the chunks add into one buffer in place
    (lower/chunk.py)."""


def hint(x: Any) -> int:
    """The example's value of a size (an int, or a SymInt's hint)."""
    if isinstance(x, torch.SymInt):
        return int(x.node.hint) if x.node.hint is not None else int(x.node.require_hint())
    return int(x)


def _eq(a: Any, b: Any) -> bool:
    if isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt):
        return bool(statically_known_true(a == b))
    return a == b


def _prod(xs: Any) -> Any:
    p: Any = 1
    for x in xs:
        p = p * x
    return p


def _val(n: Any) -> Any:
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def _nbytes(v: Any) -> int:
    if isinstance(v, torch.Tensor):
        return hint(v.numel()) * v.element_size()
    if isinstance(v, (tuple, list)):
        return sum(_nbytes(x) for x in v)
    return 0


def axis_lengths(gm: fx.GraphModule) -> list[Any]:
    """Candidate axis lengths: the sizes (other than 1) of the graph's tensor inputs, largest first."""
    seen: list[Any] = []
    for n in gm.graph.nodes:
        v = _val(n)
        if n.op == "placeholder" and isinstance(v, torch.Tensor):
            for s in v.shape:
                if hint(s) > 1 and not any(_eq(s, t) for t in seen):
                    seen.append(s)
    return sorted(seen, key=hint, reverse=True)


_SAME = {
    aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.clone.default, aten.contiguous.default,
    aten.alias.default, aten.type_as.default, aten.detach.default,
}
_REDUCE = {
    aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.amin.default, aten.var.correction,
    aten.std.correction, aten.logsumexp.default, aten.norm.ScalarOpt_dim,
}
_SOFTMAX = {aten._softmax.default, aten._log_softmax.default, aten.softmax.int, aten.log_softmax.int}
_VIEW = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
_BATCH_ONLY = {
    aten.conv1d.default, aten.conv2d.default, aten.conv3d.default, aten.convolution.default,
    aten.max_pool2d.default, aten.avg_pool2d.default, aten.adaptive_avg_pool2d.default,
    aten.max_pool1d.default, aten.avg_pool1d.default, aten.adaptive_avg_pool1d.default,
}
_LOSS = {aten.cross_entropy_loss.default}
_ANNOTATIONS = {aten._assert_tensor_metadata.default}


def _norm_dim(d: int, rank: int) -> int:
    return d + rank if d < 0 else d


def _tensor_args(node: fx.Node) -> list[fx.Node]:
    out: list[fx.Node] = []
    for a in [*node.args, *node.kwargs.values()]:
        for x in a if isinstance(a, (list, tuple)) else [a]:
            if isinstance(x, fx.Node) and isinstance(_val(x), torch.Tensor):
                out.append(x)
    return out


def _other_node_args(node: fx.Node) -> list[fx.Node]:
    out: list[fx.Node] = []
    for a in [*node.args, *node.kwargs.values()]:
        for x in a if isinstance(a, (list, tuple)) else [a]:
            if isinstance(x, fx.Node) and not isinstance(_val(x), torch.Tensor):
                out.append(x)
    return out


def _view_axis(src: torch.Tensor, dst: Any, ax: Axis) -> Axis:
    """Where the axis lands after a reshape from `src`'s shape to `dst`'s (merging allowed only with the
    dimensions after it; splitting it is mixing)."""
    d, m = ax
    before = _prod(src.shape[:d])
    for e in range(len(dst.shape) + 1):
        if e < len(dst.shape) and _eq(_prod(dst.shape[:e]), before):
            merged = src.shape[d]
            for j in range(d + 1, len(src.shape) + 1):
                if _eq(dst.shape[e], merged):
                    return e, m * hint(_prod(src.shape[d + 1 : j]))
                if j < len(src.shape):
                    merged = merged * src.shape[j]
    raise _Mixing


def view_sizes(node: fx.Node, in_dim: int, out_dim: int) -> list[Any] | None:
    """A reshape's sizes besides the axis, for one chunk (the axis's own entry None): each one as given
    (an int or a size node), as captured where static, else ("dim", j): the input's dimension j of the
    same size (not the axis, so a chunk's is the whole's). None where one is symbolic, given as -1 and
    matches no such dimension: the chunk could not be reshaped (it would need two -1s)."""
    val, xv = _val(node), _val(node.args[0])
    given = list(node.args[1])
    if len(given) != val.dim():
        return None
    sizes: list[Any] = []
    for i, s in enumerate(val.shape):
        if i == out_dim:
            sizes.append(None)
        elif isinstance(given[i], fx.Node) or given[i] != -1:
            sizes.append(given[i])
        elif isinstance(s, int):
            sizes.append(s)
        else:
            same = [j for j in range(xv.dim()) if j != in_dim and _eq(xv.shape[j], s)]
            if not same:
                return None
            sizes.append(("dim", same[0]))
    return sizes


def out_axis(node: fx.Node, axes: dict[fx.Node, Axis]) -> Axis | None:
    """The axis of `node`'s output given its inputs' axes; None for a loss (a scalar reduced over tokens).
    Raises _Mixing when the node is not token-wise."""
    op = node.target
    val = _val(node)
    if not isinstance(op, torch._ops.OpOverload) and op is not operator.getitem:
        raise _Mixing
    if isinstance(op, torch._ops.OpOverload):
        if op._schema.is_mutable or torch.Tag.nondeterministic_seeded in op.tags and not _no_dropout(node):
            raise _Mixing
    if _other_node_args(node) and op not in _VIEW:
        raise _Mixing
    targs = _tensor_args(node)
    have = [(t, axes[t]) for t in targs if t in axes]
    if not have:
        raise _Mixing
    x, (d, m) = have[0]
    xv = _val(x)
    if op is operator.getitem:
        if isinstance(val, torch.Tensor) and node.args[0] is x:
            return d, m
        raise _Mixing
    if op in _ANNOTATIONS:
        return None
    if op in _LOSS:
        return _loss_axis(node, axes)
    if not isinstance(val, torch.Tensor):
        if isinstance(val, (list, tuple)) and op in (aten.split.Tensor, aten.split_with_sizes.default):
            dim = _norm_dim(node.args[2] if len(node.args) > 2 else 0, xv.dim())
            if dim != d and len(have) == 1:
                return d, m
        raise _Mixing
    if torch.Tag.pointwise in getattr(op, "tags", ()) or op in _SAME or _no_dropout(node):
        return _pointwise(node, axes)
    if op is aten.cat.default:
        return _cat_axis(node, axes)
    if len(have) != 1:
        raise _Mixing
    if x is not node.args[0] and op not in (aten.embedding.default, aten.addmm.default):
        raise _Mixing
    rank = xv.dim()
    if op in (aten.linear.default, aten.matmul.default) and d < rank - 1 and (op is aten.linear.default or _val(node.args[1]).dim() <= 2):
        return d, m
    if op is aten.mm.default and d == 0:
        return d, m
    if op is aten.addmm.default and x is node.args[1] and d == 0 and _val(node.args[0]).dim() <= 1:
        return d, m
    if op is aten.embedding.default and x is node.args[1]:
        return d, m
    if op in _REDUCE:
        dims = node.args[1] if len(node.args) > 1 else None
        dims = [dims] if isinstance(dims, int) else dims
        keep = node.args[2] if len(node.args) > 2 and op is not aten.var.correction else node.kwargs.get("keepdim", False)
        if op in (aten.var.correction, aten.std.correction):
            keep = node.kwargs.get("keepdim", node.args[3] if len(node.args) > 3 else False)
        if not dims:
            raise _Mixing
        dims = [_norm_dim(int(a), rank) for a in dims]
        if d in dims:
            raise _Mixing
        return (d if keep else d - sum(1 for a in dims if a < d)), m
    if op in _SOFTMAX and _norm_dim(node.args[1], rank) != d:
        return d, m
    if op in (aten.layer_norm.default, aten.rms_norm.default) and d < rank - len(node.args[1]):
        return d, m
    if op in _VIEW:
        out = _view_axis(xv, val, (d, m))
        if view_sizes(node, d, out[0]) is None:
            raise _Mixing  # a size its chunks could not be given: left whole
        return out
    if op is aten.unsqueeze.default:
        at = _norm_dim(node.args[1], rank + 1)
        return (d + 1 if at <= d else d), m
    if op is aten.squeeze.dim and _norm_dim(node.args[1], rank) != d:
        return (d - 1 if _norm_dim(node.args[1], rank) < d else d), m
    if op is aten.transpose.int:
        a, b = _norm_dim(node.args[1], rank), _norm_dim(node.args[2], rank)
        return (b if d == a else a if d == b else d), m
    if op is aten.t.default:
        return 1 - d, m
    if op is aten.permute.default:
        return [_norm_dim(p, rank) for p in node.args[1]].index(d), m
    if op is aten.slice.Tensor:
        dim = _norm_dim(node.args[1] if len(node.args) > 1 else 0, rank)
        if dim != d:
            return d, m
        start, end = (list(node.args[2:4]) + [None, None])[:2]
        step = node.args[4] if len(node.args) > 4 else 1
        if (start in (None, 0)) and step == 1 and (end is None or (isinstance(end, int) and end >= 2**62)):
            return d, m
        raise _Mixing
    if op is aten.select.int and _norm_dim(node.args[1], rank) != d:
        return (d - 1 if _norm_dim(node.args[1], rank) < d else d), m
    if op is aten.flatten.using_ints:
        start = _norm_dim(node.args[1] if len(node.args) > 1 else 0, rank)
        end = _norm_dim(node.args[2] if len(node.args) > 2 else -1, rank)
        if d < start:
            return d, m
        if d > end:
            return d - (end - start), m
        raise _Mixing
    if op in _BATCH_ONLY and d == 0 and m == 1:
        return 0, 1
    raise _Mixing


def _no_dropout(node: fx.Node) -> bool:
    """dropout with p = 0 or train = False: the identity, which draws nothing."""
    if node.target not in (aten.dropout.default, aten.native_dropout.default):
        return False
    p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
    train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
    return node.target is aten.dropout.default and (p == 0 or train is False)


def _pointwise(node: fx.Node, axes: dict[fx.Node, Axis]) -> Axis:
    val = _val(node)
    rank = val.dim()
    found: Axis | None = None
    for t in _tensor_args(node):
        tv = _val(t)
        shift = rank - tv.dim()
        if t in axes:
            d, m = axes[t]
            ax = (d + shift, m)
            if found is not None and found != ax:
                raise _Mixing
            found = ax
    if found is None:
        raise _Mixing
    for t in _tensor_args(node):
        if t in axes:
            continue
        tv = _val(t)
        at = found[0] - (rank - tv.dim())
        if at >= 0 and not _eq(tv.shape[at], 1):
            raise _Mixing  # a whole tensor that spans the axis: not a broadcast
    return found


def _cat_axis(node: fx.Node, axes: dict[fx.Node, Axis]) -> Axis:
    parts = node.args[0]
    rank = _val(node).dim()
    dim = _norm_dim(node.args[1] if len(node.args) > 1 else 0, rank)
    found = {axes.get(t) for t in parts}
    if len(found) != 1 or None in found or next(iter(found))[0] == dim:
        raise _Mixing
    return next(iter(found))


def _loss_axis(node: fx.Node, axes: dict[fx.Node, Axis]) -> Axis | None:
    x, t = node.args[0], node.args[1]
    names = ("weight", "reduction", "ignore_index", "label_smoothing")
    extra = dict(zip(names, node.args[2:]))
    extra.update({k: v for k, v in node.kwargs.items() if k in names})
    if extra.get("weight") is not None or extra.get("label_smoothing", 0.0) != 0.0:
        raise _Mixing
    if x not in axes or axes[x][0] != 0 or axes.get(t) != axes[x]:
        raise _Mixing
    return axes[x] if extra.get("reduction", 1) == 0 else None


def loss_detail(node: fx.Node) -> tuple[int, int]:
    """(reduction, ignore_index) of a cross-entropy node (1 = mean, 2 = sum)."""
    names = ("weight", "reduction", "ignore_index", "label_smoothing")
    extra = dict(zip(names, node.args[2:]))
    extra.update({k: v for k, v in node.kwargs.items() if k in names})
    return int(extra.get("reduction", 1)), int(extra.get("ignore_index", -100))


def find_tokenwise(gm: fx.GraphModule, length: Any) -> list[TokenGroup]:
    """Maximal convex groups of nodes token-wise along an axis of `length` (see the module docstring)."""
    axes: dict[fx.Node, Axis] = {}
    tokenwise: set[fx.Node] = set()
    losses: set[fx.Node] = set()
    level: dict[fx.Node, int] = {}
    parent: dict[fx.Node, fx.Node] = {}

    def find(n: fx.Node) -> fx.Node:
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for n in gm.graph.nodes:
        ins = [a for a in n.all_input_nodes]
        level[n] = max((level[a] + (1 if _mixes(a, tokenwise, axes) else 0) for a in ins), default=0)
        if n.op not in ("call_function",):
            _source(n, length, axes)
            continue
        try:
            ax = out_axis(n, axes)
        except _Mixing:
            if not any(a in axes for a in _tensor_args(n)):
                _source(n, length, axes)  # reads nothing along the axis: a fresh tensor, maybe with one
            continue
        tokenwise.add(n)
        parent[n] = n
        if ax is not None:
            axes[n] = ax
        elif n.target in _LOSS:
            losses.add(n)
        for a in ins:
            if a in tokenwise and level[a] == level[n] and a not in losses:
                parent[find(a)] = find(n)
    members: dict[fx.Node, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        if n in tokenwise and n.target not in _ANNOTATIONS:
            members.setdefault(find(n), []).append(n)
    # annotations (dtype asserts) go with the node they check
    for n in gm.graph.nodes:
        if n.target in _ANNOTATIONS and n in tokenwise and n.args[0] in tokenwise:
            members[find(n.args[0])].append(n)
    groups = []
    for nodes in members.values():
        g = _group(gm, nodes, axes, losses, length)
        if g is not None:
            groups.append(g)
    return groups


def _mixes(a: fx.Node, tokenwise: set[fx.Node], axes: dict[fx.Node, Axis]) -> bool:
    """`a` reads along the axis and is not token-wise (a level boundary). Size nodes are not."""
    if a in tokenwise or a.op != "call_function" or not isinstance(_val(a), torch.Tensor):
        return False
    return any(t in axes for t in _tensor_args(a)) or a in axes


def _source(n: fx.Node, length: Any, axes: dict[fx.Node, Axis]) -> None:
    v = _val(n)
    if n.op in ("get_attr", "output") or not isinstance(v, torch.Tensor):
        return
    for i, s in enumerate(v.shape):
        if _eq(s, length):
            axes[n] = (i, 1)
            return


def _group(gm: fx.GraphModule, nodes: list[fx.Node], axes: dict[fx.Node, Axis], losses: set[fx.Node],
           length: Any) -> TokenGroup | None:
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    nodes = sorted(nodes, key=order.__getitem__)
    inside = set(nodes)
    chunked: dict[fx.Node, Axis] = {}
    whole: dict[fx.Node, None] = {}
    for n in nodes:
        for a in n.all_input_nodes:
            if a in inside:
                continue
            if a in axes and isinstance(_val(a), torch.Tensor) and a in _tensor_args(n):
                chunked[a] = axes[a]
            else:
                whole[a] = None
    outputs = []
    for n in nodes:
        if n.target in _ANNOTATIONS:
            continue
        if any(u not in inside for u in n.users):
            if n in losses:
                outputs.append((n.name, "loss", loss_detail(n)))
            elif isinstance(_val(n), torch.Tensor) and n in axes:
                outputs.append((n.name, "cat", axes[n]))
            else:
                return None  # a list or a size needed outside: not chunked
    if not outputs or not chunked or _reenters(inside, nodes):
        return None
    out_names = {o[0] for o in outputs}
    # a view owns no bytes; a member that an output views stays whole (the chunks' pieces of it are held
    # until they are concatenated), so it counts at the boundary, not inside
    by_name = {n.name: n for n in nodes}
    held = {_root(by_name[o], inside) for o in out_names}
    interior = sum(_nbytes(_val(n)) for n in nodes if n not in held and _root(n, inside) is n)
    interior += sum(_nbytes(_val(n.args[0])) for n in nodes if n in losses)  # the loss's log-softmax
    boundary = sum(_nbytes(_val(a)) for a in chunked) + sum(_nbytes(_val(n)) for n in held if n in inside)
    return TokenGroup(
        nodes=tuple(n.name for n in nodes),
        chunked_inputs=tuple((a.name, ax) for a, ax in chunked.items()),
        whole_inputs=tuple(a.name for a in whole),
        outputs=tuple(outputs),
        length=length,
        interior_bytes=int(interior),
        boundary_bytes=int(boundary),
        axes=tuple((n.name, axes[n]) for n in nodes if n in axes),
        param_bytes=_param_bytes(gm, nodes, whole),
    )


def _root(n: fx.Node, inside: set[fx.Node]) -> fx.Node:
    """The tensor whose storage `n` shares, through views (a contiguous that copies is not one); stops at
    the group's edge."""
    while n in inside and n.args and isinstance(n.args[0], fx.Node) and _aliases(n):
        n = n.args[0]
    return n


def _aliases(n: fx.Node) -> bool:
    op = n.target
    if op is operator.getitem:
        src = n.args[0]
        return isinstance(src.target, torch._ops.OpOverload) and src.target.is_view
    if not isinstance(op, torch._ops.OpOverload) or not op.is_view:
        return False
    x, v = _val(n.args[0]), _val(n)
    if not isinstance(x, torch.Tensor) or not isinstance(v, torch.Tensor) or x.dtype != v.dtype:
        return False  # a `to` that casts copies
    # these may alias or copy: a copy where the input is not contiguous (counted as one: never too few bytes)
    if op in (aten.contiguous.default, aten.reshape.default, aten.flatten.using_ints):
        return x.is_contiguous()
    return True


def _param_bytes(gm: fx.GraphModule, nodes: list[fx.Node], whole: dict[fx.Node, None]) -> int:
    total = 0
    for a in whole:
        if a.op != "get_attr":
            continue
        try:
            t = gm.get_parameter(str(a.target))
        except AttributeError:
            continue
        if t.requires_grad:
            lookup = any(n.target is aten.embedding.default and n.args[0] is a for n in nodes)
            total += t.numel() * t.element_size() * (2 if lookup else 1)
    return total


def _reenters(inside: set[fx.Node], nodes: list[fx.Node]) -> bool:
    """A path that leaves the group and comes back (the group would not be convex)."""
    seen: set[fx.Node] = set()
    stack = [u for n in nodes for u in n.users if u not in inside]
    while stack:
        u = stack.pop()
        if u in seen:
            continue
        seen.add(u)
        for w in u.users:
            if w in inside:
                return True
            stack.append(w)
    return False
