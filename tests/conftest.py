"""Session-wide test setup: two torch threads, the tiny models, and a home of the suite's own; the
fixtures that test modules of several folders share.

The tests live in folders that mirror the package (``tests/engine/`` for ``verispec.engine``,
``tests/runners/cpu/`` for ``verispec.runners.cpu``, ...), without ``__init__.py`` files: pytest
imports each test module by its base name (the default ``prepend`` import mode, which puts the
module's own folder on ``sys.path``), so every base name is unique across the folders. No test
module imports another (``tests/test_suite_layout.py`` checks it): a fixture that test modules of
one folder share is in that folder's ``conftest.py``, one shared across folders is here (a
``conftest.py``'s fixtures reach every test module below its folder), and the helpers that are no
fixtures are in the support modules of this folder (``helpers``, ``gguf_models``,
``server_support``, ``batching_support``, ...), which any test module imports by name: this
folder goes on ``sys.path`` here, before any test module is imported.

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
sys.path.insert(0, str(TESTS))  # the support modules
torch.set_num_threads(min(2, torch.get_num_threads()))

from gguf_models import MIXED, write_gguf_model  # noqa: E402
from gguf_models import perturbed_copy as perturbed_file  # noqa: E402
from helpers import greedy_continuations, perturbed_copy, tiny_qwen2  # noqa: E402

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


# Shared across folders. Module scope, as where they were defined in one test module and imported
# into others: each test module gets instances of its own.


@pytest.fixture(scope="module")
def target():
    """The tiny target of the bug-class and EAGLE tests (``tiny_qwen2(seed=0)``, one per module)."""
    return tiny_qwen2(seed=0)


@pytest.fixture(scope="module")
def trained_head(target):
    """A head trained 60 steps on the target's own greedy continuations of random prompts."""
    from verispec.runners.eagle.head import EagleHead
    from verispec.training.loop import TrainOptions, train_head

    head = EagleHead.from_target(target, seed=0)
    train_head(
        head,
        target,
        greedy_continuations(target, seed=11),
        TrainOptions(steps=60, lr=3e-3, batch_positions=128, held_out=0.0, seed=0),
    )
    return head


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory) -> dict[str, Path]:
    """The tiny GGUF target (mixed block types) and a draft that is its copy with a perturbed output
    layer (``batching_support.gguf_engine`` makes an engine of them)."""
    directory = tmp_path_factory.mktemp("batching-gguf")
    target = write_gguf_model(directory / "target.gguf", types=MIXED)
    return {"target": target, "draft": perturbed_file(target, directory / "draft.gguf", "output.weight", 0.3)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Tiny transformers checkpoints for the CLI: a target, a draft of its vocabulary, and one of
    another vocabulary (one token more)."""
    from server_support import build_tokenizer, save_checkpoint

    root = tmp_path_factory.mktemp("cli")
    tokenizer = build_tokenizer()  # byte-level BPE, like Qwen's
    vocab = len(tokenizer)
    target = tiny_qwen2(seed=0, vocab_size=vocab)
    other_tokenizer = build_tokenizer()
    other_tokenizer.add_tokens(["<extra>"])  # one token more: not the target's vocabulary
    return {
        "target": save_checkpoint(root / "target", target, tokenizer),
        "draft": save_checkpoint(root / "draft", perturbed_copy(target, noise=0.3, seed=2), tokenizer),
        "other": save_checkpoint(root / "other", tiny_qwen2(seed=3, vocab_size=vocab + 1), other_tokenizer),
    }


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A ``$VERISPEC_HOME`` of the test's own; a module takes it for all its tests with
    ``pytestmark = pytest.mark.usefixtures("home")``."""
    monkeypatch.setenv("VERISPEC_HOME", str(tmp_path))
    return tmp_path
