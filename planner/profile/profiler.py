"""Per-node costs of a captured graph: bytes saved for backward, output bytes, time, FLOPs.

`CostProfiler` (planner/profile/record.py) runs the graph several times for timing,
then once more with a `saved_tensors_hooks` pack hook around each node and a
live-storage counter; this module builds the CostGraph from that record. Storages are identified by their
StorageImpl, so a saved tensor is attributed to the node that allocated its
storage (Linear saves its input: that is the producer's memory) and counted
once. Parameters, buffers and graph inputs are not activations.

Gradients follow autograd: every node whose output requires grad has a
gradient of its output's size (in-place ops and views included), made by the
backward of its consumers. A reshaping view (view, transpose, permute...)
hands its gradient on to its base as a view, so its gradient *is* the
base's: the view gets none, and its consumers list the base among their
inputs, which makes the base's gradient live from the first of those
backward steps (attention's backward making the head views' gradients).

What the model of gradients cannot see (the backward's own temporaries) is
measured by one backward after the recording run: see planner/profile/backward.py.

In meta mode the same interpreter runs on fake tensors: byte figures are
exact, time comes from FLOPs and bytes moved (a roofline), nothing is run.
Tensors on the meta device (a model built under `torch.device("meta")`)
become fake CPU tensors, so each op takes the kernel a real run would take
(fused attention, not the meta device's float32 math path) and the bytes equal
a real CPU step's; one dispatch mode counts storages and FLOPs together.
An op whose output size depends on values (a masked loss's boolean index) takes the largest size it can
make there, or the size the example's values make where it has no largest (profile/dynamic_shapes.py);
the CostGraph's notes say which.

One concept, so one module over 500 lines: one recording run turned into the CostGraph (the recording is
record.py, node times timing.py, the backward's temporaries backward.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from ..capture.mutation import mutated_inputs, stale_reads, writes_by_schema, written_roots
from ..capture.rng import UNREPLAYABLE_META, rng_state_bytes, uses_rng
from ..capture.trace import Capture, flatten_for_graph
from ..errors import InputError
from ..lower.selective import PolicyCounter, dispatch_probe_contexts, saveable_flags, try_policy_costs
from ..model_state import rng_preserved
from ..solvers.problem import Cast
from .backward import measure_backward, with_backward_temps
from .dynamic_shapes import ExampleSizes, RealValues, ValueSizes, example_notes, size_notes, with_fake_mode
from .graph import CostGraph, NodeCost, StorageCost
from .memory import alive, block_bytes, storage_key, tensor_block_bytes, warm_device_libraries
from .record import CostProfiler, fake_of, meta_to_cpu, run_recording, strided_tensors
from .stagewise import measure_stages, stage_spans, with_stage_figures
from .timing import finish_profile, robust_times, with_fastest

__all__ = ["ProfileConfig", "CostProfiler", "profile", "fake_profile"]

_NOT_RECOMPUTABLE_MODULES = ("_guards_fn",)


@dataclass(frozen=True, kw_only=True)
class ProfileConfig:
    """How to measure the per-node costs."""

    warmup: int = 1
    """Untimed runs before timing (first-call overheads, allocator warm-up)."""
    repeats: int = 5
    """Timed runs; each node's time is the median of the fastest half (timing.robust_times)."""
    meta: bool = False
    """Run on fake tensors: exact bytes, FLOP-based time, nothing executed."""
    peak_flops: float | None = None
    """FLOP/s assumed in meta mode (default: 50e12 for cuda, 1e11 for cpu)."""
    bandwidth: float | None = None
    """Bytes/s assumed in meta mode (default: 2e12 for cuda, 2e10 for cpu)."""
    count_flops: bool = True
    """Record FLOPs per node with torch's FLOP counter."""
    flop_times: bool = False
    """Run the model (exact bytes, measured temporaries) but take each node's time from its FLOPs and
    bytes moved (the roofline of meta mode) instead of timing it: deterministic, so that plan choices
    do not follow timing noise (tests, re-checking a saved plan)."""
    allocator: bool = True
    """Read the allocator per node and per backward step (kernel workspaces); False: live tensors
    only, as on fake tensors, where there is no allocator."""
    anchor: bool = True
    """Replace measured times by one model fitted to them (timing.anchor_times): plans repeat run to run."""
    overheads: bool = True
    """Measure the cost of a checkpoint call and of selective-policy dispatch on the device."""
    timing_store: bool = True
    """Keep fitted times in the device's timing store and read them from it, so that a model plans the
    same on every run (planner.timing_store). False: measure afresh and store nothing."""
    bounded: bool | None = None
    """Profile a stage at a time (profile/stagewise.py): bytes on fake tensors, times and workspaces from
    each stage's own step on real tensors, so profiling needs one stage's step, not the whole step's.
    None: the planner decides, stage-wise once the plain step would not fit the budget; True: always;
    False: the whole step on real tensors (what every budget took before)."""

    @classmethod
    def or_default(cls, config: ProfileConfig | None) -> ProfileConfig:
        """`config`, or where none is given the default profile (node times measured on the device): the
        one place that default is made, so it changes in one place (the test suite takes FLOP times)."""
        return config if config is not None else ProfileConfig()


