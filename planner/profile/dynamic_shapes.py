"""Sizes that depend on values: boolean-mask indexing, `nonzero`, `torch.where(cond)`, `masked_select`,
`unique`, `.item()`, `bincount`... on fake tensors.

A fake tensor has a shape but no values, so torch's fake mode refuses these ops
(DynamicOutputShapeException, DataDependentOutputException). `ValueSizes`, a dispatch mode directly
above the fake mode, gives each such op an output of a definite size instead:

- where the op has a largest size (every mask element true, every value distinct), that bound: a
  boolean index of a mask of N elements selects N rows, `nonzero` of N elements makes [N, dim], `unique`
  of N values makes N. The plan then holds for every batch of these shapes, whatever its masks keep
  (a batch's padding changes from one batch to the next); where every mask element is true (an
  all-ones attention mask) the bound is the real size, so the figures stay exact there;
- where it has none (`.item()` used as a size, `bincount`, `repeat_interleave` by a tensor), the op
  runs on the real values of its inputs, computed from the example inputs by the part of the graph that
  leads to them (`RealValues`), provided that part reads no parameter and draws no random number (input
  preprocessing: masks, lengths, labels). Otherwise, or on the meta device, which holds no values, the
  node cannot be sized and profiling fails naming it.

Each node sized either way is listed (`found`), and `note` gives the plan's line about them. A second
run over the same graph (the selective policy's count, the backward) replays the first run's answers
in order (`replaying`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from ..capture.rng import uses_rng
from ..errors import ProfileError
from ..lower.selective import known_masks
from .record import meta_to_cpu

__all__ = ["RealValues", "Sized", "ValueSizes", "ExampleSizes", "example_notes", "size_notes", "with_fake_mode"]

aten = torch.ops.aten
_MASKS = (torch.bool, torch.uint8)  # index dtypes that select by value (a mask), not by position


@dataclass
class Sized:
    """One node whose output size depends on values, and how the profile sized it."""

    node: str
    op: str
    bounded: bool
    """True: planned at the largest size the op can make; False: at the size the example's values make."""
    elements: int = 0
    """Bounded: the elements (rows) planned for; the example's count beside it in `example` where known."""
    example: int | None = None


