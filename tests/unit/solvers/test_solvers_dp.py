"""`dp` on transformer-shaped graphs: side inputs read by every layer, stages cut at layer boundaries."""

from __future__ import annotations

import pytest
from ckpt_planner.solvers import InfeasibleBudgetError, Node, Problem, Storage, simulate, solve
from ckpt_planner.solvers.exact.dp import DPSearch
from ckpt_planner.solvers.exact.stages import _dp_stage_bounds, _module_cuts, _valley_cuts

H = 100_003  # bytes of one hidden state [B, T, C]; odd, so that sizes share no unit that gives few slots


def decoder(layers: int, hidden: int = H) -> Problem:
    """Pre-norm decoder layers on a residual stream, with a mask made once and read by every layer's attention.

    Like an exported Llama: the mask (and rotary tables) cross every cut between layers, so no position
    after the first layer is an articulation point. Node modules name the layer ('model.layers.3.mlp').
    """
    nodes: list[Node] = []
    storages: list[Storage] = []
    readers: list[list[int]] = []
    savers: list[list[int]] = []

    def add(name, module, nbytes, reads=(), saves=(), time=None, temp=0, recomputable=True, params=0):
        i = len(nodes)
        for t in reads:
            readers[t].append(i)
        for t in saves:
            savers[t].append(i)
        inputs = tuple(sorted({storages[t].producer for t in reads}))
        nodes.append(
            Node(
                name=name,
                time=(time if time is not None else nbytes * 1e-9),  # seconds
                temp_bytes=temp,
                grad_bytes=nbytes,
                param_grad_bytes=params,
                inputs=inputs,
                reads=tuple(reads),
                recomputable=recomputable,
                module=module,
            )
        )
        storages.append(Storage(producer=i, nbytes=nbytes, last_use=i))
        readers.append([])
        savers.append([])
        return len(storages) - 1

    h = add("embed", "model.embed_tokens", hidden, recomputable=False)
    mask = add("mask", "model", hidden // 4 + 1, time=1e-9)
    for k in range(layers):
        m = f"model.layers.{k}"
        n1 = add(f"norm1_{k}", f"{m}.input_layernorm", hidden, reads=(h,), saves=(h,))
        qkv = add(f"qkv_{k}", f"{m}.self_attn.qkv", 3 * hidden, reads=(n1,), saves=(n1,), params=4096)
        att = add(f"attn_{k}", f"{m}.self_attn", hidden, reads=(qkv, mask), saves=(qkv, mask), temp=2 * hidden)
        proj = add(f"proj_{k}", f"{m}.self_attn.o_proj", hidden, reads=(att,), saves=(att,), params=4096)
        r1 = add(f"add1_{k}", m, hidden + 2, reads=(h, proj))
        n2 = add(f"norm2_{k}", f"{m}.post_attention_layernorm", hidden, reads=(r1,), saves=(r1,))
        up = add(f"up_{k}", f"{m}.mlp.up_proj", 4 * hidden, reads=(n2,), saves=(n2,), params=8192)
        act = add(f"act_{k}", f"{m}.mlp.act_fn", 4 * hidden, reads=(up,), saves=(up,))
        down = add(f"down_{k}", f"{m}.mlp.down_proj", hidden, reads=(act,), saves=(act,), params=8192)
        h = add(f"add2_{k}", m, hidden, reads=(r1, down))
    add("head", "lm_head", 2 * hidden, reads=(h,), saves=(h,), params=4096)
    final = []
    for t, st in enumerate(storages):
        final.append(
            Storage(
                producer=st.producer,
                nbytes=st.nbytes,
                last_use=max([st.producer, *readers[t]]),
                saved_by=tuple(sorted(set(savers[t]))),
                is_output=t == len(storages) - 1,
            )
        )
    return Problem(nodes=tuple(nodes), storages=tuple(final), param_bytes=1 << 20, name=f"decoder{layers}")


def per_layer_regions(problem: Problem) -> list[tuple[int, int]]:
    """One region per decoder layer, from the node modules (what per-block checkpointing wraps)."""
    spans: dict[str, list[int]] = {}
    for i, node in enumerate(problem.nodes):
        if node.module.startswith("model.layers."):
            spans.setdefault(".".join(node.module.split(".")[:3]), []).append(i)
    return sorted((v[0], v[-1]) for v in spans.values())


def smallest_budget(problem: Problem, **options) -> int:
    try:
        solve(problem, problem.fixed_bytes, solver="dp", **options)
    except InfeasibleBudgetError as err:
        return err.smallest_bytes
    return problem.fixed_bytes


@pytest.mark.parametrize("selection", ["exact", "tighten"])
def test_dp_reaches_per_layer_memory_with_a_mask_read_by_every_layer(selection):
    problem = decoder(20)  # 203 nodes: more than max_stages, so stages are merged
    per_layer = simulate(problem, per_layer_regions(problem))
    assert per_layer.peak_bytes < simulate(problem, ()).peak_bytes
    assert smallest_budget(problem, selection=selection) <= per_layer.peak_bytes
    # At per-layer checkpointing's memory, dp recomputes about as much as it does or less (memory slots
    # are rounded, so exactly the per-layer plan may be just out of the table's reach).
    solution = solve(problem, per_layer.peak_bytes, solver="dp", selection=selection)
    assert solution.peak_bytes <= per_layer.peak_bytes
    assert solution.recompute_time <= 1.05 * per_layer.recompute_time


def test_stages_cut_at_every_layer_boundary():
    problem = decoder(12)
    bounds = _dp_stage_bounds(problem, 100)
    assert len(bounds) <= 100
    assert [u for u, _v in bounds] == sorted(u for u, _v in bounds)
    assert bounds[0][0] == 0 and bounds[-1][1] == problem.n - 1
    assert all(bounds[g][1] + 1 == bounds[g + 1][0] for g in range(len(bounds) - 1))
    ends = {v for _u, v in bounds}
    for s, e in per_layer_regions(problem):
        assert s - 1 in ends and e in ends  # every per-layer plan is a union of whole stages
    # Without module paths the layer boundaries are still found as the least cuts around them.
    anonymous = Problem(
        nodes=tuple(Node(**{**node.__dict__, "module": ""}) for node in problem.nodes),
        storages=problem.storages,
        param_bytes=problem.param_bytes,
    )
    assert _module_cuts(anonymous, 25) == []
    valleys = set(_valley_cuts(anonymous, anonymous.cut_bytes(), 3))
    assert all(e in valleys for _s, e in per_layer_regions(problem)[:-1])


def test_slots_are_fine_enough_for_a_hidden_state():
    """Counted at every cut it crosses, the mask used to inflate the table's range until a slot outgrew a
    hidden state and the cost of a cut rounded to nothing."""
    planner = DPSearch(decoder(12))
    assert not planner.exact_units
    assert planner.unit < H
    baseline = simulate(planner.problem, ()).peak_bytes - planner.problem.fixed_bytes
    assert (planner.S - 1) * planner.unit <= 2 * baseline


def test_no_checkpointing_when_it_fits():
    problem = decoder(3)
    base = simulate(problem, ()).peak_bytes
    for selection in ("exact", "tighten"):
        assert solve(problem, base, solver="dp", selection=selection).regions == ()


def test_tighten_uses_the_room_the_chain_overestimates():
    """The chain counts the mask once per stage; the plan returned uses the memory the simulator says is free."""
    problem = decoder(12)
    base = simulate(problem, ()).peak_bytes
    budget = problem.fixed_bytes + 3 * (base - problem.fixed_bytes) // 4
    tight = solve(problem, budget, solver="dp", selection="tighten")
    exact = solve(problem, budget, solver="dp", selection="exact")
    assert tight.peak_bytes <= budget
    assert tight.recompute_time <= 1.05 * exact.recompute_time
