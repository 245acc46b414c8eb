"""Test set-up: without a GPU the kernels run in Triton's interpreter (set before any import)."""

import os

import pytest
import torch

HAS_GPU = torch.cuda.is_available()
if not HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if HAS_GPU and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a GPU (run with a GPU and TRITON_INTERPRET unset)")
    for item in items:
        if "gpu" in item.keywords and DEVICE != "cuda":
            item.add_marker(skip_gpu)


@pytest.fixture
def device():
    return DEVICE