class ValueSizes(TorchDispatchMode):
    """The fake mode's data-dependent ops, sized (see the module docstring). `values`: a fake tensor -> its
    real value, or None where it has none to give (None: no values at all), called with `parameters=True`
    where the value may cost part of the model's forward (`RealValues.of`); `no_values`: why, for the note
    and the error ("the meta device holds no values")."""

    def __init__(self, values: Callable[..., torch.Tensor | None] | None = None, *,
                 no_values: str = "") -> None:
        super().__init__()
        self.values = values
        self.no_values = no_values
        self.node: str | None = None
        """The running fx node's name (set by the recorder)."""
        self.found: dict[str, Sized] = {}
        self._answers: list[tuple[Any, Any]] = []  # (op, real output) of each op run on real values, in order
        self._replay: int | None = None  # the next answer to hand out in a replay; None while recording
        self._masks: list[torch.Tensor | None] = []  # `mask_value`'s answers, in order
        self._mask_replay = 0

    @contextlib.contextmanager
    def replaying(self):
        """Enter the mode for another run over the same graph: the ops sized from real values take the
        first run's answers, in the order it made them."""
        self._replay = self._mask_replay = 0
        try:
            with self, known_masks(self.mask_value):
                yield self
        finally:
            self._replay = None

    def mask_value(self, mask: torch.Tensor) -> torch.Tensor | None:
        """The example's real value of a fake attention mask (lower/selective.call_target: eager's decision to
        keep or drop it), None where unknown; a replay hands back the first run's answers in order."""
        if self._replay is not None:
            i, self._mask_replay = self._mask_replay, self._mask_replay + 1
            return self._masks[i] if i < len(self._masks) else None
        real = self.values(mask) if self.values is not None else None
        self._masks.append(real)
        return real

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            return func(*args, **kwargs)
        except (DynamicOutputShapeException, DataDependentOutputException):
            pass  # sized below, outside the handler: the exception's traceback would keep its tensors alive
        bound = _BOUNDS.get(func)
        if bound is not None:
            return bound(self, func, args, kwargs)
        return self._from_values(func, args, kwargs)

    def _record(self, func: Any, *, bounded: bool, elements: int = 0, example: int | None = None) -> None:
        if self.node is None or self._replay is not None:
            return
        prior = self.found.get(self.node)
        if prior is not None and prior.bounded == bounded:
            prior.elements += elements
            prior.example = None if prior.example is None or example is None else prior.example + example
            return
        self.found[self.node] = Sized(self.node, _op_name(func), bounded, elements, example)

    def count(self, mask: torch.Tensor) -> int | None:
        """How many elements of `mask` (a fake tensor) the example's values make true; None where unknown."""
        if self.values is None or self._replay is not None:
            return None
        real = self.values(mask)
        if real is None:
            return None
        with _disable_current_modes():
            return int(torch.count_nonzero(real))

    def _from_values(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Run `func` on the real values of its tensor arguments; the result as fake tensors."""
        fake_mode = next((t.fake_mode for t in pytree.tree_leaves((args, kwargs)) if hasattr(t, "fake_mode")), None)
        if self._replay is not None:
            if self._replay < len(self._answers) and self._answers[self._replay][0] is func:
                real = self._answers[self._replay][1]
                self._replay += 1
                return _faked(fake_mode, real)
            raise ProfileError(f"{_op_name(func)}: its output size depends on values, and this run differs from the first")
        real_args = self._real(args, kwargs)
        if real_args is None:
            why = self.no_values or "its inputs come from random draws, whose values a profile cannot know"
            raise ProfileError(
                f"{_op_name(func)}: its output size depends on the values of its inputs and has no largest size, "
                f"and {why}: plan with real example inputs from which its inputs are computed"
            )
        with _disable_current_modes(), torch.no_grad():
            real = func(*real_args[0], **real_args[1])
        self._answers.append((func, real))
        self._record(func, bounded=False)
        return _faked(fake_mode, real)

    def _real(self, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if self.values is None:
            return None
        flat, spec = pytree.tree_flatten((args, kwargs))
        out = []
        for leaf in flat:
            if isinstance(leaf, torch.Tensor) and not _real(leaf):  # a real one (a constant) is its own value
                leaf = self.values(leaf, parameters=True)  # no bound to fall back on: the model's forward if need be
                if leaf is None:
                    return None
            out.append(leaf)
        return pytree.tree_unflatten(out, spec)


def _faked(fake_mode: Any, real: Any) -> Any:
    if fake_mode is None:
        return real
    return pytree.tree_map_only(torch.Tensor, lambda t: fake_mode.from_tensor(t, static_shapes=True), real)


def _op_name(func: Any) -> str:
    return f"aten.{func._schema.name.split('::')[-1]}" if hasattr(func, "_schema") else str(func)


# The bounds: each makes the op's output at the largest size it can take, on fake tensors (the mode
# below), and records the node.

def _nonzero(mode: ValueSizes, func, args, kwargs):
    x = args[0]
    mode._record(func, bounded=True, elements=x.numel(), example=mode.count(x))
    return x.new_empty((x.numel(), x.dim()), dtype=torch.int64)


def _index(mode: ValueSizes, func, args, kwargs):
    """A boolean index of a mask of N elements selects N positions: its `dim` position indices, N each
    (what the kernel turns it into), so the op's output takes the size of N true elements."""
    x, indices = args[0], list(args[1])
    total, example = 0, 0
    for i, idx in enumerate(indices):
        if isinstance(idx, torch.Tensor) and idx.dtype in _MASKS:
            n = idx.numel()
            total += n
            known = mode.count(idx)
            example = None if example is None or known is None else example + known
            indices[i:i + 1] = [idx.new_empty((n,), dtype=torch.int64) for _ in range(idx.dim())]
    mode._record(func, bounded=True, elements=total, example=example)
    return func(x, indices, *args[2:], **kwargs)


def _masked_select(mode: ValueSizes, func, args, kwargs):
    x, mask = args[0], args[1]
    shape = torch.broadcast_shapes(x.shape, mask.shape)
    n = math.prod(shape)
    known = mode.count(mask) if mask.shape == shape else None  # a broadcast mask's count is not kept
    mode._record(func, bounded=True, elements=n, example=known)
    return x.new_empty((n,))


def _unique(mode: ValueSizes, func, args, kwargs, *, dim: int | None, inverse: bool, counts: bool):
    """At most every value distinct: as many as the input has (along `dim`). The outputs as torch's fake
    implementation shapes them (an empty inverse or counts where not asked for)."""
    x = args[0]
    n = x.numel() if dim is None else x.shape[dim]
    mode._record(func, bounded=True, elements=n)
    values = x.new_empty((n,)) if dim is None else x.new_empty((*x.shape[:dim], n, *x.shape[dim + 1:]))
    cpu_dim = dim is not None and x.device.type == "cpu"
    inv = x.new_empty(x.shape if dim is None else (x.shape[dim],), dtype=torch.int64) if inverse or cpu_dim else (
        x.new_empty((0,), dtype=torch.int64))
    cnt = x.new_empty((n,), dtype=torch.int64) if counts or cpu_dim else x.new_empty((0,), dtype=torch.int64)
    return values, inv, cnt


def _arg(args: tuple, kwargs: dict, i: int, name: str, default: Any) -> Any:
    return args[i] if len(args) > i else kwargs.get(name, default)


def _unique2(mode, func, args, kwargs):  # (self, sorted, return_inverse, return_counts)
    return _unique(mode, func, args, kwargs, dim=None, inverse=_arg(args, kwargs, 2, "return_inverse", False),
                   counts=_arg(args, kwargs, 3, "return_counts", False))


def _unique_old(mode, func, args, kwargs):  # (self, sorted, return_inverse) -> (values, inverse)
    return _unique(mode, func, args, kwargs, dim=None, inverse=_arg(args, kwargs, 2, "return_inverse", False),
                   counts=False)[:2]


def _unique_dim(mode, func, args, kwargs):  # (self, dim, sorted, return_inverse, return_counts)
    dim = _arg(args, kwargs, 1, "dim", 0) % max(args[0].dim(), 1)
    return _unique(mode, func, args, kwargs, dim=dim, inverse=_arg(args, kwargs, 3, "return_inverse", False),
                   counts=_arg(args, kwargs, 4, "return_counts", False))


def _unique_consecutive(mode, func, args, kwargs):  # (self, return_inverse, return_counts, dim)
    dim = _arg(args, kwargs, 3, "dim", None)
    dim = None if dim is None else dim % max(args[0].dim(), 1)
    return _unique(mode, func, args, kwargs, dim=dim, inverse=_arg(args, kwargs, 1, "return_inverse", False),
                   counts=_arg(args, kwargs, 2, "return_counts", False))


_BOUNDS: dict[Any, Callable] = {
    aten.nonzero.default: _nonzero,
    aten.index.Tensor: _index,
    aten.masked_select.default: _masked_select,
    aten._unique2.default: _unique2,
    aten._unique.default: _unique_old,
    aten.unique_dim.default: _unique_dim,
    aten.unique_consecutive.default: _unique_consecutive,
}


def size_notes(found: dict[str, Sized], no_values: str = "") -> list[str]:
    """The plan's lines about the nodes sized by `ValueSizes` (none where there were none)."""
    lines = []
    bounded = [s for s in found.values() if s.bounded]
    if bounded:
        listed = ", ".join(f"{s.node} ({s.op}, {s.elements}" + ("" if s.example is None else f"; the example {s.example}")
                           + ")" for s in bounded)
        why = f" ({no_values})" if no_values else ""
        lines.append(
            f"data-dependent sizes planned at their largest{why}, every mask element true: {listed}; "
            "the plan holds for any batch of these shapes, with room to spare where masks keep fewer"
        )
    measured = [s for s in found.values() if not s.bounded]
    if measured:
        listed = ", ".join(f"{s.node} ({s.op})" for s in measured)
        lines.append(
            f"data-dependent sizes taken from the example's values (no largest size exists): {listed}; "
            "a batch whose values make them larger needs more memory than planned"
        )
    return lines


class ExampleSizes(TorchDispatchMode):
    """Watches a run on real tensors: per node (`node`, set by the recorder), the ops whose output size
    depends on values, each with the largest it could be (`elements`; 0 where an op has none) and what the
    example made (`example`). `found` as `ValueSizes` has it, every entry sized from the example."""

    def __init__(self) -> None:
        super().__init__()
        self.node: str | None = None
        self.found: dict[str, Sized] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.node is not None and (func in _BOUNDS or torch.Tag.dynamic_output_shape in func.tags):
            largest, made = _largest(func, args, out)
            if largest is not None:
                prior = self.found.setdefault(self.node, Sized(self.node, _op_name(func), False, 0, 0))
                prior.elements += largest
                prior.example += made
        return out


def _largest(func: Any, args: tuple, out: Any) -> tuple[int | None, int]:
    """(the largest size `func` could have made, the size it made); (None, 0): not a data-dependent size
    (an index by positions); (0, 0): no largest size."""
    first = next((t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)), None)
    if func is aten.index.Tensor:
        masks = [m for m in args[1] if isinstance(m, torch.Tensor) and m.dtype in _MASKS]
        return (sum(m.numel() for m in masks), sum(int(torch.count_nonzero(m)) for m in masks)) if masks else (None, 0)
    if func not in _BOUNDS or first is None:
        return 0, 0
    shape = args[0].shape
    if func is aten.masked_select.default:
        shape = torch.broadcast_shapes(shape, args[1].shape)
    if func is aten.unique_dim.default:
        dim = args[1] % max(args[0].dim(), 1)
        return shape[dim], first.shape[dim]
    return math.prod(shape), first.shape[0]


