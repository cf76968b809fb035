"""Model + example inputs -> torch.fx.GraphModule.

`torch.fx.symbolic_trace` first (it keeps module calls as nodes, so graphs of
hand-written models read well); when it fails, or gives a graph whose output
differs from the model's, `torch.export.export(..., strict=False).module()`,
which handles transformers models. Capture happens in training mode.

A custom `torch.autograd.Function` becomes one graph node that calls its
`apply`, so its own backward runs (tracing into its forward would give the
autograd of the forward ops instead). Under torch.export the same node is
made through an opaque operator (functions.py); a Function it cannot stand for
(one writing in place, or taking a symbolic float) is refused rather than
planned with the wrong gradients.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from ..errors import CaptureError, InputError, UnplannableError
from ..model_state import ModelState
from .cache_outputs import register_cache_outputs
from .export_exact import match_eager_attention, recording_mask_skips
from .functions import function_node, opaque_functions, restore_functions
from .own_checkpoint import OwnCheckpoint, check_training_graph, recording_checkpoints
from .shapes import export_dynamic

logger = logging.getLogger("ckpt_planner.capture")

__all__ = ["Capture", "capture", "capture_as_on_meta", "normalize_inputs", "flatten_for_graph", "GraphTooLargeError",
           "MAX_GRAPH_NODES", "max_graph_nodes"]


@dataclass(frozen=True)
class Capture:
    """A captured graph and how it was obtained."""

    graph_module: fx.GraphModule
    method: str
    """'symbolic_trace' or 'export'."""
    fallback_reason: str | None
    """Why symbolic_trace was not used (None when it was)."""
    args: tuple
    kwargs: dict[str, Any] = field(default_factory=dict)
    builtin_checkpointing: tuple[str, ...] = ()
    """Module paths whose own checkpointing (HF `gradient_checkpointing_enable()`, timm
    `grad_checkpointing`, densenet `memory_efficient`) was switched off for the capture, so the
    graph holds the plain computation and a plan replaces that checkpointing instead of stacking on it."""
    own_checkpoints: tuple[OwnCheckpoint, ...] = ()
    """The model's own `torch.utils.checkpoint` calls (direct or through a library flag), which the
    graph inlines; with the nodes each covered where symbolic_trace recorded them."""
    dynamic_dims: bool = True
    """The graph takes other input sizes (symbolic_trace, or export with dynamic dimensions); False when
    export had to pin every dimension to the example's (see shapes.py)."""
    as_on_meta: bool = False
    """Captured as on the meta device (`capture_as_on_meta`): the graph of a model built there, run on
    the model's own tensors."""

    @property
    def on_meta(self) -> bool:
        """Whether the graph is the one the meta device gives: the inputs were meta tensors, or it was
        captured as on the meta device."""
        return self.as_on_meta or any(
            t.device.type == "meta" for t in pytree.tree_leaves((self.args, self.kwargs)) if isinstance(t, torch.Tensor)
        )


def normalize_inputs(example_inputs: Any, model: torch.nn.Module | None = None) -> tuple[tuple, dict[str, Any]]:
    """Example inputs as (args, kwargs): a tuple/list of args, a dict of kwargs, or one tensor.

    With None, the model's `example_input_array` attribute is used (the Lightning convention).
    """
    if example_inputs is None and model is not None:
        example_inputs = getattr(model, "example_input_array", None)
        if example_inputs is None:
            raise InputError(
                "example_inputs: none given and the model has no `example_input_array`; "
                "pass a tensor, a tuple of positional args or a dict of kwargs"
            )
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    raise InputError(
        f"example_inputs: expected a tensor, a tuple of args or a dict of kwargs, got {type(example_inputs).__name__}"
    )


def _key_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[0][:300] if lines else type(exc).__name__


def _same_outputs(a: Any, b: Any) -> bool:
    la, sa = pytree.tree_flatten(a)
    lb, sb = pytree.tree_flatten(b)
    if len(la) != len(lb):
        return False
    for x, y in zip(la, lb):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if isinstance(x, torch.Tensor):
            if x.shape != y.shape or x.dtype != y.dtype:
                return False
            if x.device.type != "meta" and not torch.equal(x, y):
                return False
    return True