def _module_path(node: fx.Node) -> str:
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack")
    if stack:
        path = list(stack.values())[-1][0]
        return _clean_path(path)
    return ""


def _clean_path(path: str) -> str:
    # export paths look like "L['self'].layers[0].attn" or "layers.0.attn"
    path = path.replace("L['self'].", "").replace("L['self']", "")
    for a, b in (("[", "."), ("]", ""), ("'", "")):
        path = path.replace(a, b)
    return path.strip(".")


def profile(cap: Capture, config: ProfileConfig | None = None, *, device: torch.device | None = None,
            fake: tuple[CostGraph, Any] | None = None) -> CostGraph:
    """Measure every node of the captured graph; see the module docstring. `fake`: the graph's bytes on
    fake tensors (`fake_profile`) when they were taken already (a stage-wise profile starts from them)."""
    config = ProfileConfig.or_default(config)
    gm = cap.graph_module
    flat = flatten_for_graph(gm, cap.args, cap.kwargs)
    meta = (
        config.meta
        or any(t.device.type == "meta" for t in strided_tensors(flat))
        or any(p.device.type == "meta" for p in gm.parameters())
    )
    dev = device or next((t.device for t in strided_tensors(flat)), torch.device("cpu"))
    warm_device_libraries(dev)
    with rng_preserved():
        if meta:
            cost, (cached, ops) = _profile_fake(gm, flat, config, dev, ops_priced=False)
        elif config.bounded:
            cost, (cached, ops) = _profile_bounded(gm, flat, config, dev, fake)
        else:
            cost = _profile_real(gm, flat, config, dev)
            cached, ops = try_policy_costs(gm, flat)
        how = dict(anchor=config.anchor, overheads=config.overheads, timing_store=config.timing_store)
        flags = saveable_flags(gm)
        return finish_profile(cost, gm, flags, dispatch_probe_contexts, device=dev, cache=cached, ops=ops, **how)


def _external_keys(gm: fx.GraphModule, flat: list[Any]) -> dict[int, torch.Tensor]:
    ext: dict[int, torch.Tensor] = {}
    for t in list(gm.parameters()) + list(gm.buffers()) + strided_tensors(flat):
        ext[storage_key(t)] = t
    return ext


def _profile_real(gm: fx.GraphModule, flat: list[Any], config: ProfileConfig, dev: torch.device) -> CostGraph:
    if config.flop_times:
        if not config.count_flops:
            raise InputError("profile_config.flop_times: needs count_flops=True (FLOPs are what it times by)")
        prof = run_recording(gm, flat, count_flops=config.count_flops, allocator=config.allocator, sizes=ExampleSizes())
        cost = _with_example_sizes(_build(gm, flat, prof, None, method="flops", device=str(dev), config=config), prof)
        return with_backward_temps(cost, measure_backward(gm, prof))
    timer = CostProfiler(gm)
    if dev.type == "cuda":
        timer.sync = lambda: torch.cuda.synchronize(dev)
    for i in range(config.warmup + config.repeats):
        if i == config.warmup:
            timer.times.clear()
        timer.run(*flat, enable_io_processing=False)
        del timer.env
        timer.env = {}
    prof = run_recording(gm, flat, count_flops=config.count_flops, allocator=config.allocator, sizes=ExampleSizes())
    cost = _with_example_sizes(_build(gm, flat, prof, robust_times(timer.times), method="measured", device=str(dev)), prof)
    return with_backward_temps(with_fastest(cost, timer.times), measure_backward(gm, prof))


