"""An exported T5 calls SDPA with eager's arguments, layouts included, and draws its random numbers as eager does.

Why layouts. On the CPU a training step with dropout always runs SDPA's math path, whatever the mask's
strides, so the captured graph and eager agree bitwise even where their masks are laid out differently.
On CUDA the backend is chosen from the arguments: the fused kernels (flash, memory-efficient, cuDNN)
require the mask's last dimension to have stride 1, and each backend draws its dropout differently (the
fused kernels from their own Philox offsets, the math path with the dropout op). transformers 5.17 passes
T5's relative position bias to SDPA as the permuted embedding view, last stride = heads: eager runs the
math path there. A graph that passed a contiguous copy instead could take a fused kernel (in float32 the
memory-efficient one; flash and cuDNN take half precision only), with other dropout masks: every gradient
of the step differed (0.24 at most in float32 on an H100) while the CPU step stayed bitwise. So this test compares, for one training step on the CPU, every SDPA call as CUDA's
backend selection sees it (shapes, strides, offsets and dtypes of query, key, value and mask, dropout_p,
is_causal, scale, enable_gqa) and every random op, eager against the captured graph.

The installed transformers may copy the mask itself (later versions call `.contiguous()` in
`create_position_bias_mask`); the 'uncopied' cases put back the function as transformers 5.17 has it, so
both ways of building the mask are checked whatever version is installed.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from ckpt_planner.capture.export_exact import eager_position_bias_mask
from ckpt_planner.capture.trace import capture
from ckpt_planner.lower.rewrite import rewrite
from ckpt_planner.verification import default_loss
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

transformers = pytest.importorskip("transformers")
sdpa_attention = pytest.importorskip("transformers.integrations.sdpa_attention")
if not hasattr(sdpa_attention, "create_position_bias_mask"):
    pytest.skip("this transformers does not fold T5's position bias into SDPA's mask", allow_module_level=True)

_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


def _layout(x):
    if isinstance(x, torch.Tensor):
        return ("tensor", tuple(x.shape), x.stride(), x.storage_offset(), x.dtype, x.requires_grad)
    if isinstance(x, (list, tuple)):
        return tuple(_layout(y) for y in x)
    return x


class _SdpaCalls(TorchFunctionMode):
    """Each SDPA call (eager's `F.scaled_dot_product_attention`, the graph's aten op) with its arguments' layouts."""

    def __init__(self, seen: list) -> None:
        super().__init__()
        self.seen = seen

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention or func is torch.ops.aten.scaled_dot_product_attention.default:
            given = {**_SDPA_DEFAULTS, **dict(zip(_SDPA_ARGS, args)), **kwargs}
            self.seen.append(("sdpa", tuple((name, _layout(given[name])) for name in _SDPA_ARGS)))
        return func(*args, **kwargs)


class _RandomOps(TorchDispatchMode):
    """Each aten op that draws random numbers (dropout's bernoulli, native_dropout, rand, ...), with its arguments."""

    def __init__(self, seen: list) -> None:
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded in func.tags:
            self.seen.append((str(func), _layout(args), tuple(sorted((k, _layout(v)) for k, v in kwargs.items()))))
        return func(*args, **kwargs)


def _t5():
    config = transformers.T5Config(
        num_layers=1, num_decoder_layers=1, d_model=64, d_ff=128, d_kv=32, num_heads=2, vocab_size=128,
        use_cache=False, decoder_start_token_id=0, pad_token_id=0,  # dropout_rate: T5's default 0.1
    )
    torch.manual_seed(0)
    return transformers.T5ForConditionalGeneration(config).train()


def _inputs(mask: str) -> dict:
    torch.manual_seed(1)
    inputs = {"input_ids": torch.randint(0, 128, (2, 24)), "labels": torch.randint(0, 128, (2, 16))}
    if mask == "padded":
        inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
        inputs["attention_mask"][1, 18:] = 0
    return inputs


def _uncopied_position_bias_mask(position_bias, attention_mask, is_causal, query, key):
    """transformers 5.17's `create_position_bias_mask`: the mask as `where` (or the bias view itself) leaves it."""
    min_dtype = torch.finfo(key.dtype).min
    if attention_mask is None:
        if is_causal:
            q_length, kv_length = query.shape[2], key.shape[2]
            causal_mask = torch.arange(q_length, device=key.device)[:, None] >= torch.arange(kv_length, device=key.device)
            return torch.where(causal_mask.view(1, 1, q_length, kv_length), position_bias, min_dtype)
        return position_bias
    if attention_mask.dtype == torch.bool:
        return torch.where(attention_mask, position_bias, min_dtype)
    return position_bias + attention_mask


def _step(module, model, inputs) -> tuple[list, list, torch.Tensor, list]:
    """One training step: (SDPA calls, random ops, logits, gradients)."""
    sdpa, random = [], []
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(0)
    with _SdpaCalls(sdpa), _RandomOps(random):
        out = module(**inputs)
        default_loss(out).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    return sdpa, random, out.logits.detach(), grads


@pytest.mark.parametrize("bias_mask", ["installed", "uncopied"])
@pytest.mark.parametrize("mask", ["none", pytest.param("padded", marks=pytest.mark.slow)])  # a capture each: ~5 s
def test_t5_graph_calls_sdpa_and_draws_random_numbers_as_eager(monkeypatch, bias_mask: str, mask: str) -> None:
    if bias_mask == "uncopied":
        monkeypatch.setattr(sdpa_attention, "create_position_bias_mask", _uncopied_position_bias_mask)
    model, inputs = _t5(), _inputs(mask)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gm = capture(model, inputs, method="export").graph_module
    assert sum(n.target is eager_position_bias_mask for n in gm.graph.nodes) == 3  # encoder, decoder, cross
    planned = rewrite(gm, (), model=model)  # no regions: the graph as the plan's check runs it
    sdpa_e, random_e, out_e, grads_e = _step(model, model, inputs)
    sdpa_g, random_g, out_g, grads_g = _step(planned, model, inputs)
    assert len(sdpa_e) == 3 and len(random_e) > 3  # the three attentions' SDPA; dropout's draws
    for i, (e, g) in enumerate(zip(sdpa_e, sdpa_g)):
        assert e == g, f"SDPA call {i}:\n eager {e}\n graph {g}"
    assert len(sdpa_e) == len(sdpa_g)
    assert random_e == random_g
    assert torch.equal(out_e, out_g) and all(torch.equal(a, b) for a, b in zip(grads_e, grads_g))
