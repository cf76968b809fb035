"""Exactness on models our other tests do not use: random ops the planner must see by what they do,
selective replay under autocast's cast cache, partial plans at other shapes, the same plan from the
first run on, and the safety net that keeps an inexact plan from reaching the user.

Every plan here is compared with the model's own step, bitwise (outputs, every gradient, buffers).
Plans are made with FLOP-based times (deterministic), except where the timing store is the subject.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from ckpt_planner import optimize
from ckpt_planner.api import Planner
from ckpt_planner.capture.mutation import compute_nodes
from ckpt_planner.capture.rng import uses_rng
from ckpt_planner.choose.safety_net import inexact_parts, step_differences
from ckpt_planner.errors import InexactPlanError
from ckpt_planner.lower.rewrite import CheckpointRegion, rewrite
from ckpt_planner.profile.loss import default_loss
from ckpt_planner.profile.profiler import ProfileConfig
from ckpt_planner.solvers.heuristics.basic import segment_runs
from torch.utils import _pytree as pytree

FLOPS = ProfileConfig(warmup=0, repeats=1, flop_times=True)
METHODS = ["symbolic_trace", "export"]
SOLVERS = ["uniform", "greedy", "dp", "ilp", "auto", "selective"]


def step(module, model, args, kwargs, ctx=contextlib.nullcontext, forwards: int = 1):
    """One training step of `module` from seed 0 (torch and numpy); the model's grads and buffers."""
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(0)
    np.random.seed(0)
    with ctx():
        outs = [module(*args, **kwargs) for _ in range(forwards)]
        loss = sum(default_loss(o).float() for o in outs)
    loss.backward()
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    flat = [t.detach().clone() for o in outs for t in pytree.tree_leaves(o) if isinstance(t, torch.Tensor)]
    for p in model.parameters():
        p.grad = None
    return flat, grads, {n: b.clone() for n, b in model.named_buffers()}


def assert_same_step(model, module, args=(), kwargs=None, **kw):
    kwargs = kwargs or {}
    start = {n: b.clone() for n, b in model.named_buffers()}
    ref = step(model, model, args, kwargs, **kw)
    with torch.no_grad():
        for n, b in model.named_buffers():
            b.copy_(start[n])
    got = step(module, model, args, kwargs, **kw)
    assert len(ref[0]) == len(got[0]) and all(torch.equal(a, b) for a, b in zip(ref[0], got[0])), "outputs differ"
    bad = [n for n in ref[1] if (ref[1][n] is None) != (got[1][n] is None)
           or (ref[1][n] is not None and not torch.equal(ref[1][n], got[1][n]))]
    assert not bad, f"{len(bad)} of {len(ref[1])} gradients differ: {bad[:5]}"
    assert all(torch.equal(ref[2][n], got[2][n]) for n in ref[2]), "buffers differ"


# -- 1. random ops, seen by what they do ------------------------------------------------------


@torch.library.custom_op("ckpt_planner_test::jitter", mutates_args=())
def jitter(x: torch.Tensor) -> torch.Tensor:
    """A custom op that draws, without the nondeterministic_seeded tag."""
    return torch.rand_like(x)


@jitter.register_fake
def _(x):
    return torch.empty_like(x)


RANDOM_OPS = {
    "sdpa_dropout": lambda x: F.scaled_dot_product_attention(x[:, None], x[:, None], x[:, None], dropout_p=0.2)[:, 0],
    "dropout": lambda x: F.dropout(x, 0.3, training=True),
    "alpha_dropout": lambda x: F.alpha_dropout(x, 0.2, training=True),
    "bernoulli": lambda x: x * torch.bernoulli(torch.full_like(x, 0.7)),
    "rand_like": lambda x: x + 0.1 * torch.rand_like(x),
    "randn_like": lambda x: x + 0.1 * torch.randn_like(x),
    "normal_": lambda x: x + 0.1 * torch.empty_like(x).normal_(),
    "uniform_": lambda x: x * torch.empty_like(x).uniform_(0.5, 1.5),
    "multinomial": lambda x: x[..., torch.multinomial(torch.ones(x.shape[-1]), x.shape[-1], replacement=True)],
    "randperm": lambda x: x[..., torch.randperm(x.shape[-1])],
    "rrelu": lambda x: F.rrelu(x, training=True),
    "custom_op": lambda x: x * (1 + 0.1 * jitter(x.detach())),
}