def _with_example_sizes(cost: CostGraph, prof: CostProfiler) -> CostGraph:
    """On real tensors a data-dependent size is the example's (a masked loss's selected rows): the notes say
    so, with the largest it could be (profile/dynamic_shapes.py)."""
    notes = example_notes(prof.sizes.found)
    return dataclasses.replace(cost, notes=(*cost.notes, *notes)) if notes else cost


def _profile_fake(
    gm: fx.GraphModule, flat: list[Any], config: ProfileConfig, dev: torch.device, *, ops_priced: bool
) -> tuple[CostGraph, tuple[dict[str, int] | None, dict[str, int] | None]]:
    """The cost graph on fake tensors and the selective-policy figures per node (cached bytes, aten ops).

    `ops_priced`: the op counts will price the policy's dispatch at a measured cost per op (a stage-wise
    profile on the device), so they come from a plain forward of their own, as `policy_costs` counts them on
    real tensors. Elsewhere (the meta device: nothing is timed, the cost per op is 0) both figures are
    counted in the recording run instead of a second forward; there an op that saves its own output for
    backward counts one op fewer (autograd's detach of it runs inside the recording's saved-tensor hook),
    while the cached bytes, which decide what may be kept, are the same."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    real_state = {
        n: t
        for n, t in list(gm.named_parameters(remove_duplicate=False)) + list(gm.named_buffers(remove_duplicate=False))
    }
    memo: dict[int, torch.Tensor] = {}
    fakes = {n: fake_of(fake_mode, t, memo) for n, t in real_state.items()}
    flat_fake = [fake_of(fake_mode, t, memo) if isinstance(t, torch.Tensor) else t for t in flat]
    # On fake tensors a forward costs about as much as the rest of the profile: where the counts price
    # nothing, the recording run counts them too (lower/selective.py's counter, watching it).
    policy = None if ops_priced else PolicyCounter()
    # Ops whose output size depends on values (a boolean-mask index in a masked loss): sized at their
    # largest, or from the example's real values where no largest exists (dynamic_shapes.py).
    no_values = "the meta device holds no values" if not all(_has_values(t) for t in (*flat, *real_state.values())) else ""
    sizes = ValueSizes(no_values=no_values)
    params = {n for n, _ in gm.named_parameters(remove_duplicate=False)}
    real = RealValues(gm, flat, real_state, params)
    # Swap parameters and buffers for fakes while the interpreter runs, then put them back.
    _swap_state(gm, fakes)
    try:
        prof = run_recording(gm, flat_fake, count_flops=config.count_flops, allocator=config.allocator,
                             fake_mode=fake_mode, watch=policy, sizes=sizes, real=real)
        prof.real = None  # the real values it computed (masks, labels): not held through the rest of the profile
        built = _build(gm, flat_fake, prof, None, method="flops", device=str(dev), config=config)
        built = with_backward_temps(built, measure_backward(gm, prof, with_fake_mode(fake_mode, sizes)))
        if sizes.found:
            built = dataclasses.replace(built, notes=(*built.notes, *size_notes(sizes.found, no_values)))
        if policy is None:
            with fake_mode, sizes.replaying():
                costs = try_policy_costs(gm, flat_fake, convert=meta_to_cpu)
        else:
            costs = (None, None) if policy.error is not None else (policy.bytes, policy.ops)
    finally:
        _swap_state(gm, real_state)
    return built, costs


def _has_values(t: Any) -> bool:
    return not isinstance(t, torch.Tensor) or t.device.type != "meta"


def fake_profile(cap: Capture, config: ProfileConfig) -> tuple[CostGraph, Any]:
    """The graph's bytes on fake tensors at the real shapes, before any time is measured: (the unfinished
    cost graph, FLOP times; the selective-policy figures). Nothing runs on the device."""
    gm = cap.graph_module
    flat = flatten_for_graph(gm, cap.args, cap.kwargs)
    dev = next((t.device for t in strided_tensors(flat)), torch.device("cpu"))
    with rng_preserved():
        return _profile_fake(gm, flat, config, dev, ops_priced=True)


def _profile_bounded(
    gm: fx.GraphModule, flat: list[Any], config: ProfileConfig, dev: torch.device, fake: tuple[CostGraph, Any] | None
) -> tuple[CostGraph, tuple[dict[str, int], dict[str, int]]]:
    """Bytes on fake tensors, then each stage's real figures (profile/stagewise.py)."""
    if config.flop_times and not config.count_flops:
        raise InputError("profile_config.flop_times: needs count_flops=True (FLOPs are what it times by)")
    cost, costs = fake if fake is not None else _profile_fake(gm, flat, config, dev, ops_priced=True)
    figures = measure_stages(gm, flat, cost, device=dev, warmup=config.warmup, repeats=config.repeats,
                             timed=not config.flop_times, allocator=config.allocator)
    return with_stage_figures(cost, figures, stage_spans(cost)), costs


