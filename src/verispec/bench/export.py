"""The advised speculative setup written for the engines teams run in production.

``verispec advise --export vllm|sglang|transformers`` turns the advice (drafter and draft length)
into what reproduces it there: vLLM's ``--speculative-config`` JSON (its ``SpeculativeConfig``
fields), SGLang's ``--speculative-*`` server arguments, or transformers' ``generate`` keyword
arguments (assisted generation / prompt lookup). An EAGLE head is named by the folder of its
Hugging Face EAGLE-3 checkpoint (:mod:`verispec.runners.eagle.hf` writes it; vLLM's ``eagle3``
method, SGLang's ``EAGLE3`` algorithm). Pure data: no measurement, no I/O.

Models: a built-in GGUF is named by the Hugging Face checkpoint it was converted from (GPU
engines run that checkpoint, not our 4-bit file, so their acceptance will differ somewhat from
what was measured here); a local Hugging Face directory or a hub id is passed through; a local
``.gguf`` file is passed through with a note (vLLM loads GGUF experimentally, SGLang and
transformers want a checkpoint).
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field

from verispec.engine.methods import HEAD_DRAFTERS
from verispec.errors import InvalidParameterError
from verispec.models.registry import BUILTIN_MODELS
from verispec.proposers.eagle import TREE_BRANCHING, TREE_MAX_DEPTH

EXPORT_TOOLS = ("vllm", "sglang", "transformers")
PLAIN_METHODS = (None, "none")
EAGLE_METHODS = HEAD_DRAFTERS  # the methods over an EAGLE head (as the drafters declare)
EAGLE_TOOLS = ("vllm", "sglang")  # the tools that serve EAGLE-3 heads


@dataclass(frozen=True)
class ExportedSetup:
    """One tool's configuration of the advised setup.

    Attributes:
        tool: ``"vllm"``, ``"sglang"`` or ``"transformers"``.
        config: the configuration as JSON-ready data (vLLM: ``{"model", "speculative_config"}``;
            SGLang: ``ServerArgs`` fields; transformers: ``{"model", "assistant_model",
            "assistant_generation_config", "generate_kwargs"}``: the assistant's settings go on
            its own ``generation_config``, where assisted generation reads them).
        command: a command line (or Python line) that uses it.
        notes: what the user should know (model naming, differences from verispec).
    """

    tool: str
    config: dict
    command: str
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(
            {"tool": self.tool, "config": self.config, "command": self.command, "notes": self.notes}, indent=2
        )


def model_id(ref: str) -> tuple[str, list[str]]:
    """The name another engine loads for verispec model reference ``ref``, and notes about it."""
    builtin = BUILTIN_MODELS.get(ref)
    if builtin is not None and builtin.hub_id:
        return builtin.hub_id, [
            f"{ref} is {builtin.hub_id} quantized to {builtin.quantization} for verispec; "
            f"the GPU engine runs the checkpoint, so its acceptance can differ from what was measured here"
        ]
    if ref.lower().endswith(".gguf"):
        return ref, [f"{ref} is a GGUF file: give the engine the Hugging Face checkpoint it came from for full support"]
    return ref, []


def export_setup(
    tool: str,
    method: str | None,
    num_speculative_tokens: int | None,
    target: str,
    draft: str | None,
    *,
    min_ngram: int = 2,
    max_ngram: int = 4,
    suffix_spec_factor: float = 2.0,
    eagle_dir: str | None = None,
) -> ExportedSetup:
    """``tool``'s configuration of speculating with ``method`` (``draft``, ``ngram``, ``suffix``,
    ``eagle``, ``eagle-tree``; None / ``"none"``: plain decoding, the advice was NO-GO) drafting
    ``num_speculative_tokens`` tokens per target pass (``eagle-tree``: tree nodes), for verispec
    model references ``target`` / ``draft``; ``eagle_dir``: the head's EAGLE-3 checkpoint folder.

    ``min_ngram`` / ``max_ngram``: n-gram lookup's match lengths; ``suffix_spec_factor``: suffix
    drafting's draft budget per matched token (SuffixDecoding's ``max_spec_factor``, Oliaro et al.
    2025 §3; verispec drafts up to ``ceil(2 * match length)``).

    Raises:
        InvalidParameterError: an unknown tool, a method the tool has no equivalent of (the
            message names what comes closest), a draft method without a draft model, or a
            draft length < 1, an EAGLE method without ``eagle_dir`` or for transformers (it has
            no EAGLE-3 drafting).
    """
    if tool not in EXPORT_TOOLS:
        raise InvalidParameterError(f"unknown export target {tool!r}; choose one of {', '.join(EXPORT_TOOLS)}")
    target_id, notes = model_id(target)
    if method in PLAIN_METHODS:
        notes = notes + ["speculation did not pay on the measured workload: this is plain decoding"]
        return _plain(tool, target_id, notes)
    if num_speculative_tokens is None or num_speculative_tokens < 1:
        raise InvalidParameterError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
    k = num_speculative_tokens
    draft_id = None
    if method == "draft":
        if draft is None:
            raise InvalidParameterError("method 'draft' needs a draft model to export")
        draft_id, draft_notes = model_id(draft)
        notes = notes + draft_notes
    elif method in EAGLE_METHODS:
        if tool == "transformers":
            raise InvalidParameterError(
                "transformers has no EAGLE-3 drafting: export to vllm or sglang, or 'draft' (advise --methods)"
            )
        if eagle_dir is None:
            raise InvalidParameterError(f"method {method!r} needs the head's EAGLE-3 checkpoint folder to export")
        return _eagle(tool, method, k, target_id, eagle_dir, notes)
    elif method not in ("ngram", "suffix"):
        raise InvalidParameterError(
            f"{tool} has no equivalent of verispec's {method!r} drafter: export 'draft' or 'ngram' (advise --methods)"
        )
    if tool == "vllm":
        return _vllm(method, k, target_id, draft_id, min_ngram, max_ngram, suffix_spec_factor, notes)
    if tool == "sglang":
        if method == "suffix":
            raise InvalidParameterError(
                "sglang has no suffix drafting: its NGRAM algorithm is the closest (advise --methods ngram)"
            )
        return _sglang(method, k, target_id, draft_id, min_ngram, max_ngram, notes)
    if method == "suffix":
        raise InvalidParameterError("transformers has no suffix drafting: prompt lookup (ngram) is the closest")
    return _transformers(method, k, target_id, draft_id, max_ngram, notes)


def _plain(tool: str, target_id: str, notes: list[str]) -> ExportedSetup:
    if tool == "vllm":
        return ExportedSetup(
            tool, {"model": target_id, "speculative_config": None}, f"vllm serve {shlex.quote(target_id)}", notes
        )
    if tool == "sglang":
        return ExportedSetup(
            tool,
            {"model_path": target_id},
            f"python -m sglang.launch_server --model-path {shlex.quote(target_id)}",
            notes,
        )
    return ExportedSetup(
        tool,
        {"model": target_id, "assistant_model": None, "assistant_generation_config": None, "generate_kwargs": {}},
        "model.generate(**inputs)",
        notes,
    )


def _vllm(method, k, target_id, draft_id, min_ngram, max_ngram, spec_factor, notes) -> ExportedSetup:
    if method == "draft":
        spec = {"method": "draft_model", "model": draft_id, "num_speculative_tokens": k}
    elif method == "ngram":
        spec = {
            "method": "ngram",
            "num_speculative_tokens": k,
            "prompt_lookup_min": min_ngram,
            "prompt_lookup_max": max_ngram,
        }
    else:
        spec = {"method": "suffix", "num_speculative_tokens": k, "suffix_decoding_max_spec_factor": spec_factor}
        notes = notes + ["vLLM's suffix method needs the arctic-inference package (pip install arctic-inference)"]
    command = f"vllm serve {shlex.quote(target_id)} --speculative-config {shlex.quote(json.dumps(spec))}"
    return ExportedSetup("vllm", {"model": target_id, "speculative_config": spec}, command, notes)


def _eagle(tool, method, k, target_id, eagle_dir, notes) -> ExportedSetup:
    """EAGLE-3 with the head's checkpoint: a chain of ``k`` drafts, or (``eagle-tree``) SGLang's
    top-k tree of ``k`` nodes; vLLM's trees are experimental, so it gets the tree's depth as a chain."""
    notes = notes + ["the head was trained on verispec's quantized target; on the checkpoint its acceptance can differ"]
    if tool == "vllm":
        depth = k
        if method == "eagle-tree":
            depth = min(k, TREE_MAX_DEPTH)
            notes = notes + [
                f"vLLM drafts EAGLE-3 chains here: verispec's tree of {k} nodes becomes a chain of {depth}"
            ]
        spec = {"method": "eagle3", "model": eagle_dir, "num_speculative_tokens": depth}
        command = f"vllm serve {shlex.quote(target_id)} --speculative-config {shlex.quote(json.dumps(spec))}"
        return ExportedSetup("vllm", {"model": target_id, "speculative_config": spec}, command, notes)
    steps, topk = (k, 1) if method == "eagle" else (min(k, TREE_MAX_DEPTH), TREE_BRANCHING)
    args = {
        "model_path": target_id,
        "speculative_algorithm": "EAGLE3",
        "speculative_draft_model_path": eagle_dir,
        "speculative_num_steps": steps,
        "speculative_eagle_topk": topk,
        "speculative_num_draft_tokens": k + 1,
    }
    flags = " ".join(f"--{name.replace('_', '-')} {shlex.quote(str(value))}" for name, value in args.items())
    return ExportedSetup("sglang", args, f"python -m sglang.launch_server {flags}", notes)


def _sglang(method, k, target_id, draft_id, min_ngram, max_ngram, notes) -> ExportedSetup:
    # a chain of k draft tokens: k steps, top-1, k + 1 tokens verified (the last accepted one and the drafts)
    args = {"model_path": target_id}
    if method == "draft":
        args.update(
            speculative_algorithm="STANDALONE",
            speculative_draft_model_path=draft_id,
            speculative_num_steps=k,
            speculative_eagle_topk=1,
            speculative_num_draft_tokens=k + 1,
        )
    else:
        args.update(
            speculative_algorithm="NGRAM",
            speculative_num_draft_tokens=k + 1,
            speculative_ngram_min_match_window_size=min_ngram,
            speculative_ngram_max_match_window_size=max_ngram,
            speculative_ngram_max_bfs_breadth=1,
        )
        notes = notes + [
            "SGLang's NGRAM algorithm runs on CUDA only and matches against a cache of earlier "
            "requests as well as this one; these flag names are SGLang 0.5's"
        ]
    flags = " ".join(f"--{name.replace('_', '-')} {shlex.quote(str(value))}" for name, value in args.items())
    return ExportedSetup("sglang", args, f"python -m sglang.launch_server {flags}", notes)


def _transformers(method, k, target_id, draft_id, max_ngram, notes) -> ExportedSetup:
    if method == "draft":
        # transformers' assisted generation reads these from the assistant's own generation
        # config, not from generate()'s kwargs (AssistedCandidateGenerator); threshold 0: always k
        assistant = {
            "num_assistant_tokens": k,
            "num_assistant_tokens_schedule": "constant",
            "assistant_confidence_threshold": 0.0,
        }
        command = (
            f"assistant = AutoModelForCausalLM.from_pretrained({draft_id!r}); "
            + "; ".join(f"assistant.generation_config.{key} = {value!r}" for key, value in assistant.items())
            + "; model.generate(**inputs, assistant_model=assistant)"
        )
        config = {
            "model": target_id,
            "assistant_model": draft_id,
            "assistant_generation_config": assistant,
            "generate_kwargs": {},
        }
        return ExportedSetup("transformers", config, command, notes)
    kwargs = {"prompt_lookup_num_tokens": k, "max_matching_ngram_size": max_ngram}
    command = "model.generate(**inputs, " + ", ".join(f"{key}={value!r}" for key, value in kwargs.items()) + ")"
    notes = notes + ["transformers' prompt lookup also tries 1-token matches (verispec's shortest is min_ngram)"]
    config = {
        "model": target_id,
        "assistant_model": None,
        "assistant_generation_config": None,
        "generate_kwargs": kwargs,
    }
    return ExportedSetup("transformers", config, command, notes)
