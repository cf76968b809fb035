"""FLOP counting never fails a profile, and grouped-query attention is counted on the expanded heads.

Fused attention kernels take key/value with fewer heads than the query (`enable_gqa=True`: flash attention
under bf16 on CUDA, the CPU flash kernel at any dtype). torch's FLOP formula for them asserted equal heads
before its GQA support (torch 2.11 among those), and the assertion failed the node's whole profile. The
tests run with torch's formula as installed and with one that asserts equal heads, as those versions do.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.flop_counter as torch_flops
from ckpt_planner import ProfileConfig
from ckpt_planner.capture import capture
from ckpt_planner.profile import profile, record
from ckpt_planner.profile.record import flop_counter, flop_formulas
from torch._subclasses.fake_tensor import FakeTensorMode

aten = torch.ops.aten
B, HEADS, KV_HEADS, S, D = 2, 4, 2, 16, 8
FLOP_TIMES = ProfileConfig(warmup=0, repeats=1, flop_times=True, timing_store=False)
META = ProfileConfig(meta=True)


def expanded_flops(b: int = B, heads: int = HEADS, s_q: int = S, s_k: int = S, d: int = D) -> int:
    """Q @ K^T and P @ V, each 2 FLOPs per multiply-add, on every query head."""
    return 2 * (2 * b * heads * s_q * s_k * d)


def _equal_heads_only(query_shape, key_shape, value_shape):
    """torch's forward SDPA formula before its GQA support: equal heads or an assertion."""
    b, h, s_q, d_q = query_shape
    b2, h2, s_k, d2 = key_shape
    b3, h3, s3, d_v = value_shape
    if not (b == b2 == b3 and h == h2 == h3 and d_q == d2 and s_k == s3):
        raise AssertionError("sdpa_flop_count: query/key/value shapes are incompatible")
    return torch_flops.bmm_flop((b * h, s_q, d_q), (b * h, d_q, s_k)) + torch_flops.bmm_flop(
        (b * h, s_q, s_k), (b * h, s_k, d_v)
    )


@pytest.fixture(params=["installed", "equal_heads_only"])
def formula(request, monkeypatch):
    """torch's SDPA formula as installed, or as torch before GQA support had it."""
    if request.param == "equal_heads_only":
        monkeypatch.setattr(torch_flops, "sdpa_flop_count", _equal_heads_only)
    return request.param


@pytest.fixture
def fresh_warnings(monkeypatch):
    """Each op's failed formula is warned once per process: forget the earlier ones."""
    monkeypatch.setattr(record, "_FAILED", set())


class GQAAttention(nn.Module):
    """One attention layer with HEADS query heads sharing KV_HEADS key/value heads."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(HEADS * D, HEADS * D)
        self.kv = nn.Linear(HEADS * D, 2 * KV_HEADS * D)
        self.out = nn.Linear(HEADS * D, HEADS * D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, HEADS, D).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, KV_HEADS, D).permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.out(y.transpose(1, 2).reshape(b, s, HEADS * D)).float().square().mean()


def _gqa_model():
    torch.manual_seed(0)
    return GQAAttention(), (torch.randn(B, S, HEADS * D),)


def _attention_nodes(cost):
    return [n for n in cost.nodes if "scaled_dot_product_attention" in str(n.target)]


def _fake_cuda_qkv():
    """Fake CUDA query, key, value [B, H, S, D] in bf16 (flash attention's case); no GPU is needed."""
    mode = FakeTensorMode()
    with mode:
        q = torch.empty(B, HEADS, S, D, device="cuda", dtype=torch.bfloat16)
        k = torch.empty(B, KV_HEADS, S, D, device="cuda", dtype=torch.bfloat16)
        v = torch.empty(B, KV_HEADS, S, D, device="cuda", dtype=torch.bfloat16)
    return mode, q, k, v


def test_the_real_runs_counter_counts_gqa_flash_attention_on_the_expanded_heads(formula):
    """The op a bf16 step on CUDA dispatches to, through the counter of the recording run on real tensors."""
    mode, q, k, v = _fake_cuda_qkv()
    with mode, flop_counter() as counter:
        aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)
    assert counter.get_total_flops() == expanded_flops()


@pytest.mark.parametrize(
    "op", ["_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
           "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu"]
)
def test_every_fused_attention_formula_counts_gqa_on_the_expanded_heads(formula, op):
    packet = getattr(aten, op, None)
    if packet is None or packet not in flop_formulas():
        pytest.skip(f"{op}: not in this torch, or torch has no FLOP formula for it")
    q = torch.empty(B, HEADS, S, D, device="meta")
    k = v = torch.empty(B, KV_HEADS, S, D, device="meta")
    assert flop_formulas()[packet](q, k, v, out_val=None) == expanded_flops()
    # equal heads: torch's own figure
    assert flop_formulas()[packet](q, q, q, out_val=None) == expanded_flops()