def _swap_state(gm: fx.GraphModule, values: dict[str, torch.Tensor]) -> None:
    for name, value in values.items():
        *path, leaf = name.split(".")
        mod = gm
        for p in path:
            mod = getattr(mod, p)
        if leaf in mod._parameters:
            # A fake tensor cannot become an nn.Parameter; modules accept a plain tensor, which keeps the
            # parameter's requires_grad (frozen parameters have no gradient to count).
            mod._parameters[leaf] = value
        else:
            mod._buffers[leaf] = value


def _roofline(flops: float, nbytes: float, dev: str, config: ProfileConfig) -> float:
    cuda = dev.startswith("cuda")
    peak = config.peak_flops or (50e12 if cuda else 1e11)
    bw = config.bandwidth or (2e12 if cuda else 2e10)
    return max(flops / peak, nbytes / bw)


def _build(
    gm: fx.GraphModule,
    flat: list[Any],
    prof: CostProfiler,
    times: dict[str, float] | None,
    *,
    method: str,
    device: str,
    config: ProfileConfig | None = None,
) -> CostGraph:
    env = prof.env
    external = _external_keys(gm, flat)
    compute = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    casts = _cached_casts(prof, env, compute)
    external.update(dict.fromkeys(casts))
    params = {storage_key(p): p for p in gm.parameters() if p.requires_grad}
    index = {n.name: i for i, n in enumerate(compute)}
    table = _StorageTable(external)
    nodes: list[dict[str, Any]] = []
    param_reader: dict[int, int] = {}  # parameter storage key -> the last node that reads it
    grad_of: dict[str, int] = {}  # node name -> node whose output gradient its own gradient is (views)
    alloc_temp = _allocator_temps(prof)
    rng_bytes = rng_state_bytes(torch.device(device))
    stale = stale_reads(gm)  # reads a buffer the forward writes later: a recompute would see the new value
    for i, n in enumerate(compute):
        value = env[n]
        packed, peak_extra, kept_extra, flops = prof.events[n.name]
        reads, in_bytes = _reads(gm, n, i, env, table.owner, params, param_reader)
        base = _viewed_node(n, value, env, table.owner) if not mutated_inputs(gm, n) else None
        if base is not None:
            # A reshaping view (view, transpose, permute...): its backward hands the gradient on
            # as a view, so its gradient is its base's, made by the view's consumers' backward.
            grad_of[n.name] = grad_of.get(base.name, index[base.name])
        out_bytes, grad_bytes = table.add_outputs(i, value, viewed=base is not None)
        table.written(i, [t for a in mutated_inputs(gm, n) for t in strided_tensors(env.get(a))])
        table.add_saved(i, packed)
        table.read(reads, i)
        temp = max(0, peak_extra - kept_extra, alloc_temp.get(n.name, 0))
        fwd_time = (
            times.get(n.name, 0.0) if times is not None else _roofline(flops, in_bytes + out_bytes, device, config)
        )
        recomputable = _recomputable(gm, n, stale)
        nodes.append(
            {
                "name": n.name,
                "op": n.op,
                "target": _target_name(n),
                "module": _module_path(n),
                "time": fwd_time,
                "flops": float(flops),
                "out_bytes": out_bytes,
                "temp_bytes": temp,
                "grad_bytes": grad_bytes,
                # Data dependencies, plus the base of each reshaping view read: the gradient this
                # node's backward makes for the view is the base's gradient.
                "inputs": sorted(
                    {index[a.name] for a in n.all_input_nodes if a.name in index}
                    | {grad_of[a.name] for a in n.all_input_nodes if a.name in grad_of}
                ),
                "reads": sorted(reads),
                "recomputable": recomputable,
                "rng_state_bytes": rng_bytes if uses_rng(gm, n) else 0,
                "saved_tensors": len(packed),
                "shapes": [list(t.shape) for t in strided_tensors(value)][:4],
                "dtype": str(strided_tensors(value)[0].dtype).replace("torch.", "") if strided_tensors(value) else "",
            }
        )
    _mark_outputs(gm, env, index, table, nodes)
    return _cost_graph(gm, flat, nodes, table.storages, params, param_reader, method=method, device=device,
                       cast_bytes=sum(casts.values()), casts=_cast_costs(prof, casts, index))


