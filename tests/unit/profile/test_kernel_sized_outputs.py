"""An op whose meta function sizes an output differently from its kernel: the CPU LSTM layer's workspace,
which its backward keeps, is empty on fake tensors. The fake-tensor pass that sizes a plan below the plain
step counts it at the kernel's size: an LSTM language model's plan was predicted at half its measured peak."""

import torch
from ckpt_planner.profile.memory import LiveMemory
from ckpt_planner.profile.record import FakeRecorder
from torch._subclasses.fake_tensor import FakeTensorMode


def _forward_bytes(mode_of, lstm, x) -> tuple[int, int]:
    """(peak, live at the end) of the storages the LSTM's forward makes under the meter `mode_of()`."""
    meter = mode_of()
    with meter:
        out, (h, c) = lstm(x)
    return meter.peak, meter.current


def test_the_fake_lstm_holds_the_workspace_its_kernel_makes():
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(32, 32, batch_first=True)
    x = torch.randn(8, 16, 32, requires_grad=True)
    real = _forward_bytes(LiveMemory, lstm, x)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = _forward_bytes(lambda: FakeRecorder(count_flops=False), lstm, mode.from_tensor(x))
    assert real[1] > 8 * 16 * 32 * 4 * 2  # the workspace: more than the output and its copy
    assert fake == real, (fake, real)