def test_gqa_backward_formulas_count_the_expanded_heads():
    """The joint-graph estimate (compile/knapsack.py) reads the backward ops' formulas too."""
    packet = aten._scaled_dot_product_flash_attention_backward
    if packet not in flop_formulas():
        pytest.skip("torch has no FLOP formula for flash attention's backward")
    q = torch.empty(B, HEADS, S, D, device="meta")
    k = v = torch.empty(B, KV_HEADS, S, D, device="meta")
    expected = torch_flops.sdpa_backward_flop_count(q.shape, q.shape, q.shape, q.shape)
    assert flop_formulas()[packet](q, q, k, v, out_val=None) == expected


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_a_gqa_attention_module_profiles_with_the_expanded_flops(formula, autocast):
    """On fake tensors the CPU flash kernel takes the key/value heads as they are (the profile of a
    stage-wise or meta plan): the node is profiled, and its FLOPs are those of the expanded heads."""
    model, inputs = _gqa_model()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        cap = capture(model, inputs)
        cost = profile(cap, META)
    (attention,) = _attention_nodes(cost)
    assert attention.flops == expanded_flops()
    assert all(n.flops > 0 for n in cost.nodes if n.op == "call_module")  # the Linears


def test_a_formula_that_raises_counts_zero_and_warns_on_fake_tensors(monkeypatch, fresh_warnings):
    def broken(*args, **kwargs):
        raise AssertionError("sdpa_flop_count: query/key/value shapes are incompatible")

    cpu_flash = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if cpu_flash is None or cpu_flash not in flop_formulas():
        pytest.skip("no CPU flash attention kernel in this torch")
    monkeypatch.setitem(flop_formulas(), cpu_flash, broken)
    model, inputs = _gqa_model()
    with pytest.warns(UserWarning, match="not counted.*AssertionError"):
        cost = profile(capture(model, inputs), META)
    (attention,) = _attention_nodes(cost)
    assert attention.flops == 0
    assert all(n.flops > 0 for n in cost.nodes if n.op == "call_module")  # the other formulas still count


def test_a_formula_that_raises_counts_zero_and_warns_on_real_tensors(monkeypatch, fresh_warnings):
    """The recording run on real tensors (torch's FlopCounterMode): a Linear whose formula raises."""

    def broken(*args, **kwargs):
        raise RuntimeError("no formula for these shapes")

    for packet in (aten.addmm, aten.mm):
        monkeypatch.setitem(record._torch_formulas(), packet, broken)
    model, inputs = _gqa_model()
    with pytest.warns(UserWarning, match="not counted.*RuntimeError"):
        cost = profile(capture(model, inputs), FLOP_TIMES)
    linears = [n for n in cost.nodes if n.op == "call_module"]
    assert linears and all(n.flops == 0 for n in linears)
    assert all(n.time >= 0 for n in cost.nodes)


def test_the_real_runs_counter_survives_a_raising_formula(monkeypatch, fresh_warnings):
    def broken(*args, **kwargs):
        raise AssertionError("sdpa_flop_count: query/key/value shapes are incompatible")

    monkeypatch.setitem(record._torch_formulas(), aten._scaled_dot_product_flash_attention, broken)
    mode, q, k, v = _fake_cuda_qkv()
    with pytest.warns(UserWarning, match="not counted"), mode, flop_counter() as counter:
        out = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)
    assert counter.get_total_flops() == 0
    assert out[0].shape == q.shape


@pytest.mark.slow
def test_zoo_llama_under_cpu_bf16_autocast_profiles(monkeypatch):
    """The case found on an H100 (torch 2.11): the zoo's GQA Llama under bf16 autocast, here with its CPU
    kernel on fake tensors and the formula of that torch (~16 s, most of it the capture)."""
    from tests.models.zoo import build

    monkeypatch.setattr(torch_flops, "sdpa_flop_count", _equal_heads_only)

    model, inputs = build("llama")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cost = profile(capture(model, inputs), META)
    attention = _attention_nodes(cost)
    cfg = model.config
    assert cfg.num_key_value_heads < cfg.num_attention_heads and attention
    b, s = inputs["input_ids"].shape
    d = cfg.hidden_size // cfg.num_attention_heads
    assert all(n.flops == expanded_flops(b, cfg.num_attention_heads, s, s, d) for n in attention)
