"""Planning on the meta device: bytes equal a real run, no real memory, clear infeasibility, AdamW state."""

import ckpt_planner.solvers as solvers
import pytest
import torch
from ckpt_planner import ProfileConfig, optimize
from ckpt_planner.capture import capture
from ckpt_planner.distributed import optimizer_state_bytes
from ckpt_planner.errors import InfeasibleBudgetError
from ckpt_planner.profile import profile

FAST = ProfileConfig(warmup=0, repeats=1)


def _llama_config(**kw):
    from transformers import LlamaConfig

    base = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, use_cache=False)
    return LlamaConfig(**{**base, **kw})


def _meta_llama(cfg, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype)


def _per_node(cost):
    saved = cost.saved_bytes
    return {n.name: (saved[i], n.out_bytes, n.temp_bytes, n.grad_bytes, n.param_grad_bytes) for i, n in enumerate(cost.nodes)}


@pytest.fixture(scope="module")
def small_llama_profiles():
    from transformers import AutoModelForCausalLM

    cfg = _llama_config()
    torch.manual_seed(0)
    real_model = AutoModelForCausalLM.from_config(cfg)
    ids = torch.randint(0, 128, (2, 32))  # [B, T]
    # live tensors only: fake tensors have no allocator, so kernel workspaces are compared nowhere here
    real = profile(capture(real_model, {"input_ids": ids}), ProfileConfig(warmup=0, repeats=1, allocator=False))
    meta_model = _meta_llama(cfg)
    cap = capture(meta_model, {"input_ids": ids.to("meta")})
    fake = profile(cap, ProfileConfig(meta=True))
    wide = profile(cap, ProfileConfig(meta=True, peak_flops=1e12, bandwidth=1e30))
    return real, fake, wide


def test_meta_built_llama_bytes_equal_real_run(small_llama_profiles):
    real, fake, _ = small_llama_profiles
    r, f = _per_node(real), _per_node(fake)
    # Both graphs have dynamic dimensions; nodes only one capture has (a no-op .contiguous() after
    # attention on meta, shape arithmetic) own no bytes but shift the numbering of node names, so
    # the nodes that own bytes are compared in graph order.
    owning = lambda cost, rows: [(n.target, rows[n.name]) for n in cost.nodes if any(rows[n.name])]  # noqa: E731
    assert owning(real, r) == owning(fake, f)
    assert fake.total_saved_bytes == real.total_saved_bytes > 0
    assert fake.param_bytes == real.param_bytes and fake.param_grad_bytes == real.param_grad_bytes
    # attention saves its output and a logsumexp, as the fused kernel does, not [B, H, T, T] matrices
    sdpa = [i for i, n in enumerate(fake.nodes) if "scaled_dot_product" in n.target]
    assert sdpa and all(fake.saved_bytes[i] < 2 * 4 * 32 * 32 * 4 for i in sdpa)


def test_meta_time_positive_and_proportional_to_flops(small_llama_profiles):
    real, fake, wide = small_llama_profiles
    assert fake.time_source == "flops" and fake.total_time > 0
    assert all(n.time >= 0 for n in fake.nodes)
    rflops = {n.name: n.flops for n in real.nodes}
    for n in fake.nodes:
        if n.name in rflops and "scaled_dot_product" not in n.target:
            assert n.flops == rflops[n.name], n.name
    attention = [n for n in fake.nodes if "scaled_dot_product" in n.target]
    assert all(n.flops > 0 for n in attention)  # counted like CUDA flash attention
    # with memory bandwidth out of the way, time is FLOPs / peak for every node that has FLOPs
    flop_nodes = [n for n in wide.nodes if n.flops > 0]
    assert len(flop_nodes) >= 14
    assert all(n.time == pytest.approx(n.flops / 1e12, rel=1e-9) for n in flop_nodes)
    # and with the defaults, no node takes less than its FLOPs at peak
    assert all(n.time >= n.flops / 1e11 * (1 - 1e-9) for n in fake.nodes)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * 4096


