"""Fixtures the benchmark's test modules share."""

import pytest

from bench_support import PROMPTS
from server_support import save_tiny_pair


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """The tiny pair saved as Hugging Face checkpoint folders, so the CLI loads it by path."""
    return save_tiny_pair(tmp_path_factory.mktemp("models"), PROMPTS)
