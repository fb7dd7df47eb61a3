"""advise --export: the advised setup as vLLM, SGLang and transformers configuration."""

from __future__ import annotations

import json
from typing import Literal

import pytest
import torch
from pydantic import BaseModel, ConfigDict, Field
from transformers import GenerationConfig

from verispec.bench.export import export_setup, model_id
from verispec.errors import InvalidParameterError


class VLLMSpeculativeConfig(BaseModel):
    """The user-settable fields of vLLM's ``SpeculativeConfig`` (vllm/config/speculative.py, as
    documented there) that an export may use, with their documented types and bounds; anything
    else is refused, as vLLM refuses an unknown field."""

    model_config = ConfigDict(extra="forbid")

    num_speculative_tokens: int = Field(gt=0)
    model: str | None = None
    method: Literal["ngram", "medusa", "mlp_speculator", "draft_model", "suffix", "eagle", "eagle3"] | None = None
    draft_tensor_parallel_size: int | None = Field(default=None, ge=1)
    prompt_lookup_max: int | None = Field(default=None, ge=1)
    prompt_lookup_min: int | None = Field(default=None, ge=1)
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1


# SGLang's ServerArgs fields for speculative decoding (python/sglang/srt/server_args.py)
SGLANG_FIELDS = {
    "model_path",
    "speculative_algorithm",
    "speculative_draft_model_path",
    "speculative_num_steps",
    "speculative_eagle_topk",
    "speculative_num_draft_tokens",
    "speculative_ngram_min_match_window_size",
    "speculative_ngram_max_match_window_size",
    "speculative_ngram_max_bfs_breadth",
}


@pytest.mark.parametrize("method", ["draft", "ngram", "suffix"])
def test_vllm_export_validates_against_its_speculative_config(method):
    setup = export_setup("vllm", method, 6, "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct")
    spec = VLLMSpeculativeConfig.model_validate(setup.config["speculative_config"])
    assert spec.num_speculative_tokens == 6
    assert setup.config["model"] == "Qwen/Qwen2.5-Coder-1.5B-Instruct"
    assert {"draft": "draft_model", "ngram": "ngram", "suffix": "suffix"}[method] == spec.method
    if method == "draft":
        assert spec.model == "Qwen/Qwen2.5-Coder-0.5B-Instruct"
    if method == "ngram":
        assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (2, 4)
    if method == "suffix":
        assert spec.suffix_decoding_max_spec_factor == 2.0
    # the command carries the same JSON, quoted for a shell
    assert setup.command.startswith("vllm serve Qwen/Qwen2.5-Coder-1.5B-Instruct --speculative-config '")
    assert (
        json.loads(setup.command.split("--speculative-config ", 1)[1].strip("'")) == setup.config["speculative_config"]
    )


def test_vllm_refuses_an_unknown_field_so_the_check_can_fail():
    with pytest.raises(ValueError):
        VLLMSpeculativeConfig.model_validate({"num_speculative_tokens": 4, "speculative_model": "x"})


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_sglang_export_uses_its_server_arguments(method):
    setup = export_setup("sglang", method, 5, "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", max_ngram=3)
    assert set(setup.config) <= SGLANG_FIELDS
    assert setup.config["speculative_num_draft_tokens"] == 6  # the 5 drafts and the token they follow
    if method == "draft":
        assert setup.config["speculative_algorithm"] == "STANDALONE"
        assert setup.config["speculative_num_steps"] == 5 and setup.config["speculative_eagle_topk"] == 1
        assert setup.config["speculative_draft_model_path"] == "Qwen/Qwen2.5-Coder-0.5B-Instruct"
    else:
        assert setup.config["speculative_algorithm"] == "NGRAM"
        assert setup.config["speculative_ngram_max_match_window_size"] == 3
    assert "--speculative-algorithm " + setup.config["speculative_algorithm"] in setup.command


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_transformers_export_reaches_what_generate_drafts_with(method, monkeypatch, target_model, partial_draft_model):
    """Run transformers' own generate with the exported settings and read the draft length off
    the candidate generator it builds (where assisted generation / prompt lookup take k from)."""
    import copy

    from transformers.generation import candidate_generator as cg

    setup = export_setup("transformers", method, 7, "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct")
    GenerationConfig(**setup.config["generate_kwargs"]).validate(strict=True)
    seen = {}
    for cls in (cg.AssistedCandidateGenerator, cg.PromptLookupCandidateGenerator):

        def spy(self, *args, __init=cls.__init__, **kwargs):
            __init(self, *args, **kwargs)
            seen[type(self).__name__] = self

        monkeypatch.setattr(cls, "__init__", spy)
    target = copy.deepcopy(target_model)
    ids = torch.tensor([[5, 6, 7, 5, 6, 7, 5, 6]])
    if method == "draft":
        assistant = copy.deepcopy(partial_draft_model)
        for key, value in setup.config["assistant_generation_config"].items():
            setattr(assistant.generation_config, key, value)
        target.generate(
            ids, assistant_model=assistant, max_new_tokens=4, do_sample=False, **setup.config["generate_kwargs"]
        )
        made = seen["AssistedCandidateGenerator"]
        assert made.num_assistant_tokens == 7 and made.assistant_confidence_threshold == 0.0
        assert setup.config["assistant_model"] == "Qwen/Qwen2.5-Coder-0.5B-Instruct"
        assert "assistant.generation_config.num_assistant_tokens = 7" in setup.command
    else:
        target.generate(ids, max_new_tokens=4, do_sample=False, **setup.config["generate_kwargs"])
        made = seen["PromptLookupCandidateGenerator"]
        assert made.num_output_tokens == 7 and made.max_matching_ngram_size == 4
        assert setup.config["assistant_model"] is None


