"""Whole steps are timed on the thread's CPU clock on a one-thread CPU (profile/timing.py `step_clock`): time the
thread spends off the CPU, which is what other processes' load adds, is not the step's cost. A step that sleeps
stands in for a loaded machine: its sleep is wall time and no CPU time."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn as nn
from ckpt_planner.profile import timing

SLEEP_S = 0.05


class Sleeper(nn.Module):
    """One tiny linear layer whose forward leaves the CPU for SLEEP_S seconds: a step descheduled that long."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        time.sleep(SLEEP_S)
        return self.lin(x)


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_a_one_thread_cpu_step_is_timed_without_the_time_it_spends_off_the_cpu(one_thread):
    model = Sleeper()
    eager, graph = timing.step_times(model, model, (torch.randn(2, 4),), {}, torch.device("cpu"))
    # wall time would be at least SLEEP_S for each; the step's own work is a few hundred microseconds of CPU
    assert 0 < eager < SLEEP_S / 2 and 0 < graph < SLEEP_S / 2


def test_the_wall_clock_where_this_thread_does_not_run_the_whole_step(one_thread):
    assert timing.step_clock(torch.device("cpu")) is time.thread_time
    torch.set_num_threads(2)  # torch's worker threads do work the calling thread's clock does not see
    assert timing.step_clock(torch.device("cpu")) is time.perf_counter
    assert timing.step_clock(torch.device("cuda")) is time.perf_counter  # kernels run asynchronously
    assert timing.step_clock(torch.device("meta")) is time.perf_counter