def _cached_casts(prof: CostProfiler, env: dict, compute: list[fx.Node]) -> dict[int, int]:
    """Storage key -> bytes of the casts of parameters autocast made inside the nodes and keeps in its cache
    (record.AutocastCasts). A cast that is a node's own output is the graph's explicit `.to()`, which
    autocast does not cache: an activation like any other. Only casts still alive count: a freed one was
    not cached, and its storage key may since name another storage."""
    if prof.casts is None:
        return {}
    outputs = {storage_key(t) for n in compute if n in env for t in strided_tensors(env[n])}
    held = {storage_key(t) for t in alive(prof.casts.refs)}
    return {key: nbytes for key, nbytes in prof.casts.made.items() if key in held and key not in outputs}


def _cast_costs(prof: CostProfiler, casts: dict[int, int], index: dict[str, int]) -> tuple[Cast, ...]:
    """Each cached cast with the nodes that took it and those whose backward keeps it (a saved tensor of
    theirs is the cast or a view of it). A cast no node took stays counted with the parameters alone."""
    if not casts:
        return ()
    savers: dict[int, set[int]] = {}
    for name, i in index.items():
        for t in alive(prof.events[name][0]):
            if storage_key(t) in casts:
                savers.setdefault(storage_key(t), set()).add(i)
    out = []
    for key, nbytes in casts.items():
        readers = {index[name] for name in prof.casts.readers.get(key, ()) if name in index}
        if readers:
            out.append(Cast(nbytes=nbytes, readers=tuple(sorted(readers)),
                            savers=tuple(sorted(savers.get(key, set()) & readers))))
    return tuple(out)


def _backward_on_own_thread(device: str) -> bool:
    """Whether autograd runs this device's backward on a thread of its own (every device but the CPU, unless
    `torch.autograd.set_multithreading_enabled(False)`): there the first recompute empties autocast's cache."""
    if torch.device(device).type in ("cpu", "meta"):
        return False
    return bool(getattr(torch._C, "_is_multithreading_enabled", lambda: True)())


def _allocator_temps(prof: CostProfiler) -> dict[str, int]:
    """Per node, the allocator's peak while it ran above what it left allocated (bytes): kernel
    workspaces (oneDNN convolution, BLAS packing) that no tensor shows. Empty on fake tensors."""
    alloc_temp: dict[str, int] = {}
    for w in prof.meter.windows() if prof.meter is not None else ():
        alloc_temp[w.name] = max(alloc_temp.get(w.name, 0), w.peak - w.end)
    return alloc_temp


