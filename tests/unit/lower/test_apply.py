"""Plan.apply / Plan.remove: checkpointing whole submodules of the user's own module, in place."""

import copy
import dataclasses

import pytest
import torch
from ckpt_planner import InputError, Plan, PlanMismatchError, optimize
from ckpt_planner.lower.apply import checkpoint_modules, checkpointed_modules, module_spans, remove_checkpointing
from ckpt_planner.plan import Region
from ckpt_planner.solvers import simulate
from ckpt_planner.verification import default_loss, measure_step

from tests.models.small import LOCAL, hf_bert
from tests.support.profiles import FLOP_TIMES


def _call(model, inputs):
    return model(*inputs) if isinstance(inputs, tuple) else model(**inputs)


def _step(model, inputs, seed=0):
    """One forward + backward from a fixed RNG state; returns (output, grads, buffers)."""
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(seed)
    out = _call(model, inputs)
    default_loss(out).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    return out, grads, buffers


def _assert_same_step(a, b):
    out_a, grads_a, bufs_a = a
    out_b, grads_b, bufs_b = b
    la = out_a if isinstance(out_a, torch.Tensor) else out_a.last_hidden_state
    lb = out_b if isinstance(out_b, torch.Tensor) else out_b.last_hidden_state
    assert torch.equal(la, lb)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name
    for name in bufs_a:
        assert torch.equal(bufs_a[name], bufs_b[name]), name


@pytest.mark.parametrize("name", ["tiny_gpt", "cnn"])
def test_apply_is_exact_in_place_and_remove_restores(name):
    model, inputs = LOCAL[name]()
    reference = copy.deepcopy(model)
    plan = optimize(model, inputs, activation_budget=0.85, solver="uniform", profile_config=FLOP_TIMES)
    keys = list(model.state_dict())
    params = [id(p) for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    app = plan.apply(model)
    assert app.modules and checkpointed_modules(model) == app.modules
    assert list(model.state_dict()) == keys  # no wrapper prefixes
    assert [id(p) for p in model.parameters()] == params
    assert app.predicted_peak_bytes == simulate(plan.problem, app.regions).peak_bytes
    # BatchNorm statistics updated once, dropout masks equal, gradients bitwise equal
    _assert_same_step(_step(model, inputs), _step(reference, inputs))
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.step()  # the optimizer made before apply still drives the same tensors
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    with torch.no_grad():
        for p, q in zip(model.parameters(), reference.parameters()):
            q.copy_(p)
    assert plan.remove(model) == app.modules
    assert checkpointed_modules(model) == () and all("forward" not in m.__dict__ for m in model.modules())
    assert list(model.state_dict()) == keys
    for (k, v), (k2, v2) in zip(model.state_dict().items(), reference.state_dict().items()):
        assert k == k2 and torch.equal(v, v2), k
    _assert_same_step(_step(model, inputs, seed=1), _step(reference, inputs, seed=1))


def test_module_aligned_plan_is_applied_exactly_and_saves_memory():
    model, inputs = LOCAL["mlp"]()
    plan = optimize(model, inputs, activation_budget=0.85, solver="uniform", profile_config=FLOP_TIMES)
    spans = module_spans(plan.problem, model)
    blocks = sorted(sp for sp, path in spans.items() if path.count(".") == 1)  # blocks.0 ... blocks.5
    assert [spans[sp] for sp in blocks] == [f"blocks.{i}" for i in range(6)]
    regions = tuple(Region(start=s, end=e, first_node="", last_node="", modules=(spans[(s, e)],)) for s, e in blocks)
    aligned = dataclasses.replace(plan, regions=regions, budget_bytes=None, module=None)
    app = aligned.apply(model)
    assert app.aligned and app.notes == ()
    assert app.modules == tuple(f"blocks.{i}" for i in range(6))
    sim = simulate(plan.problem, blocks)
    assert app.predicted_peak_bytes == sim.peak_bytes
    # measured: less than without checkpointing, and as the simulator predicts
    params = list(model.parameters())
    state = params + list(model.buffers())
    peak, _ = measure_step(model, inputs, {}, params, state, default_loss, torch.device("cpu"))
    aligned.remove(model)
    base, _ = measure_step(model, inputs, {}, params, state, default_loss, torch.device("cpu"))
    assert peak < base
    assert abs(peak - app.predicted_peak_bytes) <= 0.05 * peak, (peak, app.predicted_peak_bytes)


def test_hooks_fire_once_and_deepcopy_is_independent():
    model, inputs = LOCAL["cnn"]()
    reference = copy.deepcopy(model)
    calls = []
    model.blocks[1].register_forward_hook(lambda mod, args, out: calls.append(out.shape))
    checkpoint_modules(model, ["blocks.0", "blocks.1", "blocks.1.conv1"])  # nested is allowed
    _assert_same_step(_step(model, inputs), _step(reference, inputs))
    assert len(calls) == 1  # not again during the recompute
    clone = copy.deepcopy(model)
    assert checkpointed_modules(clone) == ("blocks.0", "blocks.1", "blocks.1.conv1")
    for p in model.parameters():
        p.grad = None
    _step(clone, inputs)
    assert all(p.grad is None for p in model.parameters())  # the clone's forward runs the clone
    assert all(p.grad is not None for p in clone.parameters())


def test_loaded_plan_applies_recorded_module_paths(tmp_path):
    model, inputs = LOCAL["tiny_gpt"]()
    reference = copy.deepcopy(model)
    plan = optimize(model, inputs, activation_budget=0.85, solver="uniform", profile_config=FLOP_TIMES)
    loaded = Plan.load(plan.save(tmp_path / "plan.json"))
    assert loaded.problem is None
    app = loaded.apply(model)
    recorded = {p for r in plan.regions for p in r.modules if not p.startswith("... ")}
    assert set(app.modules) == recorded
    assert app.predicted_peak_bytes is None and app.within_budget is None
    assert any("loaded from a file" in n for n in app.notes)
    _assert_same_step(_step(model, inputs), _step(reference, inputs))


def test_apply_errors_name_the_module():
    model, inputs = LOCAL["mlp"]()
    checkpoint_modules(model, ["blocks.0"])
    with pytest.raises(InputError, match="blocks.0"):
        checkpoint_modules(model, ["blocks.0"])
    with pytest.raises(PlanMismatchError, match="nope"):
        checkpoint_modules(model, ["nope"])
    with pytest.raises(InputError, match="root"):
        checkpoint_modules(model, [""])
    assert remove_checkpointing(model) == ("blocks.0",)
    model.blocks[2].gradient_checkpointing = True  # what transformers sets after gradient_checkpointing_enable()
    with pytest.raises(InputError, match="gradient_checkpointing_disable"):
        checkpoint_modules(model, ["blocks.0"])


def test_apply_hf_model_with_kwargs():
    model, inputs = hf_bert()  # layers are called with attention masks as keyword arguments
    reference = copy.deepcopy(model)
    model.train()
    reference.train()
    paths = [f"encoder.layer.{i}" for i in range(2)] + ["embeddings"]
    checkpoint_modules(model, paths)
    _assert_same_step(_step(model, inputs), _step(reference, inputs))
    assert remove_checkpointing(model) == ("embeddings", "encoder.layer.0", "encoder.layer.1")
