"""README's self-contained examples run as written (shortened to two training steps)."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def _examples() -> list[str]:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    return [b for b in blocks if b.startswith("import torch") and "range(100)" in b]  # the training loops


def test_readme_has_runnable_examples() -> None:
    assert len(_examples()) >= 2


@pytest.mark.slow  # each example plans (solver auto: the whole portfolio) and trains a model: minutes on 2 cores
@pytest.mark.parametrize("index", range(len(_examples())))
def test_readme_example_trains(index: int) -> None:
    code = _examples()[index]
    namespace: dict = {}
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(code.replace("range(100)", "range(2)"), f"README example {index}", "exec"), namespace)
    plan, loss = namespace["plan"], namespace["loss"]
    assert plan.regions, "the example's plan checkpoints nothing"
    assert plan.predicted_peak_bytes <= plan.budget_bytes
    assert torch.isfinite(loss).all()
