"""GraphModule + recomputed regions -> checkpointed GraphModule.

Each region becomes a `CheckpointRegion` submodule (`checkpoint_0`, nested
ones `checkpoint_0_1`) that calls its piece of the graph through
`torch.utils.checkpoint.checkpoint(..., use_reentrant=False,
preserve_rng_state=True)`. A region owns no parameters: its code reads them
from the root module, so the checkpointed module shares the original's
parameter and buffer objects and has the same `state_dict` keys. Buffers a
region touches (BatchNorm running statistics, `num_batches_tracked`) are
put back after a recompute, so they are updated once per step.

In-place ops are checked at the region boundaries: checkpoint keeps a
region's inputs and re-reads them in backward, so a region that writes into
one of its inputs (`ReLU(inplace=True)` on the output of the node before it,
`add_`, `x[:, 0] = ...` through a view) would recompute from the changed
value. Such a region's start is moved past the writing node (the cut moves;
the op runs outside, as in the model), and a region whose input is written
later, outside it, is dropped. `rewrite_notes` on the result says what moved.

The checkpointed module keeps a reference to the model: in eval mode it
calls the model itself (eval mode checkpoints nothing, and an exported graph
has the training flag of dropout and BatchNorm baked in).
"""

from __future__ import annotations

import contextlib
import copy
import operator
import warnings
from collections.abc import Iterator, Sequence

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import checkpoint

from ..capture.mutation import COMPUTE_OPS, compute_nodes, view_root, written_roots
from ..capture.rng import uses_rng
from .fastcode import bound_forward, switched_forward
from .offload import OffloadHooks, OffloadTarget, place_marks

__all__ = ["CheckpointRegion", "CheckpointedModule", "rewrite", "safe_regions"]

class CheckpointRegion(torch.nn.Module):
    """A run of graph nodes executed under non-reentrant activation checkpointing."""

    def __init__(
        self,
        graph: fx.Graph,
        name: str,
        buffer_names: Sequence[str],
        random: bool = True,
        saved_positions: frozenset[int] = frozenset(),
    ) -> None:
        super().__init__()
        self.random = random
        """Draws random numbers: the generator state is saved so the recompute draws the same."""
        self.region_name = name
        self.saved_positions = frozenset(saved_positions)
        """Positions (among the region's compute nodes) whose outputs a selective policy keeps."""
        self.dispatch_probe = False
        """Timing calibration only: run the whole region under the kept-node mode, keeping nothing."""
        self.graph = graph
        python_code = graph.python_code(root_module="self")
        self.code = python_code.src
        from torch.fx.graph_module import _forward_from_src

        # fx's code for torch.compile to trace; the same code with aten calls bound to their operators otherwise
        object.__setattr__(self, "_traced_fn", _forward_from_src(python_code.src, python_code.globals))
        object.__setattr__(self, "_fn", bound_forward(graph))
        object.__setattr__(self, "_root", None)
        self.buffer_names = tuple(buffer_names)

    def bind(self, root: torch.nn.Module) -> None:
        object.__setattr__(self, "_root", root)

    def _run(self, *args):
        return self._fn(self._root, *args)

    def _traced_run(self, *args):
        return self._traced_fn(self._root, *args)

    def _contexts(self):
        if self.dispatch_probe:
            from .selective import dispatch_probe_contexts

            return dispatch_probe_contexts(_restore_buffers(self._root, self.buffer_names))
        if self.saved_positions:
            from .selective import selective_contexts

            return selective_contexts(self.saved_positions, _restore_buffers(self._root, self.buffer_names))
        return contextlib.nullcontext(), _restore_buffers(self._root, self.buffer_names)

    def forward(self, *args):
        if not torch.is_grad_enabled():  # eval / no_grad: nothing is saved, nothing to recompute
            return self._traced_run(*args) if torch.compiler.is_compiling() else self._run(*args)
        if torch.compiler.is_compiling():
            # The compiled backward recomputes without re-applying buffer mutations,
            # and dynamo accepts no custom context_fn (it fails at compile time).
            return checkpoint(self._traced_run, *args, use_reentrant=False, preserve_rng_state=self.random)
        # checkpoint saves each tensor argument through the saved-tensor hooks in force (a parent region's,
        # which drop it until the parent's recompute), but holds any other argument as it is: a tuple of
        # tensors (a multi-output node's value) would keep all of them alive from the forward on.
        flat, spec = pytree.tree_flatten(args)
        return checkpoint(
            self._run_flat, spec, *flat, use_reentrant=False, preserve_rng_state=self.random,
            context_fn=self._contexts,
        )

    def _run_flat(self, spec, *flat):
        return self._run(*pytree.tree_unflatten(list(flat), spec))

    def __deepcopy__(self, memo):
        new = CheckpointRegion(
            copy.deepcopy(self.graph, memo), self.region_name, self.buffer_names, self.random, self.saved_positions
        )
        memo[id(self)] = new
        new.dispatch_probe = self.dispatch_probe
        new.bind(copy.deepcopy(self._root, memo) if self._root is not None else None)
        return new

    def extra_repr(self) -> str:
        return f"{self.region_name}: {sum(1 for n in self.graph.nodes if n.op in COMPUTE_OPS)} nodes"


