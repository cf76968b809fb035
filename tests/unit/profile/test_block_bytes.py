"""Bytes as the device's allocator counts them: CUDA blocks are multiples of 512 bytes."""

import torch
from ckpt_planner.profile.memory import block_bytes
from ckpt_planner.profile.profiler import _StorageTable
from torch._subclasses.fake_tensor import FakeTensorMode


def test_cuda_blocks_round_up_to_512_bytes_and_the_cpu_counts_bytes():
    assert [block_bytes(n, "cuda") for n in (0, 1, 512, 513, 4096)] == [0, 512, 512, 1024, 4096]
    assert [block_bytes(n, "cpu") for n in (0, 1, 513)] == [0, 1, 513]
    assert block_bytes(40, "meta") == 40


def test_a_small_activation_on_cuda_is_counted_as_its_block():
    """A BatchNorm's per-channel statistics (64 floats, 256 bytes) take a 512-byte block on CUDA; the
    table of activations counts the block, and the gradient of a small output likewise (fake CUDA
    tensors: no device needed)."""
    with FakeTensorMode(allow_non_fake_inputs=True):  # leaves: a CPU build has no CUDA autograd to run ops
        stats = torch.empty(64, device="cuda", requires_grad=True)
        big = torch.empty(1000, device="cuda", requires_grad=True)  # 4,000 bytes -> 4,096
        table = _StorageTable({})
        assert table.add_outputs(0, stats, viewed=False) == (512, 512)
        assert table.add_outputs(1, big, viewed=False) == (4096, 4096)
    cpu = _StorageTable({})
    assert cpu.add_outputs(0, torch.empty(64, requires_grad=True), viewed=False) == (256, 256)