def _reads(
    gm: fx.GraphModule,
    n: fx.Node,
    i: int,
    env: dict,
    owner: dict[int, int],
    params: dict[int, torch.Tensor],
    param_reader: dict[int, int],
) -> tuple[list[int], int]:
    """The activation storages node `i` reads (storage indices, first read first) and the bytes of all its
    tensor inputs; records it as the last reader of each trainable parameter it reads (`param_reader`)."""
    reads: list[int] = []
    in_bytes = 0
    for arg in n.all_input_nodes:
        for t in strided_tensors(env.get(arg)):
            key = storage_key(t)
            in_bytes += t.numel() * t.element_size()
            if key in owner and owner[key] not in reads:
                reads.append(owner[key])
            if key in params:
                param_reader[key] = i
    if n.op == "call_module":
        for p in gm.get_submodule(n.target).parameters():
            if p.requires_grad:
                param_reader[storage_key(p)] = i
    return reads, in_bytes


class _StorageTable:
    """The activation storages found so far, each once, by storage key; parameters, buffers and graph
    inputs (`external`) are not activations."""

    def __init__(self, external: dict[int, torch.Tensor]) -> None:
        self.external = external
        self.owner: dict[int, int] = {}  # storage key -> storage index
        self.storages: list[dict[str, Any]] = []

    def _new(self, key: int, producer: int, nbytes: int, output: int = -1) -> None:
        self.owner[key] = len(self.storages)
        self.storages.append(
            {"producer": producer, "nbytes": nbytes, "last_use": producer, "saved_by": set(), "is_output": False,
             "output": output}
        )

    def add_outputs(self, i: int, value: Any, *, viewed: bool) -> tuple[int, int]:
        """Node `i`'s new output storages; returns its output bytes and the bytes of its output's gradient."""
        out_bytes, grad_bytes = 0, 0
        for position, t in enumerate(strided_tensors(value)):
            key = storage_key(t)
            if key in self.external or key in self.owner:
                # No new storage: an in-place op (relu_, add_) or a view of an activation. The
                # gradient of its output is still a new tensor of the output's size, made by the
                # consumers' backward (a view's backward hands it on to its base as a view).
                if not viewed and key in self.owner and t.requires_grad and (t.is_floating_point() or t.is_complex()):
                    grad_bytes += block_bytes(t.numel() * t.element_size(), t.device)
                continue
            nbytes = tensor_block_bytes(t)
            self._new(key, i, nbytes, output=position)  # which output holds it: offload finds it there
            out_bytes += nbytes
            if t.requires_grad and (t.is_floating_point() or t.is_complex()):
                grad_bytes += block_bytes(t.numel() * t.element_size(), t.device)
        return out_bytes, grad_bytes

    def add_saved(self, i: int, packed: Any) -> None:
        """What node `i`'s backward keeps (the pack hook's tensors): saved by `i`."""
        for t in alive(packed):
            key = storage_key(t)
            if key in self.external:
                continue
            if key not in self.owner:  # made and kept inside the op (a dropout mask, softmax stats)
                self._new(key, i, tensor_block_bytes(t))
            self.storages[self.owner[key]]["saved_by"].add(i)

    def written(self, i: int, tensors: list[torch.Tensor]) -> None:
        """Node `i` writes these tensors in place: the activation storages among them made earlier are
        flagged (no copy of them made before this write holds their value)."""
        for t in tensors:
            s = self.owner.get(storage_key(t))
            if s is not None and self.storages[s]["producer"] < i:
                self.storages[s]["written"] = True

    def read(self, reads: list[int], i: int) -> None:
        for s in reads:
            self.storages[s]["last_use"] = max(self.storages[s]["last_use"], i)


def _recomputable(gm: fx.GraphModule, n: fx.Node, stale: Any) -> bool:
    """Whether running `n` again in a recompute gives what its first run gave."""
    return not (
        (n.op == "call_module" and str(n.target) in _NOT_RECOMPUTABLE_MODULES)
        or n.meta.get(UNREPLAYABLE_META, False)  # a draw written aside (rrelu's noise): rng.py
        or (writes_by_schema(n) and any(a.op == "placeholder" for a in n.all_input_nodes))
        or any(r.op == "placeholder" for r in written_roots(gm, n))  # writes an input, maybe via a view
        or n in stale
    )