@contextlib.contextmanager
def _autograd_functions(on_call) -> Iterator[None]:
    """Within: every `torch.autograd.Function.apply` goes through on_call(cls, apply, args, kwargs)."""
    Function = torch.autograd.Function
    original = Function.__dict__["apply"]

    def apply(cls, *args: Any, **kwargs: Any) -> Any:
        return on_call(cls, lambda *a, **k: original.__func__(cls, *a, **k), args, kwargs)

    Function.apply = classmethod(apply)
    try:
        yield
    finally:
        Function.apply = original


def _as_node(cls: type, run, args: tuple, kwargs: dict) -> Any:
    proxy = next((a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, fx.Proxy)), None)
    if proxy is None:
        return run(*args, **kwargs)
    return proxy.tracer.create_proxy("call_function", function_node(cls), args, kwargs)


MAX_GRAPH_NODES = 50_000
"""The most nodes a captured graph may have (CKPT_PLANNER_MAX_NODES sets another). The largest models
planned here have a few thousand (a 70B Llama's exported step, about 5,000); the planner's passes
grow faster than the graph, and a graph of hundreds of thousands of nodes runs for minutes without a word.
Past the bound, capture stops as it goes and says so in one line."""

MAX_NODES_ENV = "CKPT_PLANNER_MAX_NODES"


class GraphTooLargeError(UnplannableError):
    """The graph has more nodes than `max_graph_nodes()`: the model as given, not a failure (exit 2)."""


def max_graph_nodes() -> int:
    """The node bound in force: CKPT_PLANNER_MAX_NODES where it is a positive integer, else MAX_GRAPH_NODES."""
    import os

    raw = os.environ.get(MAX_NODES_ENV, "").strip()
    if not raw:
        return MAX_GRAPH_NODES
    if not raw.isdigit() or int(raw) <= 0:
        raise InputError(f"{MAX_NODES_ENV}: {raw[:40]!r} is not a positive whole number of graph nodes")
    return int(raw)


def _too_large(model: torch.nn.Module, limit: int, how: str) -> GraphTooLargeError:
    return GraphTooLargeError(
        f"cannot plan {type(model).__name__}: its graph has more than {limit:,} nodes ({how}), more than the "
        f"planner takes in one piece; plan it in parts (optimize(..., partial=True), or one block at a time), "
        f"or raise the bound with {MAX_NODES_ENV}=N if the time and memory are yours to spend"
    )


class _BoundedTracer(fx.Tracer):
    """symbolic_trace's tracer, stopping at `limit` nodes instead of recording a graph without bound."""

    def __init__(self, model: torch.nn.Module, limit: int) -> None:
        super().__init__()
        self._model, self._limit, self._nodes = model, limit, 0

    def create_node(self, *args: Any, **kwargs: Any) -> fx.Node:
        self._nodes += 1
        if self._nodes > self._limit:
            raise _too_large(self._model, self._limit, "stopped while tracing")
        return super().create_node(*args, **kwargs)


def _symbolic_trace(model: torch.nn.Module) -> fx.GraphModule:
    """`fx.symbolic_trace(model)` within the node bound."""
    tracer = _BoundedTracer(model, max_graph_nodes())
    graph = tracer.trace(model)
    return fx.GraphModule(tracer.root, graph, type(model).__name__)