@contextlib.contextmanager
def _restore_buffers(root: torch.nn.Module, names: Sequence[str]) -> Iterator[None]:
    """During a recompute: put the buffers back as they were (BatchNorm must not update twice)."""
    saved = []
    for name in names:
        buf = root.get_buffer(name)
        if buf is not None:
            saved.append((buf, buf.detach().clone()))
    try:
        yield
    finally:
        with torch.no_grad():
            for buf, value in saved:
                buf.copy_(value)


def _attr_path(gm: torch.nn.Module, target: str) -> object:
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


class CheckpointedModule(fx.GraphModule):
    """The checkpointed GraphModule; in eval mode it runs the original model (when it has one).

    Its forward runs the graph's code with aten calls bound to their operators (`fastcode.py`), and
    fx's own code while `torch.compile` traces it.
    """

    def recompile(self):
        result = super().recompile()
        cls = type(self)  # fx makes a class per instance, and recompile sets its forward
        cls.forward = switched_forward(cls.forward, bound_forward(self.graph))
        return result

    def __call__(self, *args, **kwargs):
        model = self.__dict__.get("_original")
        if self.training or model is None:
            guard = self.__dict__.get("shape_guard")  # shapes.ShapeGuard: inputs above the planned shape
            if guard is not None:
                args, kwargs = guard.bind(args, kwargs)
                other = guard.module_for(args, kwargs)
                if other is not None:
                    return other(*args, **kwargs)
            hooks = self.__dict__.get("offload_hooks")  # offload.py: the plan's offloaded activations
            if hooks is not None:
                with hooks.step():
                    return super().__call__(*args, **kwargs)
            return super().__call__(*args, **kwargs)
        modes = [(m, m.training) for m in model.modules()]
        model.eval()
        try:
            return model(*args, **kwargs)
        finally:
            for m, mode in modes:
                m.training = mode