def test_transformers_ignores_a_draft_length_passed_to_generate(monkeypatch, target_model, partial_draft_model):
    """Why the export sets the assistant's generation config: given to generate(), k is not used."""
    import copy

    from transformers.generation import candidate_generator as cg

    seen = {}
    init = cg.AssistedCandidateGenerator.__init__

    def spy(self, *args, **kwargs):
        init(self, *args, **kwargs)
        seen["made"] = self

    monkeypatch.setattr(cg.AssistedCandidateGenerator, "__init__", spy)
    assistant = copy.deepcopy(partial_draft_model)
    copy.deepcopy(target_model).generate(
        torch.tensor([[5, 6, 7]]), assistant_model=assistant, max_new_tokens=2, do_sample=False, num_assistant_tokens=7
    )
    assert seen["made"].num_assistant_tokens != 7


@pytest.mark.parametrize(
    "method, k, depth",
    [
        ("eagle", 5, 5),  # a chain of 5 drafts
        ("eagle-tree", 10, 6),  # vLLM gets the tree's depth (6 levels at most) as a chain
    ],
)
def test_vllm_eagle_export_names_the_heads_checkpoint(method, k, depth):
    setup = export_setup("vllm", method, k, "qwen2.5-coder-1.5b-instruct", None, eagle_dir="/heads/h-eagle3")
    spec = VLLMSpeculativeConfig.model_validate(setup.config["speculative_config"])
    assert (spec.method, spec.model, spec.num_speculative_tokens) == ("eagle3", "/heads/h-eagle3", depth)
    assert any("quantized target" in note for note in setup.notes)
    assert (method == "eagle-tree") == any("becomes a chain of 6" in note for note in setup.notes)


@pytest.mark.parametrize(
    "method, k, steps, topk",
    [
        ("eagle", 4, 4, 1),  # a chain: 4 steps of top-1
        ("eagle-tree", 10, 6, 2),  # verispec's tree: top-2 children per node, 6 levels, 10 nodes
    ],
)
def test_sglang_eagle_export_uses_its_eagle3_algorithm(method, k, steps, topk):
    setup = export_setup("sglang", method, k, "qwen2.5-coder-1.5b-instruct", None, eagle_dir="/heads/h-eagle3")
    assert set(setup.config) <= SGLANG_FIELDS
    assert (
        setup.config["speculative_algorithm"] == "EAGLE3"
        and setup.config["speculative_draft_model_path"] == "/heads/h-eagle3"
    )
    assert (setup.config["speculative_num_steps"], setup.config["speculative_eagle_topk"]) == (steps, topk)
    assert setup.config["speculative_num_draft_tokens"] == k + 1  # the drafts and the token they follow
    assert "--speculative-draft-model-path /heads/h-eagle3" in setup.command


def test_a_no_go_exports_plain_decoding():
    setup = export_setup("vllm", None, None, "qwen2.5-coder-1.5b-instruct", None)
    assert setup.config["speculative_config"] is None and setup.command == "vllm serve Qwen/Qwen2.5-Coder-1.5B-Instruct"
    assert any("did not pay" in note for note in setup.notes)


@pytest.mark.parametrize(
    "tool, method, draft, message",
    [
        ("tgi", "ngram", None, "unknown export target"),
        ("sglang", "suffix", None, "no suffix drafting"),
        ("transformers", "suffix", None, "no suffix drafting"),
        ("vllm", "layer-skip", None, "no equivalent"),
        ("vllm", "draft", None, "needs a draft model"),
        ("vllm", "eagle", None, "needs the head's EAGLE-3 checkpoint"),
        ("transformers", "eagle", None, "no EAGLE-3 drafting"),  # said first: advise writes no checkpoint for it
    ],
)
def test_what_a_tool_cannot_do_is_a_clear_error(tool, method, draft, message):
    eagle_dir = draft if method == "eagle" else None
    with pytest.raises(InvalidParameterError, match=message):
        export_setup(
            tool, method, 4, "qwen2.5-coder-1.5b-instruct", None if method == "eagle" else draft, eagle_dir=eagle_dir
        )


def test_model_names_map_to_the_checkpoints_gpu_engines_load():
    assert model_id("qwen2.5-coder-0.5b-instruct")[0] == "Qwen/Qwen2.5-Coder-0.5B-Instruct"
    assert model_id("org/model") == ("org/model", [])
    name, notes = model_id("/models/m.gguf")
    assert name == "/models/m.gguf" and "GGUF" in notes[0]