def _mark_outputs(
    gm: fx.GraphModule, env: dict, index: dict[str, int], table: _StorageTable, nodes: list[dict[str, Any]]
) -> None:
    """Flag the storages the graph returns and the nodes whose outputs it returns."""
    output_node = next(n for n in gm.graph.nodes if n.op == "output")
    for t in strided_tensors(env.get(output_node, None)) if output_node in env else []:
        key = storage_key(t)
        if key in table.owner:
            table.storages[table.owner[key]]["is_output"] = True
    for arg in output_node.all_input_nodes:
        if arg.name in index:
            nodes[index[arg.name]]["is_output"] = True


def _cost_graph(
    gm: fx.GraphModule,
    flat: list[Any],
    nodes: list[dict[str, Any]],
    storages: list[dict[str, Any]],
    params: dict[int, torch.Tensor],
    param_reader: dict[int, int],
    *,
    method: str,
    device: str,
    cast_bytes: int = 0,
    casts: tuple[Cast, ...] = (),
) -> CostGraph:
    """The CostGraph of the per-node and per-storage records; each parameter's gradient is counted at the
    last node that reads it (bytes). `cast_bytes`: autocast's cached casts of parameters, resident with them;
    `casts`: those of them the nodes took, with their readers and savers."""
    pgrad = [0] * len(nodes)
    for key, i in param_reader.items():
        p = params[key]
        pgrad[i] += p.numel() * p.element_size()
    node_costs = tuple(
        NodeCost(param_grad_bytes=pgrad[i], **{**d, "inputs": tuple(d["inputs"]), "reads": tuple(d["reads"])})
        for i, d in enumerate(nodes)
    )
    storage_costs = tuple(
        StorageCost(
            producer=d["producer"],
            nbytes=d["nbytes"],
            last_use=d["last_use"],
            saved_by=tuple(sorted(d["saved_by"])),
            is_output=d["is_output"],
            output=d.get("output", -1),
            written=d.get("written", False),
        )
        for d in storages
    )
    param_bytes = cast_bytes + sum(
        tensor_block_bytes(t)
        for t in {storage_key(t): t for t in list(gm.parameters()) + list(gm.buffers())}.values()
    )
    input_bytes = sum(tensor_block_bytes(t) for t in {storage_key(t): t for t in strided_tensors(flat)}.values())
    return CostGraph(
        nodes=node_costs,
        storages=storage_costs,
        param_bytes=param_bytes,
        input_bytes=input_bytes,
        time_source=method,
        device=device,
        casts=casts,
        casts_cleared=bool(casts) and _backward_on_own_thread(device),
    )


def _viewed_node(n: fx.Node, value: Any, env: dict, owner: dict[int, int]) -> fx.Node | None:
    """The input node whose activation `n` reshapes as a view (same storage, same numel), else None.

    Views that select part of a tensor (slice, select, split) are not reshaping views: their
    backward makes a new gradient of the whole base.
    """
    outs = strided_tensors(value)
    if len(outs) != 1 or not outs[0].requires_grad or storage_key(outs[0]) not in owner:
        return None
    out = outs[0]
    for a in n.all_input_nodes:
        ins = strided_tensors(env.get(a))
        if a.op not in ("placeholder", "get_attr") and len(ins) == 1 and storage_key(ins[0]) == storage_key(out):
            return a if ins[0].numel() == out.numel() and ins[0].dtype == out.dtype else None
    return None


def _target_name(n: fx.Node) -> str:
    t = n.target
    if isinstance(t, str):
        return t
    name = getattr(t, "__name__", None) or str(t)
    mod = getattr(t, "__module__", "") or ""
    if hasattr(t, "_schema"):
        return str(t._schema.name) + (
            "." + t._overloadname if getattr(t, "_overloadname", "default") != "default" else ""
        )
    return f"{mod}.{name}" if mod and not mod.startswith("torch._ops") else name
