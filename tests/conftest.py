import gc
import os
import warnings

# One intra-op thread, here and in the processes the tests start: the test models are tiny, so a
# second thread saves nothing, and on a shared 2-core machine OpenMP threads that wait for each other
# make each kernel many times slower. Set before torch loads so that child processes read it too.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch
from ckpt_planner.profile.profiler import ProfileConfig

warnings.filterwarnings("ignore", category=FutureWarning)
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none is available")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def flop_times_by_default():
    """Plans made with the default profile (the CLI's commands, the README's examples) take node times
    from FLOPs in the tests: measured times follow the machine's load, and so would the plans (uniform's
    segments, the infeasible budgets a solver names). Tests of timing itself pass their own ProfileConfig."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ProfileConfig, "or_default", staticmethod(
            lambda config: config if config is not None else ProfileConfig(flop_times=True)))
        yield


@pytest.fixture(autouse=True, scope="session")
def timing_store_of_the_session(tmp_path_factory):
    """Measured profiles keep their times in a store of this test session, never in the user's cache
    (planner.timing_store)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CKPT_PLANNER_TIMINGS", str(tmp_path_factory.mktemp("timings")))
        yield


@pytest.fixture(autouse=True, scope="session")
def autotune_off_by_default():
    """Autotune (planner/choose/autotune.py) times a plan's candidates for up to 30 steps wherever node
    times are measured; tests that profile on the clock would pay that and plan by the machine's load.
    Its default is off here; its own tests pass autotune=True."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CKPT_PLANNER_AUTOTUNE", "off")
        yield


_tracked_after_collection = [0]
"""Objects the collector tracked right after the last full collection between tests."""


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """The planner collects garbage before it measures (profile/backward.py, profile/stagewise.py). In a
    worker that has run hundreds of tests, each collection walked every object alive (torch, transformers,
    the module fixtures: about half a million), half a second each and half the suite's time. Objects alive
    when a test starts are set aside from collections until it ends (gc.freeze), its fixtures' setup and
    teardown included: what the test allocates is collected as before, and what it measures is what the
    planner would measure in a fresh process.

    The garbage earlier tests left is collected between tests, in one full collection once the objects
    tracked have doubled since the last one, not before every test: each took seconds in a worker's heap,
    and at a quarter's growth (the rule of Python's own collector) a worker ran one every 60 tests."""
    gc.freeze()
    if gc.get_freeze_count() > _tracked_after_collection[0] * 2:
        gc.unfreeze()
        gc.collect()
        gc.freeze()
        _tracked_after_collection[0] = gc.get_freeze_count()
    try:
        yield
    finally:
        gc.unfreeze()


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
    """The garbage the deferred collections above left is collected here, before a pytest-xdist worker reports
    that it finished (xdist sends that after every sessionfinish hook). Left to pytest's own collection at
    unconfigure, after the report, it took more than the 5 s execnet waits before it sends the worker a
    SIGINT; the KeyboardInterrupt landed in a weakref callback the collection ran (torch's
    WeakIdKeyDictionary) and ended the run with a PytestUnraisableExceptionWarning."""
    gc.unfreeze()
    gc.collect()


@pytest.fixture(autouse=True)
def grad_mode_left_as_found():
    """A test that leaves autograd disabled (an error inside a no_grad region) would fail every test after
    it with a misleading refusal; this fails the culprit instead."""
    yield
    if not torch.is_grad_enabled():
        torch.set_grad_enabled(True)
        pytest.fail("the test left torch's grad mode disabled")
