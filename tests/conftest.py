import warnings

import pytest
import torch

warnings.filterwarnings("ignore", category=FutureWarning)
torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none is available")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