class Draw(nn.Module):
    """A Linear, then one random op (a plain function, so symbolic_trace records it as it is called)."""

    def __init__(self, name: str, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.name = name

    def forward(self, x):
        return x + torch.tanh(RANDOM_OPS[self.name](self.lin(x)))


class RandomCorpus(nn.Module):
    def __init__(self, names, d: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Draw(n, d) for n in names)
        self.head = nn.Linear(d, d)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _random_nodes(planner) -> set[str]:
    gm = planner.capture.graph_module
    return {n.name for n in compute_nodes(gm.graph) if uses_rng(gm, n)}


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name", sorted(RANDOM_OPS))
def test_each_random_op_is_seen_and_its_region_saves_the_generator(name, method):
    torch.manual_seed(0)
    model, x = RandomCorpus([name, name]).train(), torch.randn(4, 8, 16)
    planner = Planner(model, x, capture_method=method, profile_config=FLOPS, check_step=False)
    random = _random_nodes(planner)
    assert random, f"{name}: no node seen drawing random numbers"
    module = rewrite(planner.capture.graph_module, segment_runs(planner.problem), model=model)
    regions = [m for m in module.modules() if isinstance(m, CheckpointRegion)]
    drawing = [r for r in regions if any(n.name in random for n in compute_nodes(r.graph))]
    if name == "rrelu":  # writes its draw into a buffer it saves: torch's checkpoint cannot replay it (rng.py)
        assert not drawing and not any(n.recomputable for n in planner.problem.nodes if n.name in random)
    else:
        assert drawing and all(r.random for r in drawing)
    assert_same_step(model, module, (x,))


def _corpus_params():
    """Each solver on each capture path. The corpus model takes 20-30 s a case on 2 busy cores: the default
    run keeps dp on symbolic_trace and auto (which runs the MILP's answer among others) on export, the
    other cases run with the slow tests (CI runs both). Every random op is checked on both paths by
    test_each_random_op_is_seen_and_its_region_saves_the_generator."""
    for solver in SOLVERS:
        for method in METHODS:
            fast = (solver, method) in {("dp", "symbolic_trace"), ("auto", "export")}
            yield pytest.param(solver, method, marks=[] if fast else [pytest.mark.slow], id=f"{solver}-{method}")


@pytest.mark.parametrize("solver,method", list(_corpus_params()))
def test_random_corpus_plans_are_bitwise_for_every_solver(solver, method):
    torch.manual_seed(0)
    model, x = RandomCorpus(sorted(RANDOM_OPS)).train(), torch.randn(16, 32, 16)
    fraction = 0.8 if solver == "selective" else 0.6  # a region per block reaches no lower here
    plan = optimize(model, x, solver=solver, activation_budget=fraction, capture_method=method,
                    profile_config=FLOPS, check_step=False)
    assert plan.regions
    assert_same_step(model, plan.module, (x,))


def test_random_ops_on_fake_tensors_are_seen():
    torch.manual_seed(0)
    model, x = RandomCorpus(["sdpa_dropout", "dropout", "rand_like"]).train(), torch.randn(4, 8, 16)
    planner = Planner(model, x, device="meta", profile_config=FLOPS)
    assert len(_random_nodes(planner)) >= 3
    assert any(n.rng_state_bytes for n in planner.problem.nodes)


class NanoBlock(nn.Module):
    def __init__(self, d: int, heads: int, p: float) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.heads, self.p = heads, p
        self.drop = nn.Dropout(p)

    def forward(self, x):
        b, t, c = x.shape  # [B, T, C]
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p if self.training else 0.0, is_causal=True)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, c)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class NanoGPT(nn.Module):
    """nanoGPT's shape: tied embedding, SDPA with dropout."""

    def __init__(self, vocab: int = 96, d: int = 64, layers: int = 4, seq: int = 32, p: float = 0.1) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(NanoBlock(d, 4, p) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.lm_head(self.ln(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


@pytest.mark.parametrize("solver", ["auto", "dp", pytest.param("ilp", marks=pytest.mark.slow)])
def test_nanogpt_with_sdpa_dropout_is_bitwise(solver):
    torch.manual_seed(0)
    model = NanoGPT(seq=64).train()
    idx = torch.randint(0, 96, (8, 64))
    plan = optimize(model, (idx, idx), solver=solver, activation_budget=0.3, profile_config=FLOPS, check_step=False)
    assert plan.regions
    assert_same_step(model, plan.module, (idx, idx))


# -- 2. selective replay under autocast --------------------------------------------------------


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64), nn.Tanh()) for _ in range(4)])


def _kept_plan(model, x, **kw):
    plan = optimize(model, x, solver="dp", activation_budget=0.7, profile_config=FLOPS, **kw)
    assert plan.saved_indices(), "the test needs a plan with kept ops"
    return plan


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("forwards", [2, 3])
def test_kept_ops_replay_with_autocast_cast_cache(dtype, forwards):
    model, x = _mlp(), torch.randn(256, 64)
    plan = _kept_plan(model, x)

    def ctx():
        return torch.autocast("cpu", dtype=dtype)

    assert_same_step(model, plan.module, (x,), ctx=ctx, forwards=forwards)


