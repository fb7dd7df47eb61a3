"""Session-wide test setup: two torch threads, the tiny models, and a home of the suite's own.

The tests live in folders that mirror the package (``tests/engine/`` for ``verispec.engine``, ...),
without ``__init__.py`` files: pytest imports each test module by its base name (the default
``prepend`` import mode), so every base name is unique across the folders. This folder and each
of its test folders go on ``sys.path`` here, before any test module is imported: the shared
helpers (``helpers``, ``server_support``, ``openai_client``, ``gguf_models``, ``gguf_reference``)
import by name from any folder, and so do the fixtures one test module takes from another
(``from test_batching import gguf_files``), whichever folder pytest collects first.

Everything the suite writes (cost curves, derived weights, compiled kernels, tokenizers, fetched
models) goes to a temporary ``$VERISPEC_HOME`` made in :func:`pytest_configure`, before any test
module is imported, and removed at the end; subprocesses inherit it. The user's real model files
(the built-in Qwen2.5-Coder pair, SmolLM2) are still read from the user's own models folder,
named in ``$VERISPEC_MODELS_READONLY``, which the store never writes.
"""

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parent
for folder in [TESTS, *sorted(p for p in TESTS.iterdir() if p.is_dir() and any(p.glob("test_*.py")))]:
    sys.path.insert(0, str(folder))
torch.set_num_threads(min(2, torch.get_num_threads()))

from helpers import perturbed_copy, tiny_qwen2  # noqa: E402

_SAVED_ENV: dict[str, str | None] = {}
_USER_HOME: list[Path] = []


def pytest_configure(config):
    from verispec.models.store import READONLY_ENV, readonly_model_dirs, verispec_home

    user_home = verispec_home()
    readonly = [user_home / "models", *readonly_model_dirs()]
    _USER_HOME.append(user_home)
    for name in ("VERISPEC_HOME", READONLY_ENV):
        _SAVED_ENV[name] = os.environ.get(name)
    os.environ["VERISPEC_HOME"] = tempfile.mkdtemp(prefix="verispec-test-home-")
    os.environ[READONLY_ENV] = os.pathsep.join(str(p) for p in readonly)


def pytest_unconfigure(config):
    if not _SAVED_ENV:
        return
    shutil.rmtree(os.environ["VERISPEC_HOME"], ignore_errors=True)
    for name, value in _SAVED_ENV.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="session")
def user_verispec_home() -> Path:
    """The ``$VERISPEC_HOME`` the suite was started with (never written by the suite)."""
    return _USER_HOME[0]


@pytest.fixture(scope="session")
def target_model():
    return tiny_qwen2(seed=0)


@pytest.fixture(scope="session")
def random_draft_model():
    return tiny_qwen2(seed=1)


@pytest.fixture(scope="session")
def partial_draft_model(target_model):
    return perturbed_copy(target_model, noise=0.3, seed=2)