def example_notes(found: dict[str, Sized]) -> list[str]:
    """The plan's line about the nodes `ExampleSizes` found (none where there were none)."""
    if not found:
        return []
    listed = ", ".join(
        f"{s.node} ({s.op}" + (f", {s.example} of at most {s.elements})" if s.elements else ")") for s in found.values()
    )
    if all(s.elements and s.example == s.elements for s in found.values()):
        return [f"data-dependent sizes, at their largest in the example: {listed}; the plan holds for any batch of these shapes"]
    return [
        f"data-dependent sizes taken from the example's values: {listed}; a batch whose values make them larger "
        "needs more memory than planned"
    ]


@contextlib.contextmanager
def with_fake_mode(fake_mode: Any, sizes: ValueSizes | None):
    """The fake mode, with `sizes` replaying above it (the backward of a fake recording run)."""
    with fake_mode, sizes.replaying() if sizes is not None else contextlib.nullcontext():
        yield


class RealValues:
    """The real value of a node of the graph from the example inputs, computed by the part of the graph
    that leads to it, where that part draws no random number and reads no parameter unless `parameters`
    is asked for (a module's own, swapped in for the fakes while it runs, among them). Without parameters it is input preprocessing (a mask from the
    attention mask, labels), cheap next to the step, and its values are kept for the next question; with
    them it is part of the model's forward, run without autograd, each value let go after its last use.
    None where the part cannot be run so.

    `inputs`: the placeholders' real values; `state`: parameter and buffer name -> real tensor (the graph's
    own are fakes while a fake run swaps them in); `params`: the names among them that are parameters."""

    def __init__(self, gm: fx.GraphModule, inputs: list[Any], state: dict[str, torch.Tensor], params: set[str]) -> None:
        self.gm = gm
        self.state = state
        self.params = params
        self.values: dict[fx.Node, Any] = {}
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.values.update(zip(placeholders, inputs))
        self.order = {n: i for i, n in enumerate(gm.graph.nodes)}
        self.refused: set[tuple[fx.Node, bool]] = set()

    def of(self, node: fx.Node, *, parameters: bool = False) -> Any | None:
        if node in self.values:
            return self.values[node] if _real(self.values[node]) else None
        needed = self._ancestors(node, parameters)
        if needed is None:
            return None
        order = sorted(needed, key=self.order.__getitem__)
        last = {a: n for n in order for a in n.all_input_nodes}  # each value's last reader within the part
        values = self.values if not parameters else {}
        with _disable_current_modes(), torch.no_grad():
            for n in order:
                if n.op == "get_attr":
                    values[n] = self._attr(str(n.target))
                    continue
                args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: values[a] if a in values else self.values[a])
                args, kwargs = meta_to_cpu(args, kwargs)
                if n.op == "call_module":
                    values[n] = self._call_module(str(n.target), args, kwargs)
                elif n.op == "call_function":
                    values[n] = n.target(*args, **kwargs)
                else:
                    values[n] = getattr(args[0], n.target)(*args[1:], **kwargs)
                if parameters:  # the forward's activations: let go once read for the last time
                    for a in n.all_input_nodes:
                        if last.get(a) is n and a in values:
                            del values[a]
        value = values[node]
        return value if _real(value) else None

    def _ancestors(self, node: fx.Node, parameters: bool) -> set[fx.Node] | None:
        seen: set[fx.Node] = set()
        stack = [node]
        while stack:
            n = stack.pop()
            if n in seen or n in self.values:
                continue
            if (n, parameters) in self.refused or not self._runnable(n, parameters):
                self.refused.add((node, parameters))
                return None
            seen.add(n)
            stack.extend(n.all_input_nodes)
        return seen

    def _runnable(self, n: fx.Node, parameters: bool) -> bool:
        if n.op == "get_attr":
            return (parameters or str(n.target) not in self.params) and _real(self._attr(str(n.target)))
        if n.op in ("call_function", "call_method"):
            return not uses_rng(self.gm, n)
        if n.op == "call_module":
            state = self._module_state(str(n.target))
            return (parameters or not any(k in self.params for k in state)) and not uses_rng(self.gm, n) and all(
                _real(self.state.get(k)) for k in state)
        return False  # a placeholder without a value

    def _module_state(self, target: str) -> dict[str, str]:
        """The submodule's own parameter and buffer names (as it names them) -> the graph's names."""
        mod = self.gm.get_submodule(target)
        named = list(mod.named_parameters(remove_duplicate=False)) + list(mod.named_buffers(remove_duplicate=False))
        return {f"{target}.{name}": name for name, _ in named}

    def _call_module(self, target: str, args: tuple, kwargs: dict) -> Any:
        """The submodule run on real tensors: its state, fakes during a fake run, swapped for the real one."""
        mod = self.gm.get_submodule(target)
        swapped = []
        for full, name in self._module_state(target).items():
            *path, leaf = name.split(".")
            owner = mod.get_submodule(".".join(path)) if path else mod
            table = owner._parameters if leaf in owner._parameters else owner._buffers
            swapped.append((table, leaf, table[leaf]))
            table[leaf] = self.state[full]
        try:
            return mod(*args, **kwargs)
        finally:
            for table, leaf, value in swapped:
                table[leaf] = value

    def _attr(self, target: str) -> Any:
        if target in self.state:
            return self.state[target]
        value: Any = self.gm
        for part in target.split("."):
            value = getattr(value, part)
        return value


def _real(value: Any) -> bool:
    """No fake and no meta tensor in it."""
    return all(
        not (isinstance(t, torch.Tensor) and (t.device.type == "meta" or hasattr(t, "fake_mode")))
        for t in pytree.tree_leaves(value)
    )