def _trace(model: torch.nn.Module, args: tuple, kwargs: dict, calls: list[OwnCheckpoint]) -> fx.GraphModule:
    with _autograd_functions(_as_node), recording_checkpoints(model, calls):
        gm = _symbolic_trace(model)
    is_meta = any(t.device.type == "meta" for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
    if not is_meta:
        # symbolic_trace can silently bake in control flow; check it on the real inputs.
        with ModelState(model).preserved(), torch.no_grad():
            rng = torch.get_rng_state()
            expected = model(*args, **kwargs)
            torch.set_rng_state(rng)
            got = gm(*args, **kwargs)
        if not _same_outputs(expected, got):
            raise RuntimeError("the traced graph's output differs from the model's (control flow on the inputs)")
    return gm


def capture(model: torch.nn.Module, example_inputs: Any = None, *, method: str = "auto") -> Capture:
    """Capture `model` in training mode as an fx.GraphModule.

    method: 'auto' (symbolic_trace, then export), 'symbolic_trace' or 'export'.
    """
    if method not in ("auto", "symbolic_trace", "export"):
        raise InputError(f"method: {method!r} is not one of 'auto', 'symbolic_trace', 'export'")
    check_training_graph(model)
    args, kwargs = normalize_inputs(example_inputs, model)
    return _capture_call(model, args, kwargs, method)


def _capture_call(model: torch.nn.Module, args: tuple, kwargs: dict[str, Any], method: str) -> Capture:
    was_training = model.training
    model.train()
    try:
        called = _own_checkpoint_calls(model, args, kwargs)
        with builtin_checkpointing_off(model) as builtin:
            cap = _capture(model, args, kwargs, method, builtin)
    finally:
        model.train(was_training)
    traced = list(cap.own_checkpoints)  # the direct calls symbolic_trace saw, with their nodes
    left = list(called)
    for call in traced:
        match = next((c for c in left if c.module == call.module), None)
        if match is not None:
            left.remove(match)
    return dataclasses.replace(cap, own_checkpoints=tuple(traced + left))


def capture_as_on_meta(model: torch.nn.Module, example_inputs: Any = None, *, method: str = "auto") -> Capture:
    """Capture `model` as if it and its inputs had been built on the meta device, runnable where they live.

    A plan made on the meta device was made for the graph of that capture, which differs from one on a
    real device although the computation is the same: meta inputs export with static sizes (shapes.py),
    and a layout no-op on the real device is a copy on meta (the math-path attention's output is not
    contiguous after its transpose there, so `.contiguous()` records a node the fused kernels' layout
    elides). Re-capturing with the parameters, buffers and inputs swapped for meta tensors of the same
    shapes and strides gives that graph node for node, so the plan's regions apply as they are; the
    graph is then bound to the model's own tensors and its device arguments point at their device
    (a no-op layout node is as cheap there as in the real capture: it returns its input).
    """
    if method not in ("auto", "symbolic_trace", "export"):
        raise InputError(f"method: {method!r} is not one of 'auto', 'symbolic_trace', 'export'")
    check_training_graph(model)
    args, kwargs = normalize_inputs(example_inputs, model)
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    tensors += list(model.parameters()) + list(model.buffers())
    device = tensors[0].device if tensors else torch.device("cpu")
    memo: dict[int, torch.Tensor] = {}
    meta_args, meta_kwargs = pytree.tree_map_only(torch.Tensor, lambda t: _meta_like(t, memo), (args, kwargs))
    with _state_on_meta(model, memo):
        cap = _capture_call(model, meta_args, meta_kwargs, method)
    gm = cap.graph_module
    _rebind_state(gm, model)
    _empty_constants_to(gm, device)
    for sub in gm.modules():
        if isinstance(sub, fx.GraphModule):
            _retarget_devices(sub, torch.device("meta"), device)
    return dataclasses.replace(cap, args=args, kwargs=kwargs, as_on_meta=True)


def _meta_like(t: torch.Tensor, memo: dict[int, torch.Tensor]) -> torch.Tensor:
    """A meta tensor of t's shape, strides, dtype and kind (a Parameter stays one); one per object, so tied
    weights stay tied."""
    meta = memo.get(id(t))
    if meta is None:
        meta = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
        if isinstance(t, torch.nn.Parameter):
            meta = torch.nn.Parameter(meta, requires_grad=t.requires_grad)
        else:
            meta.requires_grad_(t.requires_grad)
        memo[id(t)] = meta
    return meta


@contextlib.contextmanager
def _state_on_meta(model: torch.nn.Module, memo: dict[int, torch.Tensor]) -> Iterator[None]:
    """Within: every parameter and buffer of `model` is a meta tensor of its shape; put back on exit."""
    swapped: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    try:
        for mod in model.modules():
            for table in (mod._parameters, mod._buffers):
                for name, t in list(table.items()):
                    if t is not None and t.device.type != "meta":
                        swapped.append((table, name, t))
                        table[name] = _meta_like(t, memo)
        yield
    finally:
        for table, name, t in swapped:
            table[name] = t


def _empty_constants_to(gm: fx.GraphModule, device: torch.device) -> None:
    """Put the graph's empty tensor constants (a key/value cache's initial `torch.tensor([])`, lifted by
    export) on `device`: made on meta they hold no values, so an empty tensor there is the same constant."""
    state = {id(t) for t in list(gm.parameters()) + list(gm.buffers())}
    for n in gm.graph.nodes:
        if n.op != "get_attr":
            continue
        *path, leaf = n.target.split(".")
        mod = gm
        for p in path:
            mod = getattr(mod, p, None)
        value = getattr(mod, leaf, None)
        if isinstance(value, torch.Tensor) and value.device.type == "meta" and value.numel() == 0 and id(value) not in state:
            setattr(mod, leaf, torch.empty(value.shape, dtype=value.dtype, device=device))


def _retarget_devices(gm: fx.GraphModule, old: torch.device, new: torch.device) -> None:
    """Point every `device=old` argument of the graph's nodes at `new`."""
    def swap(a: Any) -> Any:
        return new if isinstance(a, torch.device) and a == old else a

    changed = False
    for n in gm.graph.nodes:
        args, kwargs = fx.node.map_aggregate(n.args, swap), fx.node.map_aggregate(n.kwargs, swap)
        if args != n.args or kwargs != n.kwargs:
            n.args, n.kwargs, changed = args, kwargs, True
    if changed:
        gm.recompile()


def _own_checkpoint_calls(model: torch.nn.Module, args: tuple, kwargs: dict) -> list[OwnCheckpoint]:
    """The checkpoint calls one forward of the model as given makes (library flags left on).

    With gradients where a library flag is on: transformers >= 5.24 checkpoints a layer only when
    grad mode is on, and those layers keep little for backward. Elsewhere the forward runs without
    gradients, so that nothing is saved for a backward that never comes."""
    calls: list[OwnCheckpoint] = []
    flagged = any(m.__dict__.get(attr) is True for m in model.modules() for attr in _BUILTIN_FLAGS)
    with contextlib.suppress(Exception), ModelState(model).preserved(), torch.set_grad_enabled(flagged):
        with recording_checkpoints(model, calls):
            model(*args, **kwargs)
    return calls


def _capture(model: torch.nn.Module, args: tuple, kwargs: dict, method: str, builtin: tuple[str, ...]) -> Capture:
    reason = None
    max_graph_nodes()  # a malformed bound is the user's to fix, not a reason to try export
    if method in ("auto", "symbolic_trace"):
        try:
            calls: list[OwnCheckpoint] = []
            gm = _trace(model, args, kwargs, calls)
            return Capture(gm, "symbolic_trace", None, args, kwargs, builtin, tuple(calls))
        except GraphTooLargeError:
            raise  # export would record the same graph, again without bound
        except Exception as e:  # noqa: BLE001 - any trace failure means: try export
            if method == "symbolic_trace":
                raise CaptureError(f"symbolic_trace failed: {_key_line(e)}") from e
            reason = _key_line(e)
            # Normal for most library models (transformers): information, with the reason for whoever debugs.
            logger.debug("symbolic_trace failed (%s); capturing with torch.export", reason)
    register_cache_outputs(model)  # a DynamicCache in the output (cache_outputs.py)
    try:
        with ModelState(model).preserved(), opaque_functions(_autograd_functions) as functions, \
                recording_mask_skips() as skips:
            ep, dynamic = export_dynamic(model, args, kwargs)
        if functions.error:
            raise CaptureError(
                f"cannot capture {type(model).__name__}: symbolic_trace: {reason}; torch.export cannot keep the "
                f"custom autograd.Function {functions.error}, and tracing into it would lose its backward "
                "(wrong gradients). Make the model symbolic-traceable around it (symbolic_trace keeps the "
                "Function as one node)"
            )
        gm = ep.module()
        if len(gm.graph.nodes) > max_graph_nodes():
            raise _too_large(model, max_graph_nodes(), f"torch.export recorded {len(gm.graph.nodes):,}")
        restore_functions(gm, functions)  # each Function one node again, running its own backward
        _rebind_state(gm, model)
        match_eager_attention(gm, model, skips)  # the attention kernels eager runs (export_exact.py)
        return Capture(gm, "export", reason, args, kwargs, builtin, dynamic_dims=dynamic)
    except (CaptureError, GraphTooLargeError):
        raise
    except Exception as e:  # noqa: BLE001 - reported with both causes
        tried = f"symbolic_trace: {reason}; " if reason else ""
        raise CaptureError(
            f"cannot capture {type(model).__name__}: {tried}torch.export: {_key_line(e)}. "
            "Make the data-dependent construct static (fixed shapes, no branching on tensor values) "
            "or wrap it in a submodule and plan the rest"
        ) from e


def autocast_blocks(gm: fx.GraphModule) -> int:
    """How many `with torch.autocast(...)` blocks of the forward torch.export kept whole, as one node each
    (`wrap_with_autocast`): the planner sees each as a single op, so nothing inside one is checkpointed."""
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and getattr(n.target, "__name__", "") == "wrap_with_autocast")


