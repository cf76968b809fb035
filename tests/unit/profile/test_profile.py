"""Capture and per-node profiling: saved bytes exact against eager hooks, meta mode equal to real."""

import subprocess
import sys

import pytest
import torch
from ckpt_planner import CaptureError, ProfileConfig
from ckpt_planner.capture import capture
from ckpt_planner.model_state import rng_preserved
from ckpt_planner.profile import profile
from ckpt_planner.profile.memory import storage_key

from tests.models.small import ALL, HF, LOCAL, DataDependent
from tests.support.profiles import TIMED_ONCE

# bert, vit and resnet in the slow run (CI runs both), as in test_end_to_end.py: mlp and cnn (BatchNorm)
# keep the symbolic_trace path, tiny_gpt and gpt2 the transformer and the export path in the default run.
HEAVY = ("bert", "vit", "resnet")


def _models(names) -> list:
    return [pytest.param(n, marks=pytest.mark.slow) if n in HEAVY else n for n in names]


_CAPTURED: dict[str, tuple] = {}


def captured(name: str) -> tuple:
    """(model, inputs, capture) of a model of tests.models.small, made once per model for this file: the
    three tests below only read them, and the capture (an export for the transformers) was most of their
    time. The eager step of `eager_saved_bytes` may move BatchNorm's running statistics, which no byte
    count here depends on."""
    if name not in _CAPTURED:
        model, inputs = ALL[name]()
        _CAPTURED[name] = (model, inputs, capture(model, inputs))
    return _CAPTURED[name]


def eager_saved_bytes(model, args, kwargs) -> int:
    """What one global saved_tensors_hooks sees on the eager model, by storage."""
    external = {storage_key(t) for t in list(model.parameters()) + list(model.buffers())}
    for t in list(args) + list(kwargs.values()):
        if isinstance(t, torch.Tensor):
            external.add(storage_key(t))
    seen: dict[int, int] = {}
    keep = []

    def pack(t):
        key = storage_key(t)
        if key not in external:
            seen[key] = t.untyped_storage().nbytes()
            keep.append(t)
        return t

    if not isinstance(model, torch.fx.GraphModule):
        model.train()  # export's module refuses train(); it was captured in training mode
    with rng_preserved(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(*args, **kwargs)
    return sum(seen.values())


@pytest.mark.parametrize("name", _models(ALL))
def test_saved_bytes_equal_eager_hooks(name):
    model, inputs, cap = captured(name)
    cost = profile(cap, TIMED_ONCE)
    assert cost.total_saved_bytes == eager_saved_bytes(model, cap.args, cap.kwargs)
    assert cost.total_saved_bytes > 0
    # every saved storage is attributed to exactly one producing node
    assert sum(cost.saved_bytes) == cost.total_saved_bytes
    # and the captured graph, run eagerly, saves exactly what the profile says
    assert cost.total_saved_bytes == eager_saved_bytes(cap.graph_module, cap.args, cap.kwargs)


@pytest.mark.parametrize("name", _models(ALL))
def test_capture_path(name):
    model, inputs, cap = captured(name)
    expected = "symbolic_trace" if name in LOCAL else "export"
    assert cap.method == expected
    if name in HF:
        assert cap.fallback_reason  # why symbolic_trace was not used
    # the captured module shares the model's parameter objects
    own = {id(p) for p in model.parameters()}
    assert {id(p) for p in cap.graph_module.parameters()} <= own


def test_untraceable_model_gives_clear_error():
    with pytest.raises(CaptureError) as info:
        capture(DataDependent(), (torch.randn(4, 8),))
    msg = str(info.value)
    assert "symbolic_trace" in msg and "torch.export" in msg
    assert "DataDependent" in msg
    assert "\n" not in msg.split(". ")[0]


@pytest.mark.parametrize("name", _models(["mlp", "cnn", "tiny_gpt", "gpt2", "bert", "vit", "resnet"]))
def test_meta_mode_bytes_equal_real(name):
    model, inputs, cap = captured(name)
    real = profile(cap, TIMED_ONCE)
    fake = profile(cap, ProfileConfig(meta=True))
    assert fake.time_source == "flops" and real.time_source == ("fitted" if TIMED_ONCE.anchor else "measured")
    assert len(real.nodes) == len(fake.nodes)
    assert [(n.name, n.out_bytes, n.grad_bytes, n.param_grad_bytes) for n in real.nodes] == [
        (n.name, n.out_bytes, n.grad_bytes, n.param_grad_bytes) for n in fake.nodes
    ]
    assert real.storages == fake.storages
    assert real.param_bytes == fake.param_bytes
    assert all(n.time >= 0 for n in fake.nodes) and fake.total_time > 0


def test_profile_records_modules_flops_and_times():
    model, inputs = LOCAL["tiny_gpt"]()
    cost = profile(capture(model, inputs), TIMED_ONCE)
    linears = [n for n in cost.nodes if n.op == "call_module" and n.target.endswith(("fc", "proj", "qkv"))]
    assert linears and all(n.flops > 0 for n in linears)
    assert all(n.module for n in linears)
    assert all(n.time > 0 for n in cost.nodes if n.op == "call_module")
    assert cost.param_grad_bytes == sum(p.numel() * 4 for p in model.parameters())  # tied weight counted once


def test_profile_error_names_the_node():
    from ckpt_planner.errors import ProfileError

    model, inputs = LOCAL["mlp"]()
    cap = capture(model, inputs)
    bad = (torch.randn(3, 7),)  # wrong feature size
    cap2 = type(cap)(cap.graph_module, cap.method, None, bad, {})
    with pytest.raises(ProfileError, match="node 'blocks_0_0'"):
        profile(cap2, TIMED_ONCE)


def test_optimize_leaves_model_as_found():
    from ckpt_planner import optimize

    model, inputs = LOCAL["cnn"]()
    model.eval()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    grads = [p.grad.clone() for p in model.parameters()]
    rng = torch.get_rng_state()
    optimize(model, inputs, solver="uniform", profile_config=TIMED_ONCE)
    assert not model.training
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
    assert torch.equal(rng, torch.get_rng_state())


def test_solvers_import_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import ckpt_planner.solvers as solvers\n"
        "from ckpt_planner.solvers import Node, Problem, Storage, simulate\n"
        "p = Problem((Node('a', time=1.0), Node('b', time=1.0, inputs=(0,), reads=(0,))),"
        " (Storage(0, 8, 1, (1,)), Storage(1, 8, 1, (), True)))\n"
        "assert simulate(p).peak_bytes == 16\n"
        "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=str(__import__("pathlib").Path(__file__).parents[3]),
    )
    assert out.returncode == 0, out.stderr


