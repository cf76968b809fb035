"""A plan made on the meta device rebuilds on the real model, exactly as planned.

Whoever plans a model too large for the planning machine builds it under `torch.device("meta")`, plans
and saves there, and rebuilds the saved plan on the real model where it trains. The meta device gives
another graph for the same computation: its inputs export with static sizes, and a layout no-op on the
real device is a copy on meta (Llama's SDPA output after its transpose), so node names and positions
shift and the fingerprint differs. The rebuild captures the real model as on the meta device: the
plan's own regions, a step bitwise equal to the model's, within the predicted peak; a model that
computes something else is still refused in one line.
"""

from __future__ import annotations

import json

import pytest
import torch
from ckpt_planner import Plan, PlanMismatchError, Planner
from ckpt_planner.capture.rng import rng_state_bytes
from ckpt_planner.profile.profiler import ProfileConfig
from ckpt_planner.verification import verify

transformers = pytest.importorskip("transformers")

FLOPS = ProfileConfig(flop_times=True, warmup=0, repeats=1)  # deterministic costs: the same plan every run


def build(kind: str, attn: str, device: str, **config: object) -> tuple[torch.nn.Module, dict]:
    """A tiny causal LM (2 layers x 64 hidden; `config` overrides) and its inputs, on `device`; the same
    weights on the CPU for the same arguments."""
    if kind == "llama":
        config = {**dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64), **config}
        cls, make = transformers.LlamaForCausalLM, transformers.LlamaConfig
    else:
        config = {**dict(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=0,
                         eos_token_id=0), **config}
        cls, make = transformers.GPT2LMHeadModel, transformers.GPT2Config
    torch.manual_seed(0)
    with torch.device(device):
        model = cls(make(use_cache=False, attn_implementation=attn, **config))
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1)).to(device)
    return model, {"input_ids": ids, "labels": ids}


_PLANS: dict[tuple[str, str], Plan] = {}


def meta_plan(kind: str, attn: str) -> Plan:
    """The model planned on the meta device at 80 % of its activations (several regions)."""
    if (kind, attn) not in _PLANS:
        model, inputs = build(kind, attn, "meta")
        planner = Planner(model, inputs, device="meta", profile_config=FLOPS)
        base, fixed = planner.baseline_peak_bytes, planner.problem.fixed_bytes
        plan = planner.plan(budget_bytes=fixed + (base - fixed) * 8 // 10, solver="dp", autotune=False)
        assert plan.regions
        _PLANS[kind, attn] = plan
    return _PLANS[kind, attn]


def regions(plan: Plan) -> list[tuple]:
    return [(r.start, r.end, r.first_node, r.last_node, r.saved_ops, r.saved_positions) for r in plan.regions]


@pytest.mark.parametrize("kind, attn", [("llama", "eager"), ("llama", "sdpa"), ("gpt2", "eager")])
def test_a_plan_made_on_meta_rebuilds_on_the_real_model(kind, attn, tmp_path):
    made = meta_plan(kind, attn)
    path = made.save(tmp_path / "plan.json")
    model, inputs = build(kind, attn, "cpu")
    plan = Plan.load(path)
    plan.rebuild(model, inputs)  # checks the figures and one step against the model's, bitwise
    assert regions(plan) == regions(made)
    report = verify(model, plan, inputs, repeats=1)
    assert report.exact, report.mismatch()
    # The meta device counts no generator state (on CUDA it lives in host memory); on the CPU a region
    # that draws random numbers (GPT-2's dropout) holds one from its forward to its backward, and its
    # recompute a second.
    names = [n.name for n in plan.problem.nodes]
    random = sum(any(names[i].startswith("dropout") for i in range(r.start, r.end + 1)) for r in plan.regions)
    allowance = 2 * random * rng_state_bytes(torch.device("cpu"))
    # Fake tensors see no kernel workspace: what the allocator holds beyond the live tensors in the model's
    # own step (16 B on llama's eager attention) is not in a meta plan's figures.
    allowance += max(0, report.baseline_measured_peak_bytes - report.baseline_measured_live_peak_bytes)
    assert report.measured_peak_bytes <= plan.predicted_peak_bytes + allowance


def test_a_meta_plan_file_that_does_not_say_where_it_was_captured_rebuilds(tmp_path):
    """Files written before plans recorded `stats.captured_on`: the exported graph does not match, so the
    model is captured again as on the meta device."""
    made = meta_plan("llama", "sdpa")
    data = json.loads(made.save(tmp_path / "plan.json").read_text())
    data["stats"].pop("captured_on", None)
    path = tmp_path / "unmarked.json"
    path.write_text(json.dumps(data))
    model, inputs = build("llama", "sdpa", "cpu")
    plan = Plan.load(path)
    plan.rebuild(model, inputs)  # one step against the model's, bitwise
    assert regions(plan) == regions(made)


def test_only_the_model_it_was_made_for_fits(tmp_path):
    """Another layer count, hidden size or activation is another computation: refused in one line."""
    path = meta_plan("llama", "eager").save(tmp_path / "plan.json")
    for change in ({"num_hidden_layers": 1}, {"hidden_size": 32}, {"hidden_act": "gelu"}):
        model, inputs = build("llama", "eager", "cpu", **change)
        with pytest.raises(PlanMismatchError, match="another model") as refused:
            Plan.load(path).rebuild(model, inputs)
        assert "\n" not in str(refused.value), change
    model, inputs = build("llama", "eager", "cpu")
    Plan.load(path).rebuild(model, inputs, check_step=False)  # the model it was made for