@pytest.fixture(scope="module")
def mid_llama():
    cfg = _llama_config(num_hidden_layers=4, hidden_size=1024, intermediate_size=2752, num_attention_heads=8,
                        num_key_value_heads=8, vocab_size=8000, max_position_embeddings=2048)
    model = _meta_llama(cfg, torch.bfloat16)
    inputs = {"input_ids": torch.zeros(4, 2048, dtype=torch.long, device="meta")}  # [B, T]
    rss0 = _rss_bytes()
    cost = profile(capture(model, inputs), ProfileConfig(meta=True))
    problem = cost.to_problem(optimizer_bytes=optimizer_state_bytes(model, "adamw"))
    base = solvers.simulate(problem, ())
    with pytest.raises(InfeasibleBudgetError) as info:  # below parameters + inputs + optimizer state
        solvers.solve(problem, problem.fixed_bytes // 2, "uniform")
    smallest = info.value
    budget = (smallest.smallest_bytes + base.peak_bytes) // 2
    solution = solvers.solve(problem, budget, "uniform")
    return model, inputs, cost, problem, base, budget, solution, smallest, _rss_bytes() - rss0


def test_mid_llama_planned_on_meta_without_real_memory(mid_llama):
    model, _, cost, problem, base, budget, solution, _, rss_growth = mid_llama
    real_step_bytes = 2 * cost.param_bytes + cost.total_saved_bytes  # parameters, gradients, activations
    state = list(model.parameters()) + list(model.buffers())
    assert cost.param_bytes == sum(t.numel() * t.element_size() for t in state)
    assert real_step_bytes > 1.5e9
    assert rss_growth < real_step_bytes / 5, (rss_growth, real_step_bytes)
    assert all(p.device.type == "meta" for p in model.parameters())
    weights = sum(p.numel() * 2 for p in model.parameters())
    assert problem.optimizer_bytes == 2 * weights  # AdamW: exp_avg and exp_avg_sq in bf16
    assert base.peak_bytes > budget >= solution.peak_bytes and solution.regions
    assert solution.stats["breakdown"]["optimizer"] == 2 * weights


def test_optimize_on_meta_matches_the_solver(mid_llama):
    model, inputs, _, _, _, budget, solution, _, _ = mid_llama
    plan = optimize(model, inputs, device="meta", budget_bytes=budget, solver="uniform", optimizer="adamw")
    assert plan.time_source == "flops"
    assert plan.predicted_peak_bytes == solution.peak_bytes <= budget
    assert plan.breakdown["optimizer"] == optimizer_state_bytes(model, "adamw")


def test_budget_below_fixed_memory_names_a_feasible_smallest(mid_llama):
    model, inputs, cost, problem, _, _, _, error, _ = mid_llama
    below = problem.fixed_bytes // 2
    smallest = error.smallest_bytes
    assert error.budget_bytes == below and f"{smallest} bytes" in str(error)
    assert smallest > problem.fixed_bytes + cost.param_grad_bytes  # gradients and some activations on top
    fits = solvers.solve(problem, smallest, "uniform")
    assert fits.peak_bytes <= smallest
    with pytest.raises(InfeasibleBudgetError):
        optimize(model, inputs, device="meta", budget_bytes=below, solver="uniform", optimizer="adamw")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_adamw_state_bytes_match_torch(dtype):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).to(dtype)
    model[0].bias.requires_grad_(False)  # frozen: no state
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    model(torch.randn(8, 16, dtype=dtype)).sum().backward()
    opt.step()
    moments = sum(t.numel() * t.element_size() for s in opt.state.values() for k, t in s.items() if k != "step")
    steps = [s["step"] for s in opt.state.values()]
    # PyTorch keeps exp_avg and exp_avg_sq in the parameter's dtype; `step` is a 4-byte CPU scalar per parameter
    assert all(t.dtype == dtype for s in opt.state.values() for k, t in s.items() if k != "step")
    assert optimizer_state_bytes(model, "adamw") == moments == optimizer_state_bytes(model, opt)
    assert all(t.numel() == 1 and t.element_size() == 4 for t in steps)


def test_frozen_parameters_have_no_gradient_in_meta_mode():
    from tests.models.small import mlp

    model, inputs = mlp()
    for p in model.blocks[0].parameters():
        p.requires_grad_(False)
    cap = capture(model, inputs)
    real = profile(cap, FAST)
    fake = profile(cap, ProfileConfig(meta=True))
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    assert real.param_grad_bytes == fake.param_grad_bytes == trainable
    assert [n.param_grad_bytes for n in real.nodes] == [n.param_grad_bytes for n in fake.nodes]
