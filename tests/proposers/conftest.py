"""Fixtures the drafters' test modules share."""

import pytest

from gguf_models import write_gguf_model


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    """The tiny GGUF model, for the EAGLE heads over the gguf runner (``test_eagle_drafter.py``,
    ``test_eagle_tree.py``)."""
    return write_gguf_model(tmp_path_factory.mktemp("eagle") / "target.gguf")
