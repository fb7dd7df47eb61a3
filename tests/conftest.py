import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(min(2, torch.get_num_threads()))

from helpers import perturbed_copy, tiny_qwen2  # noqa: E402


@pytest.fixture(scope="session")
def target_model():
    return tiny_qwen2(seed=0)


@pytest.fixture(scope="session")
def random_draft_model():
    return tiny_qwen2(seed=1)


@pytest.fixture(scope="session")
def partial_draft_model(target_model):
    return perturbed_copy(target_model, noise=0.3, seed=2)