def _rebind_state(gm: fx.GraphModule, model: torch.nn.Module) -> None:
    """Make the captured module hold the model's own parameter and buffer objects."""
    own = dict(model.named_parameters(remove_duplicate=False))
    own.update(model.named_buffers(remove_duplicate=False))
    for name, value in list(gm.named_parameters(remove_duplicate=False)) + list(
        gm.named_buffers(remove_duplicate=False)
    ):
        target = own.get(name)
        if target is None or target is value:
            continue
        *path, leaf = name.split(".")
        mod = gm
        for p in path:
            mod = getattr(mod, p)
        if isinstance(target, torch.nn.Parameter):
            mod._parameters[leaf] = target
        else:
            mod._buffers[leaf] = target


def flatten_for_graph(gm: fx.GraphModule, args: tuple, kwargs: dict) -> list[Any]:
    """The values of the graph's placeholders, in order, for (args, kwargs)."""
    codegen = gm.graph._codegen
    info = getattr(codegen, "pytree_info", None)
    if info is not None and info.in_spec is not None:
        from torch.fx._pytree import tree_flatten_spec

        return list(tree_flatten_spec((args, kwargs), info.in_spec))
    import inspect

    bound = inspect.signature(gm.forward).bind(*args, **kwargs)
    bound.apply_defaults()
    names = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    values = []
    for name in names:
        key = name.lstrip("*")
        values.append(bound.arguments.get(key))
    return values