class SplitHeads(torch.nn.Module):
    """A projection read only through a view: the backward's gradient is that of the view."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        y = self.proj(x).view(b, t, 4, 64).transpose(1, 2)  # [B, H, T, D], a view of the projection
        return (y * y).sum()


def test_view_output_gradient_is_counted():
    # The backward of the mul makes a full [B, H, T, D] gradient for the view: 262 KB of the
    # 820 KB peak. A view makes no storage; its gradient, made by the mul's backward and handed
    # on as a view, is the projection's gradient, so the mul's backward makes that one.
    from ckpt_planner.solvers import simulate
    from ckpt_planner.verification import default_loss, measure_step

    torch.manual_seed(0)
    model, x = SplitHeads(), torch.randn(4, 64, 16)
    cost = profile(capture(model, (x,)), TIMED_ONCE)
    names = [n.name for n in cost.nodes]
    proj, mul = names.index("proj"), names.index("mul")
    assert cost.nodes[proj].grad_bytes == 4 * 64 * 256 * 4 and proj in cost.nodes[mul].inputs
    assert all(n.out_bytes == 0 and n.grad_bytes == 0 for n in cost.nodes if n.target in ("view", "transpose"))
    predicted = simulate(cost.to_problem()).peak_bytes
    params = list(model.parameters())
    measured, _ = measure_step(model, (x,), {}, params, params, default_loss, torch.device("cpu"))
    assert abs(predicted - measured) <= 0.001 * measured, (predicted, measured)


class _NoBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("this op has no backward here")


def _no_backward(x):
    return _NoBackward.apply(x)


torch.fx.wrap("_no_backward")  # one graph node that calls the Function (tracing would inline its forward)


class _UsesNoBackward(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        return _no_backward(self.fc(x)).sum()


def test_failing_backward_leaves_a_profile_with_a_warning():
    model = _UsesNoBackward()
    with pytest.warns(UserWarning, match="temporaries were not measured.*no backward here"):
        cost = profile(capture(model, (torch.randn(4, 8),)), TIMED_ONCE)
    assert cost.nodes and all(n.backward_temp_bytes == 0 for n in cost.nodes)
    assert all(p.grad is None for p in model.parameters())