def test_replan_inside_the_callers_autocast():
    model, x = _mlp(), torch.randn(256, 64)
    plan = _kept_plan(model, x, on_larger_shape="replan")
    big = torch.randn(300, 64)
    assert_same_step(model, plan.module, (big,), ctx=lambda: torch.autocast("cpu", dtype=torch.bfloat16), forwards=2)
    assert len(plan.module.shape_guard.replanned) == 1


# -- 3. partial plans at other shapes -----------------------------------------------------------


def _speech(kind: str):
    from transformers import HubertConfig, HubertForCTC, Wav2Vec2Config, Wav2Vec2ForCTC

    config, cls = (HubertConfig, HubertForCTC) if kind == "hubert" else (Wav2Vec2Config, Wav2Vec2ForCTC)
    torch.manual_seed(0)
    cfg = config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, conv_dim=(16, 16),
        conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2,
        vocab_size=20, pad_token_id=0, ctc_loss_reduction="mean", mask_time_prob=0.05, layerdrop=0.0,
    )
    return cls(cfg).train()


def _speech_inputs(batch: int, length: int) -> dict:
    g = torch.Generator().manual_seed(batch * 1000 + length)
    return {"input_values": torch.randn(batch, length, generator=g),
            "labels": torch.randint(1, 20, (batch, 6), generator=g)}


@pytest.mark.parametrize("kind", [pytest.param("hubert", marks=pytest.mark.slow), "wav2vec2"])
def test_partial_plan_runs_smaller_shapes_and_replans_larger(kind):
    model = _speech(kind)
    # dp, not auto: the subject is the shapes the plan runs at, and auto's MILP took a third of the time
    # (auto on a partial plan: test_heldout_predictions.py::test_hubert_ctc_partial_plan)
    plan = optimize(model, _speech_inputs(6, 800), activation_budget=0.6, solver="dp", profile_config=FLOPS,
                    on_larger_shape="replan")
    assert plan.capture_method == "partial"
    for batch, length in ((5, 800), (6, 640), (3, 500)):
        assert_same_step(model, plan.module, kwargs=_speech_inputs(batch, length))
    assert_same_step(model, plan.module, kwargs=_speech_inputs(7, 900))
    assert len(plan.module.shape_guard.replanned) == 1


# -- 4. the same plan from the first run on ----------------------------------------------------

_RUN = """
import json, sys, time
import torch
from ckpt_planner import optimize
from tests.models.examples import gpt_example
from ckpt_planner.profile.record import CostProfiler

if sys.argv[1] == "slow":  # a first run on a loaded machine: the Linear layers timed 4x slower
    call = CostProfiler.call_module

    def slowed(self, target, args, kwargs):
        t0 = time.perf_counter()
        out = call(self, target, args, kwargs)
        time.sleep(3 * (time.perf_counter() - t0))
        return out

    CostProfiler.call_module = slowed
model, x = gpt_example(batch=4, seq=64, layers=3, d=64)
out = {}
for f in (0.5, 0.7):
    plan = optimize(model, x, activation_budget=f, check_step=False)
    out[f] = [[r.start, r.end, list(r.saved_positions)] for r in plan.regions]
print(json.dumps(out))
"""