# Attributes by which libraries switch on their own activation checkpointing.
_BUILTIN_FLAGS = ("gradient_checkpointing", "grad_checkpointing")


@contextlib.contextmanager
def builtin_checkpointing_off(model: torch.nn.Module) -> Iterator[tuple[str, ...]]:
    """Switch off the model's own activation checkpointing while inside; yield the module paths where it was on.

    Covers HF transformers (`gradient_checkpointing_enable()` sets `gradient_checkpointing=True`
    on each layer), timm (`grad_checkpointing`) and torchvision densenet (`memory_efficient`).
    Every flag is put back as it was on exit.
    """
    changed: list[tuple[str, torch.nn.Module, str]] = []
    for path, mod in model.named_modules():
        names = _BUILTIN_FLAGS + (("memory_efficient",) if "DenseLayer" in type(mod).__name__ else ())
        for attr in names:
            if mod.__dict__.get(attr) is True:
                changed.append((path or type(mod).__name__, mod, attr))
                setattr(mod, attr, False)
    try:
        yield tuple(dict.fromkeys(path for path, _, _ in changed))
    finally:
        for _, mod, attr in changed:
            setattr(mod, attr, True)


@contextlib.contextmanager
def training_mode(model: torch.nn.Module, mode: bool = True):
    was = model.training
    model.train(mode)
    try:
        yield
    finally:
        model.train(was)
