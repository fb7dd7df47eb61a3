"""Fixtures the CLI's test modules share."""

from pathlib import Path

import pytest

from gguf_models import DRAFT_LIKE, MIXED, TOKENS, perturbed_copy, write_gguf_model


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """The tiny GGUF target, a draft of it, a Llama-architecture draft and a file of other token
    strings (``test_gguf_cli.py``, ``test_gguf_bench_cli.py``)."""
    directory = tmp_path_factory.mktemp("gguf-cli")
    target = write_gguf_model(directory / "target.gguf", MIXED)
    other_tokens = TOKENS[:3] + [t.upper() if t.isalpha() else t for t in TOKENS[3:]][::-1]  # same size, other strings
    return {
        "target": target,
        "draft": perturbed_copy(target, directory / "draft.gguf", "output.weight", 0.3),
        "llama": write_gguf_model(directory / "llama.gguf", DRAFT_LIKE, arch="llama", kv_heads=1, seed=2),
        "other": write_gguf_model(directory / "other.gguf", DRAFT_LIKE, seed=5, tokens=other_tokens),
    }
