"""Which drafters an engine gets, decided in one place.

Builds the drafters of a loaded pair (:func:`build_drafters`: every declared drafter class builds
itself from the pair, :meth:`~verispec.proposers.base.Proposer.build`), completes them with the lookup drafters every
engine has (:func:`with_lookup_drafters`: n-gram and suffix lookup and their trees), and copies a
set for another sequence (:func:`for_new_sequence`) or with a fresh suffix cache
(:func:`with_own_suffix_cache`). The engine sees only :class:`~verispec.proposers.base.Proposer`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from verispec.errors import InvalidParameterError
from verispec.models.loading import LoadedModel
from verispec.proposers.base import DrafterSources, Proposer
from verispec.proposers.declared import Kind, Needs, declared_drafters
from verispec.proposers.draft_tree import validate_tree_choices
from verispec.proposers.eagle import AUTO_HEAD_QUANTIZATION, HEAD_QUANTIZATIONS, head_quantization_for
from verispec.proposers.layer_skip import DEFAULT_LAYER_SKIP_FRACTION, layer_skip_drafter
from verispec.proposers.suffix import SuffixCache, SuffixProposer, SuffixTreeProposer
from verispec.runners import Runner

__all__ = [
    "AUTO_HEAD_QUANTIZATION",
    "DEFAULT_LAYER_SKIP_FRACTION",
    "DRAFT_QUANTIZATIONS",
    "HEAD_QUANTIZATIONS",
    "DrafterOptions",
    "build_drafters",
    "chain_wrappers",
    "for_new_sequence",
    "head_quantization_for",
    "layer_skip_drafter",
    "with_lookup_drafters",
    "with_own_suffix_cache",
]

# --draft-quantization: the runner each one needs (None: any); "gguf" ones are re-quantizations the
# gguf runner applies as it loads (auto picks one when the runner is gguf)
DRAFT_QUANTIZATIONS = {"auto": None, "none": None, "int8": "torch", "q4_0": "gguf", "iq4_nl": "gguf"}


@dataclass(frozen=True)
class DrafterOptions:
    """How the drafters are built.

    Attributes:
        min_ngram, max_ngram: suffix lengths n-gram lookup tries (longest first).
        layer_skip_layers: target layers the layer-skip drafter runs; None = a quarter of the
            target's layers; 0 = no layer-skip drafter.
        draft_quantization: ``"none"`` (the draft as loaded); ``"int8"`` (weight-only, per output
            channel, torch runner); ``"iq4_nl"`` or ``"q4_0"`` (gguf runner: the draft's matrices
            stored in more than 4.5 bits per weight, Q5_0 / Q8_0 / Q6_K, re-quantized to 4.5 bits
            as they load, once, then read from ``$VERISPEC_HOME/weights``, so a draft step reads
            fewer bytes); ``"auto"`` (default): ``iq4_nl`` on the gguf runner, ``none``
            elsewhere. Each changes only what the draft proposes, never the output. The default
            pair on the gguf runner, HumanEval dev prompts 0-9, greedy, 128 tokens, draft k = 4,
            one run, alone (2026-12-02, the since-removed ``scripts/draft_quantization_ab.py``; now
            ``verispec bench --draft-quantization``): a draft step costs 0.254
            (iq4_nl) / 0.252 (q4_0) / 0.333 (as stored) of a target step, acceptance rate 0.853 /
            0.822 / 0.872, 1.798x / 1.790x / 1.631x plain decoding, every output identical to plain.
        tree_choices: a static shape for the draft model's token trees (Medusa-style paths of
            child ranks, :func:`verispec.proposers.draft_tree.validate_tree_choices`); None =
            the dynamic EAGLE-2-style tree.
        draft_context_window: prompt tokens the draft model sees (the last ones; None: all). The
            draft prefills them outside the target's passes before its first proposal, which short
            answers to long prompts never earn back. Measured on 3 Spec-Bench questions of each of
            10 categories (gguf pair, alone, decode speedup of ``auto`` over plain, all windows
            interleaved per question in one run): rag 1.031 / 1.031 / 0.791 and extraction 1.194 /
            1.169 / 0.956 with windows 32 / 64 / 256, the other 8 categories within noise of each
            other (sum of the 10 speedups 11.551 / 11.653 / 10.937). Earlier, on 20 JSON prompts,
            the whole prompt gave 32.71 decode tokens/s against 49.17 with 256. Output never
            changes (the target verifies).
        eagle_head: an EAGLE-3 head file (``verispec train-head``; :class:`verispec.runners.eagle.head.EagleHead`)
            or a published EAGLE-3 folder (:mod:`verispec.runners.eagle.published`, converted once)
            for the ``eagle`` drafter over the target runner's own features; None: no ``eagle``.
        datastore: a corpus datastore directory (``verispec datastore build``) the suffix drafter
            also looks its continuations up in; None: none. Opened when the drafters are built.
        head_quantization: the head's linear layers at inference: ``none`` (float32, torch),
            ``q8_0`` or ``iq4_nl`` (GGUF blocks run by the gguf kernels), ``auto``
            (:data:`AUTO_HEAD_QUANTIZATION` over the gguf runner, else none). Changes only what
            the head drafts, never the output (the target verifies). Measured on an AVX2 host
            (AMD EPYC, 2 cores; the 1.5B target's shapes, 32000 draft rows, one drafted row after
            64 cached, alone): float32 25.93 ms a row (0.398 of the target's 65.1 ms k = 1 pass),
            Q8_0 5.94 ms (0.091), IQ4_NL 4.40 ms (0.068).
    Raises:
        InvalidParameterError: an unknown quantization, a negative layer count, bad tree choices
            or a window below 1.
    """

    min_ngram: int = 2
    max_ngram: int = 4
    layer_skip_layers: int | None = None
    draft_quantization: str = "auto"
    tree_choices: tuple[tuple[int, ...], ...] | None = None
    draft_context_window: int | None = 64
    eagle_head: str | Path | None = None
    head_quantization: str = "auto"
    datastore: str | Path | None = None

    def __post_init__(self) -> None:
        if self.head_quantization not in HEAD_QUANTIZATIONS:
            raise InvalidParameterError(
                f"unknown head quantization {self.head_quantization!r}; choose one of {', '.join(HEAD_QUANTIZATIONS)}"
            )
        if self.draft_context_window is not None and self.draft_context_window < 1:
            raise InvalidParameterError(f"draft_context_window must be >= 1 or None, got {self.draft_context_window}")
        if self.tree_choices is not None:
            object.__setattr__(self, "tree_choices", validate_tree_choices(self.tree_choices))
        if self.draft_quantization not in DRAFT_QUANTIZATIONS:
            raise InvalidParameterError(
                f"unknown draft quantization {self.draft_quantization!r}; "
                f"choose one of {', '.join(DRAFT_QUANTIZATIONS)}"
            )
        if self.layer_skip_layers is not None and self.layer_skip_layers < 0:
            raise InvalidParameterError(f"layer_skip_layers must be >= 0, got {self.layer_skip_layers}")


def build_drafters(
    options: DrafterOptions,
    target: LoadedModel,
    draft_runner: Runner | None = None,
    tree_runner: Runner | None = None,
    target_runner: Runner | None = None,
    suffix_cache: SuffixCache | None = None,
) -> dict[str, Proposer]:
    """The drafters of a loaded pair, by name: each declared drafter class
    (:func:`~verispec.proposers.declared.declared_drafters`, in priority order) builds itself
    from the pair (:meth:`Proposer.build`): ``ngram`` and ``suffix`` always (over ``suffix_cache``,
    the pipeline's cache of past requests, and ``options.datastore``), ``draft`` over
    ``draft_runner``, ``tree`` over ``tree_runner`` (the draft's weights, its own KV cache, or the
    chain's sequence when it is the same runner), ``eagle`` (``options.eagle_head`` over
    ``target_runner``'s embedding and features) and ``layer-skip`` over ``target`` (unless
    disabled or, by default, unsupported).

    Raises:
        VerispecError: a missing or damaged datastore (:class:`verispec.proposers.datastore.Datastore`).
        InvalidParameterError: an explicit layer-skip layer count the target cannot run; a head
            for another target, or a runner that cannot hand its features or embedding to it.
        ModelNotFoundError, ModelIntegrityError: no head file, or a damaged one.
    """
    built: dict[str, Proposer] = {}
    sources = DrafterSources(options, target, draft_runner, tree_runner, target_runner, suffix_cache, built)
    for name, cls in declared_drafters().items():
        proposer = cls.build(sources)
        if proposer is not None:
            built[name] = proposer
    return built


def with_lookup_drafters(proposers: Mapping[str, Proposer] | None) -> dict[str, Proposer]:
    """``proposers`` and the lookup drafters every engine has, where absent: ``ngram`` (prompt
    lookup), ``suffix`` (one cache of past requests per engine) and the trees over them.

    Raises:
        InvalidParameterError: an object that is not a :class:`Proposer`.
    """
    proposers = dict(proposers or {})
    for name, proposer in proposers.items():
        if not isinstance(proposer, Proposer):
            raise InvalidParameterError(
                f"drafter {name!r} is a {type(proposer).__name__}: drafters subclass verispec.proposers.Proposer"
            )
    drafters = declared_drafters()
    for name, cls in drafters.items():
        if cls.declaration.kind is Kind.LOOKUP and cls.declaration.needs is Needs.NOTHING:
            proposers.setdefault(name, cls())
    for name, (tree_type, chain_type) in chain_wrappers(drafters).items():
        if isinstance(proposers.get(tree_type.declaration.chain), chain_type):  # method "tree": lookup branches first
            proposers.setdefault(name, tree_type(proposers[tree_type.declaration.chain]))
    return proposers


def chain_wrappers(drafters: Mapping[str, type]) -> dict[str, tuple[type, type]]:
    """The declared trees built over their chain drafter and sharing its index (``wraps_chain``:
    ``Tree(chain)``, and ``tree.over(chain)`` for another sequence): name -> (tree class, chain class)."""
    return {
        name: (cls, drafters[cls.declaration.chain])
        for name, cls in drafters.items()
        if cls.declaration.wraps_chain and cls.declaration.chain in drafters
    }


def for_new_sequence(proposers: Mapping[str, Proposer]) -> dict[str, Proposer]:
    """Each drafter for another sequence (its own caches and state); a tree over a chain drafter
    wraps the new chain drafter, so the two keep sharing one index, and drafters over one draft
    sequence (:meth:`~verispec.proposers.DraftCacheSequences.on_sequence_of`) share the new one.

    Raises:
        ValueError: a drafter that cannot follow another sequence.
    """
    wrappers = chain_wrappers(declared_drafters())
    fresh: dict[str, Proposer] = {}
    for name, p in proposers.items():
        if name in wrappers:
            continue
        partner = next((n for n in fresh if proposers[n] is not p and proposers[n].shares_sequence_with(p)), None)
        fresh[name] = p.on_sequence_of(fresh[partner]) if partner is not None else p.new_sequence()
    for tree_name, (tree_type, chain_type) in wrappers.items():
        tree, chain_name = proposers.get(tree_name), tree_type.declaration.chain
        if isinstance(tree, tree_type) and isinstance(fresh.get(chain_name), chain_type):
            fresh[tree_name] = tree.over(fresh[chain_name])  # its own settings kept
        elif tree is not None:
            fresh[tree_name] = tree.new_sequence()
    return fresh


def with_own_suffix_cache(proposers: Mapping[str, Proposer]) -> dict[str, Proposer]:
    """The same drafters, but the suffix drafter over its own empty cache (same settings and
    datastore) under every name it was loaded with, and its tree rebuilt over it."""
    suffix = proposers.get("suffix")
    if not isinstance(suffix, SuffixProposer):
        return dict(proposers)
    fresh = suffix.with_empty_cache()
    rebuilt = {
        name: fresh if p is suffix else p
        for name, p in proposers.items()
        if not (name == "suffix-tree" and isinstance(p, SuffixTreeProposer))
    }
    return with_lookup_drafters(rebuilt)