@pytest.mark.slow  # three fresh processes (about 40 s); test_steady.py checks the stored plan in the default run
def test_first_and_second_run_give_the_same_plan(tmp_path):
    repo = Path(__file__).resolve().parents[2]  # the script imports the test models (tests.models)
    env = {**os.environ, "CKPT_PLANNER_TIMINGS": str(tmp_path / "store"), "PYTHONPATH": str(repo)}
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(_RUN))

    def run(mode: str) -> dict:
        done = subprocess.run([sys.executable, str(script), mode], env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    first = run("slow")
    assert run("quiet") == first
    assert run("quiet") == first


# -- 5. the safety net -------------------------------------------------------------------------


@pytest.fixture
def blind_to_randomness(monkeypatch):
    """A random op the planner does not see: every region is built without saving the generator."""
    import importlib

    monkeypatch.setattr(importlib.import_module("ckpt_planner.lower.rewrite"), "uses_rng", lambda gm, n: False)


class Mixed(nn.Module):
    """Two blocks with dropout between deterministic MLP blocks: plans without the random ones exist."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.draws = nn.ModuleList(Draw("dropout", d) for _ in range(2))
        self.mlps = nn.ModuleList(nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(4))

    def forward(self, x):
        x = self.draws[0](x)
        for m in self.mlps[:2]:
            x = x + m(x)
        x = self.draws[1](x)
        for m in self.mlps[2:]:
            x = x + m(x)
        return x


def test_safety_net_never_returns_an_inexact_plan(blind_to_randomness):
    torch.manual_seed(0)
    model, x = Mixed().train(), torch.randn(8, 16, 32)
    unchecked = optimize(model, x, solver="dp", activation_budget=0.8, profile_config=FLOPS, check_step=False)
    assert unchecked.regions and step_differences(model, unchecked.module, (x,), {})  # the fault is real
    plan = optimize(model, x, solver="dp", activation_budget=0.8, profile_config=FLOPS)
    assert any("differed from the model's" in n for n in plan.notes)
    assert_same_step(model, plan.module, (x,))
    assert plan.predicted_peak_bytes <= plan.budget_bytes


def test_a_graph_that_differs_with_no_region_is_blamed_on_the_capture(monkeypatch):
    """Where the captured graph's own step differs from the model's, every region would look at fault one
    by one; the safety net says the capture is, instead of forbidding every region."""
    import importlib

    net = importlib.import_module("ckpt_planner.choose.safety_net")
    calls = []

    def always_differs(model, module, args, kwargs, **kw):
        calls.append(module)
        return ["mlps.0.0.weight"]

    monkeypatch.setattr(net, "step_differences", always_differs)
    torch.manual_seed(0)
    model, x = Mixed().train(), torch.randn(8, 16, 32)
    with pytest.raises(InexactPlanError, match="the capture, not the plan, is at fault"):
        optimize(model, x, solver="dp", activation_budget=0.8, profile_config=FLOPS)
    assert len(calls) == 2  # the plan's step, then the graph with no region: no region is tried alone


def test_safety_net_says_why_when_no_exact_plan_fits(blind_to_randomness):
    torch.manual_seed(0)
    model, x = RandomCorpus(["dropout"] * 3, d=32).train(), torch.randn(32, 64, 32)
    with pytest.raises(InexactPlanError, match="differed from the model's"):
        optimize(model, x, solver="dp", activation_budget=0.7, profile_config=FLOPS)


@pytest.mark.parametrize(
    "saved,faulty,expected",
    [
        ((3,), {"kept"}, (True, [])),  # only with the kept ops
        ((), {(0, 2)}, (False, [(0, 2)])),  # one region
        ((3,), {(0, 2), (5, 6)}, (False, [(0, 2), (5, 6)])),  # regions, kept ops or not
    ],
)
def test_inexact_parts_finds_the_fault(saved, faulty, expected):
    regions = [(0, 2), (3, 4), (5, 6)]

    def differs(rs, kept):
        return bool(kept and "kept" in faulty) or any(r in faulty for r in rs)

    assert inexact_parts(regions, saved, differs) == expected


# -- CLIP: attention modules told causal by their caller ----------------------------------------


def _clip():
    from transformers import CLIPConfig, CLIPModel, CLIPTextConfig, CLIPVisionConfig

    torch.manual_seed(0)
    text = CLIPTextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                          vocab_size=256, max_position_embeddings=32)
    vision = CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                              image_size=32, patch_size=8)
    model = CLIPModel(CLIPConfig(text_config=text.to_dict(), vision_config=vision.to_dict(), projection_dim=32))
    inputs = {"input_ids": torch.randint(0, 256, (4, 16)), "pixel_values": torch.randn(4, 3, 32, 32), "return_loss": True}
    return model, inputs


def test_clip_captured_graph_is_the_models_step():
    """CLIP's text attention modules say is_causal=False and get is_causal=True from their caller: where eager
    drops the causal mask, the captured graph must run a causal kernel too (it ran unmasked attention)."""
    from ckpt_planner.capture.trace import capture

    model, inputs = _clip()
    cap = capture(model, inputs)
    assert cap.method == "export"
    assert _same(step(cap.graph_module, model, (), inputs), step(model, model, (), inputs))


def _same(a, b) -> bool:
    outs_a, grads_a, bufs_a = a
    outs_b, grads_b, bufs_b = b
    return (all(torch.equal(x, y) for x, y in zip(outs_a, outs_b, strict=True))
            and all((grads_a[k] is None) == (grads_b[k] is None) and (grads_a[k] is None or torch.equal(grads_a[k], grads_b[k]))
                    for k in grads_a)
            and all(torch.equal(bufs_a[k], bufs_b[k]) for k in bufs_a))


@pytest.mark.slow  # about a minute: capture, a stage-wise profile and the safety net on a two-tower model
def test_clip_is_planned_exactly():
    model, inputs = _clip()
    plan = optimize(model, inputs, activation_budget=0.85, solver="dp", profile_config=FLOPS)
    assert plan.regions
    assert _same(step(plan.module, model, (), inputs), step(model, model, (), inputs))
