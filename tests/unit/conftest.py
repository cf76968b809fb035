"""Fixtures more than one stage's tests use."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.models.examples import MLPChain


@pytest.fixture(scope="module")
def clean_pt2(tmp_path_factory) -> Path:
    """An honest .pt2 of a small MLP (torch.export.save), the file hostile archives are crafted from."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("pt2") / "clean.pt2"
    torch.export.save(torch.export.export(MLPChain(d=32, blocks=4), (torch.randn(64, 32),)), path)
    return path