def rewrite(
    gm: fx.GraphModule,
    regions: Sequence[tuple[int, int]],
    *,
    model: torch.nn.Module | None = None,
    saved: Sequence[int] = (),
    offload: Sequence[OffloadTarget] = (),
) -> fx.GraphModule:
    """Return a new GraphModule running `regions` (compute-node index ranges) under checkpoint.

    `saved`: compute-node indices inside regions without nested ones whose outputs the region keeps
    (a selective region, see `selective.py`); saved nodes outside such a region are ignored.

    The result shares every parameter, buffer and submodule of `gm`; when
    `model` is given, any of its state that the graph does not reference is
    attached too, so `state_dict` keys match the model's, and eval-mode calls
    go to `model`. Regions that would recompute from an input written in place
    are adjusted first (see `safe_regions`); `result.rewrite_notes` lists the changes.

    `offload`: node outputs whose storages the step copies to host in the forward and fetches back for
    the backward (`offload.py`); the result then runs its training calls under `result.offload_hooks`.
    """
    compute = compute_nodes(gm.graph)
    saved_nodes = {compute[i] for i in saved}
    regions, notes = safe_regions(gm, regions)
    regions = sorted(set(regions), key=lambda r: (r[0], -r[1]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # pytree spec deprecation noise on deepcopy
        new_gm = CheckpointedModule(gm, copy.deepcopy(gm.graph))
    object.__setattr__(new_gm, "_original", model)
    object.__setattr__(new_gm, "rewrite_notes", tuple(notes))
    for attr in ("_in_spec", "_out_spec", "meta"):
        if hasattr(gm, attr) and not hasattr(new_gm, attr):
            setattr(new_gm, attr, getattr(gm, attr))
    if model is not None:
        _attach_missing_state(new_gm, model)
    state_buffers = {id(b): name for name, b in new_gm.named_buffers(remove_duplicate=False)}

    tree = _region_tree(regions)
    new_graph = fx.Graph()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        new_graph._codegen = copy.deepcopy(gm.graph._codegen)
    env: dict[fx.Node, fx.Node] = {}
    made: list[CheckpointRegion] = []

    def emit(dst: fx.Graph, nodes: list[fx.Node], subtree: list, prefix: str, local: dict) -> None:
        """Copy `nodes` into dst; regions of `subtree` become checkpoint_* calls."""
        owner: dict[fx.Node, int] = {}
        for r, ((s, e), _) in enumerate(subtree):
            for m in compute[s : e + 1]:
                owner[m] = r
        done: set[int] = set()
        for n in nodes:
            r = owner.get(n)
            if r is not None:
                if r not in done:
                    done.add(r)
                    (s, e), kids = subtree[r]
                    name = f"{prefix}_{len(done) - 1}"
                    _emit_region(dst, [m for m in nodes if owner.get(m) == r], kids, name, local)
                continue
            if n in local:
                continue
            local[n] = dst.node_copy(n, lambda a: local[a])

    def _emit_region(dst: fx.Graph, inside: list[fx.Node], kids: list, name: str, outer: dict) -> None:
        members = set(inside)
        inputs: list[fx.Node] = []
        attrs: list[fx.Node] = []
        for m in inside:
            for a in m.all_input_nodes:
                if a in members:
                    continue
                if a.op == "get_attr":
                    if a not in attrs:
                        attrs.append(a)
                elif a not in inputs:
                    inputs.append(a)
        outputs = [m for m in inside if any(u not in members for u in m.users)]
        sub = fx.Graph()
        local: dict[fx.Node, fx.Node] = {}
        for a in inputs:
            local[a] = sub.placeholder(a.name)
        for a in attrs:
            local[a] = sub.get_attr(a.target)
        emit(sub, inside, kids, name, local)
        sub.output(local[outputs[0]] if len(outputs) == 1 else tuple(local[o] for o in outputs))
        buffers = _touched_buffers(new_gm, inside, state_buffers)
        positions: frozenset[int] = frozenset()
        if not kids and any(m in saved_nodes for m in inside):
            from .selective import mark_kept

            positions = frozenset(p for p, m in enumerate(m for m in inside if m.op in COMPUTE_OPS) if m in saved_nodes)
            mark_kept(sub, positions)
        region = CheckpointRegion(sub, name, buffers, any(uses_rng(gm, m) for m in inside), positions)
        new_gm.add_submodule(name, region)
        made.append(region)
        call = dst.call_module(name, tuple(outer[a] for a in inputs))
        if len(outputs) == 1:
            outer[outputs[0]] = call
        else:
            for j, o in enumerate(outputs):
                outer[o] = dst.call_function(operator.getitem, (call, j))
        for o in outputs:
            if o in outer:
                outer[o].meta = dict(o.meta)

    emit(new_graph, list(gm.graph.nodes), tree, "checkpoint", env)
    if offload:  # marks at the top level only: inside a region, checkpoint's own hooks take every saved tensor
        in_regions = {compute[i] for s, e in regions for i in range(s, e + 1)}
        notes += place_marks(new_graph, list(gm.graph.nodes), env, in_regions, offload)
        object.__setattr__(new_gm, "rewrite_notes", tuple(notes))
        object.__setattr__(new_gm, "offload_hooks", OffloadHooks(offload))
    new_gm.graph = new_graph
    for region in made:
        region.bind(new_gm)
    new_gm.recompile()
    return new_gm


def _region_tree(regions: list[tuple[int, int]]) -> list:
    """Nested list [((s, e), children), ...] from regions sorted outer-first."""
    root: list = []
    stack: list[tuple[tuple[int, int], list]] = []
    for r in regions:
        while stack and stack[-1][0][1] < r[0]:
            stack.pop()
        entry = (r, [])
        (stack[-1][1] if stack else root).append(entry)
        stack.append(entry)
    return root


def _touched_buffers(gm: fx.GraphModule, nodes: list[fx.Node], state_buffers: dict[int, str]) -> list[str]:
    names: list[str] = []
    for n in nodes:
        if n.op == "call_module":
            mod = gm.get_submodule(n.target)
            for b in mod.buffers():
                if id(b) in state_buffers:
                    names.append(state_buffers[id(b)])
        for a in n.all_input_nodes:
            if a.op == "get_attr":
                obj = _attr_path(gm, a.target)
                if isinstance(obj, torch.Tensor) and id(obj) in state_buffers:
                    names.append(state_buffers[id(obj)])
    return sorted(set(names))


def _attach_missing_state(gm: fx.GraphModule, model: torch.nn.Module) -> None:
    """Give gm every parameter and buffer of model it lacks, under the same name and object."""
    for name, _ in list(gm.named_buffers(remove_duplicate=False)):  # graph copies make buffers persistent
        *path, leaf = name.split(".")
        try:
            owner = model.get_submodule(".".join(path)) if path else model
        except AttributeError:
            continue
        if leaf in owner._non_persistent_buffers_set:
            gm.get_submodule(".".join(path))._non_persistent_buffers_set.add(leaf)
    have = set(gm.state_dict().keys()) | {n for n, _ in gm.named_parameters(remove_duplicate=False)}
    for name, value in list(model.named_parameters(remove_duplicate=False)) + list(
        model.named_buffers(remove_duplicate=False)
    ):
        if name in have:
            continue
        *path, leaf = name.split(".")
        mod: torch.nn.Module = gm
        for p in path:
            if not hasattr(mod, p) or not isinstance(getattr(mod, p), torch.nn.Module):
                mod.add_module(p, torch.nn.Module())
            mod = getattr(mod, p)
        if isinstance(value, torch.nn.Parameter):
            mod.register_parameter(leaf, value)
        else:
            owner = model.get_submodule(".".join(path)) if path else model
            mod.register_buffer(leaf, value, persistent=leaf not in owner._non_persistent_buffers_set)


# -- in-place ops at region boundaries ---------------------------------------------


def safe_regions(
    gm: fx.GraphModule, regions: Sequence[tuple[int, int]]
) -> tuple[list[tuple[int, int]], list[str]]:
    """Regions moved so that none recomputes from a tensor written in place; notes say what moved.

    A region that writes (directly or through a view) into a tensor made outside it starts after
    the last such write; a region whose input is written in place after it is dropped.
    """
    compute = compute_nodes(gm.graph)
    pos = {n: i for i, n in enumerate(compute)}
    # Buffers (get_attr) are written by BatchNorm in exported graphs; they are restored after a recompute.
    writes = [[r for r in written_roots(gm, n) if r.op != "get_attr"] for n in compute]
    notes: list[str] = []
    pending = sorted({(int(s), int(e)) for s, e in regions}, key=lambda r: (r[0], -r[1]))
    done: list[tuple[int, int]] = []
    while pending:
        s, e = pending.pop(0)
        orig = (s, e)
        for outer in done:  # stay inside (or outside) every region already placed
            if outer[0] > s and outer[0] <= e <= outer[1]:
                s = outer[0]
        moved = True
        while moved and s <= e:
            moved = False
            for i in range(e, s - 1, -1):
                if any(pos.get(r, -1) < s for r in writes[i]):
                    notes.append(
                        f"region {compute[orig[0]].name}..{compute[orig[1]].name}: starts after "
                        f"{compute[i].name}, which writes in place into a tensor made before the region"
                    )
                    s, moved = i + 1, True
                    break
        if s > e:
            continue
        inside = set(compute[s : e + 1])
        inputs = {view_root(a) for m in inside for a in m.all_input_nodes if a not in inside and a.op != "get_attr"}
        later = next((compute[j] for j in range(e + 1, len(compute)) if inputs & set(writes[j])), None)
        if later is not None:
            notes.append(
                f"region {compute[s].name}..{compute[e].name} dropped: {later.name} writes in place into "
                "one of its inputs after it, so it could not be recomputed"
            )
            continue
        done.append((s, e))
    return done, notes
