"""Building the runners a pipeline uses: the ``--runner`` names (gguf, int8, llamacpp, torch, auto),
a runner of one kind for a loaded model, and the target, draft and tree-draft runners of the kind
a :class:`verispec.runners.choice.Choice` decided (``auto``'s untimed candidates timed first).
Every step over ~2 s is said on stderr. Knows nothing about which runner is best
(:mod:`verispec.runners.choice`), drafting or decoding.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from verispec.errors import InvalidParameterError
from verispec.progress import announce_slow
from verispec.runners import Runner
from verispec.runners.choice import Choice, Host, ModelFile, ModelFiles, measure, time_candidates
from verispec.runners.costs import COST_KS, QUICK_CURVE, CostCache, CostCurve, keep_curve, model_key
from verispec.runners.cpu.weight_cache import default_cache_dir

RUNNERS = ("auto", "gguf", "int8", "llamacpp", "torch")
BATCH_INVARIANT = ("gguf", "int8")  # runners whose verify rows equal their decode rows, bit for bit
DEFAULT_MAX_CONTEXT = 4096  # the gguf / int8 / llama.cpp window without --max-context: min(the model's, this)
# The draft's reduced head by default (gguf): the 32,768 lowest BPE ranks plus each sequence's tokens kept
# 0.620 of the full head's 0.646 draft acceptance on code, 0.306 of 0.318 on chat (Qwen2.5-Coder-0.5B
# draft, AMD Zen 4, draft chain k = 5), for a quarter of the head's bytes (the 151,936 rows were 27% of
# the bytes a draft pass read): `auto` +4-6% on code, within noise on chat (docs/benchmark-history.md).
DEFAULT_DRAFT_VOCAB = 32_768


@dataclass(frozen=True)
class RunnerOptions:
    """How models are run.

    Attributes:
        kind: ``"gguf"`` (the GGUF file's own 4-bit blocks, batch-invariant C++ kernels, CPU),
            ``"int8"`` (batch-invariant int8 re-quantization of a GGUF file or a torch model, CPU),
            ``"llamacpp"`` (GGUF through llama.cpp, needs the ``llamacpp`` extra; not exact under
            speculation), ``"torch"`` (transformers, any model, any device) or ``"auto"``
            (gguf where it can run the files, else the fastest by measured cost curves).
        max_context_length: the window in tokens (prompt + output), each sequence's KV capacity
            (``--max-context``); default min(trained context, :data:`DEFAULT_MAX_CONTEXT`), torch:
            the trained context. Above the target's trained context: refused; the draft gets at most its own.
        draft_vocab_size: keep only this many draft LM-head rows (FR-Spec; gguf and int8 runners);
            0 keeps the full head; None: :data:`DEFAULT_DRAFT_VOCAB` on the gguf runner for drafts
            of over twice as many tokens, else the full head.
        draft_context_rows: on the gguf runner a reduced draft head also scores every token its
            sequence has seen (:mod:`verispec.runners.cpu.context_head`).
        draft_vocab_corpus: text files whose token counts choose those rows; empty: the BPE
            merge-rank proxy (lowest ids).
    Raises:
        InvalidParameterError: unknown kind or a non-positive size.
    """

    kind: str = "torch"
    max_context_length: int | None = None
    draft_vocab_size: int | None = None
    draft_vocab_corpus: tuple[str, ...] = ()
    draft_context_rows: bool = True

    def __post_init__(self) -> None:
        if self.kind not in RUNNERS:
            raise InvalidParameterError(f"unknown runner {self.kind!r}; choose one of {', '.join(RUNNERS)}")
        if self.max_context_length is not None and self.max_context_length < 1:
            raise InvalidParameterError(f"max_context_length must be >= 1, got {self.max_context_length}")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 0:
            raise InvalidParameterError(
                f"draft_vocab_size must be >= 0 (0: the full head), got {self.draft_vocab_size}"
            )


def make_runner(
    kind: str,
    loaded,
    *,
    max_context_length: int | None = None,
    head_token_ids=None,
    context_rows: bool = False,
    requantize: str | None = None,
) -> Runner:
    """A runner of kind ``kind`` (not ``auto``) over ``loaded`` (a ``LoadedModel``).

    ``head_token_ids`` ``[kept]``: reduced LM head (gguf, int8); ``context_rows``: that head adds
    each sequence's tokens' rows (gguf only). ``requantize``: see
    :data:`verispec.runners.cpu.gguf_weights.REQUANTIZATIONS` (gguf only). Raises InvalidParameterError
    when the kind cannot run this model (no torch model, not a GGUF file, unsupported architecture
    or block type), ``requantize`` is asked of another runner, or ``max_context_length`` exceeds the
    model's trained context (no RoPE scaling here: positions past it are untrained).
    """
    if max_context_length is not None and max_context_length > loaded.context_length:
        raise InvalidParameterError(
            f"--max-context {max_context_length} exceeds {loaded.name}'s trained context of "
            f"{loaded.context_length} tokens (its context_length): give --max-context {loaded.context_length} or less"
        )
    if requantize is not None and kind != "gguf":
        raise InvalidParameterError(f"re-quantizing a draft ({requantize}) needs --runner gguf, not {kind}")
    if context_rows and kind != "gguf":
        raise InvalidParameterError(f"a draft head with context rows needs --runner gguf, not {kind}")
    if kind == "gguf":
        from verispec.runners.cpu.gguf_runner import GGUFRunner

        if loaded.path is None or Path(loaded.path).suffix != ".gguf":
            raise InvalidParameterError(f"the gguf runner needs a .gguf model; {loaded.name} is not one")
        capacity = max_context_length or min(loaded.context_length, DEFAULT_MAX_CONTEXT)
        return GGUFRunner.from_file(
            loaded.path,
            max_context_length=capacity,
            head_token_ids=head_token_ids,
            context_rows=context_rows,
            requantize=requantize,
            cache_dir=default_cache_dir(),
        )
    if kind == "llamacpp":
        from verispec.runners.llamacpp import LlamaCppRunner

        if loaded.path is None or Path(loaded.path).suffix != ".gguf":
            raise InvalidParameterError(f"the llama.cpp runner needs a .gguf model; {loaded.name} is not one")
        return LlamaCppRunner(loaded.path, max_context_length=max_context_length)
    if kind == "int8" and loaded.model is None and loaded.path is not None and Path(loaded.path).suffix == ".gguf":
        from verispec.runners.cpu.int8 import Int8Runner
        from verispec.runners.cpu.int8_gguf import int8_weights_from_gguf

        capacity = max_context_length or min(loaded.context_length, DEFAULT_MAX_CONTEXT)
        weights = int8_weights_from_gguf(
            loaded.path, capacity, head_token_ids=head_token_ids, cache_dir=default_cache_dir()
        )
        return Int8Runner(weights, max_context_length=capacity)
    if loaded.model is None:
        raise InvalidParameterError(
            f"the {kind} runner needs the model's weights in torch; {loaded.name} was loaded without"
        )
    if kind == "int8":
        from verispec.runners.cpu.int8 import Int8Runner

        if next(loaded.model.parameters()).device.type != "cpu":
            raise InvalidParameterError("the int8 runner runs on the CPU: use --runner torch on other devices")
        capacity = max_context_length or min(loaded.context_length, DEFAULT_MAX_CONTEXT)
        return Int8Runner.from_module(loaded.model, max_context_length=capacity, head_token_ids=head_token_ids)
    if kind == "torch":
        from verispec.runners.torch_runner import TransformersRunner

        return TransformersRunner(loaded.model, max_context_length=max_context_length or loaded.context_length)
    raise InvalidParameterError(f"unknown runner {kind!r}; choose one of {', '.join(RUNNERS[1:])}")


@dataclass
class BuiltRunners:
    """The runners a pipeline uses: ``choice`` is the decision, timed (its kind never ``auto``)."""

    choice: Choice
    target: Runner
    draft: Runner | None
    draft_tree: Runner | None = None  # the tree drafter's runner (gguf/int8: the draft's own, one cache); None: no tree
    load_s: dict[str, float] = field(default_factory=dict)  # seconds each runner took to build ("target", "draft")
    weight_bytes: dict[str, int] = field(default_factory=dict)  # bytes of weights the runner holds, where it knows
    draft_requantize: str | None = None  # what the draft was re-quantized to as it loaded (gguf), None: as stored
    target_curve: CostCurve | None = None  # the target's cost curve on this runner, measured on this machine

    @property
    def kind(self) -> str:
        return self.choice.kind


def build_runners(
    options: RunnerOptions,
    choice: Choice,
    target,
    draft=None,
    *,
    cache: CostCache | None = None,
    draft_requantize: str | None = None,
) -> BuiltRunners:
    """Target and draft runners for loaded models (``LoadedModel``) of the kind ``choice`` decided.

    An ``auto`` choice with untimed candidates is timed first (:func:`time_candidates`, curves
    measured and cached). The draft gets the reduced LM head when ``options.draft_vocab_size`` is
    set, and is re-quantized as it loads when ``draft_requantize`` is one of
    :data:`verispec.runners.cpu.gguf_weights.REQUANTIZATIONS` (``"auto"``: ``iq4_nl`` when the
    runner is gguf, else nothing). Raises InvalidParameterError when the kind cannot run the
    models, a reduced head is asked of a runner other than gguf / int8, or a re-quantization of a
    runner other than gguf.
    """
    capacity = options.max_context_length
    cache = cache or CostCache()
    if choice.kind == "auto":
        choice = _timed_choice(choice, target, draft, cache)
    kind = choice.kind
    head_token_ids, context_rows = _draft_head(options, kind, target, draft)
    if draft_requantize == "auto":
        draft_requantize = "iq4_nl" if kind == "gguf" else None
    if draft_requantize is not None and draft is not None and kind != "gguf":
        raise InvalidParameterError(
            f"--draft-quantization {draft_requantize} needs --runner gguf (or auto choosing it), not {kind}"
        )
    load_s: dict[str, float] = {}
    start = time.perf_counter()
    with announce_slow(f"loading the target {target.name} on the {kind} runner", "reading and repacking its weights"):
        target_runner = make_runner(kind, target, max_context_length=capacity)
    load_s["target"] = time.perf_counter() - start
    draft_runner = draft_tree = None
    if draft is not None:
        start = time.perf_counter()
        draft_runner, draft_tree = _draft_runners(
            kind, draft, capacity, (head_token_ids, context_rows), draft_requantize
        )
        load_s["draft"] = time.perf_counter() - start
    if kind == "gguf":  # seconds to measure: the controller then starts from this machine's costs
        _ensure_curve(cache, target, target_runner, choice)
        if draft_runner is not None and head_token_ids is None and draft_requantize is None:
            _ensure_curve(cache, draft, draft_runner, choice)
    weight_bytes = {
        role: runner.weights.nbytes()
        for role, runner in (("target", target_runner), ("draft", draft_runner))
        if runner is not None and runner.weights is not None
    }
    return BuiltRunners(
        choice,
        target_runner,
        draft_runner,
        draft_tree,
        load_s,
        weight_bytes,
        draft_requantize if draft_runner is not None else None,
        cache.get(model_key(target.name, target.path), choice.cost_key),
    )


def _timed_choice(choice: Choice, target, draft, cache: CostCache) -> Choice:
    """An ``auto`` choice decided: its untimed candidates timed (:func:`time_candidates`) and said."""
    device = "cpu" if target.model is None else str(next(target.model.parameters()).device)
    loaded = {"target": target, "draft": draft}

    def build(kind: str, role: str) -> Runner:
        model = loaded[role]
        return make_runner(kind, model, max_context_length=min(256, model.context_length))

    choice = time_candidates(choice, ModelFiles.of(target, draft), Host(device, cache), build)
    choice.say()
    return choice


def _draft_head(options: RunnerOptions, kind: str, target, draft) -> tuple[list[int] | None, bool]:
    """The reduced draft head's token ids (``options.draft_vocab_size``, or the default: see
    :class:`RunnerOptions`; the EOS ids always in), or None for the full head; and whether it adds
    each sequence's context rows (gguf).

    Raises:
        InvalidParameterError: a reduced head asked of a runner other than gguf / int8.
    """
    size = options.draft_vocab_size
    if size is None and kind == "gguf" and draft is not None and draft.vocab_size > 2 * DEFAULT_DRAFT_VOCAB:
        size = DEFAULT_DRAFT_VOCAB
    if not size or draft is None:
        return None, False
    if kind not in BATCH_INVARIANT:
        raise InvalidParameterError(f"a reduced draft vocabulary needs --runner gguf or int8, not {kind}")
    always = tuple(target.eos_token_ids) + tuple(draft.eos_token_ids)
    return draft_head_token_ids(options, draft, size, always), kind == "gguf" and options.draft_context_rows


def _draft_runners(kind: str, draft, capacity: int | None, head, requantize: str | None):
    """The draft's chain runner and its tree runner: the same sequence on a batch-invariant runner
    (its entries are the same bits either way), its own on the torch runner, none elsewhere."""
    requantizing = f"; re-quantizing them to {requantize} unless cached" if requantize else ""
    draft_capacity = None if capacity is None else min(capacity, draft.context_length)  # the drafter slides past it
    with announce_slow(
        f"loading the draft {draft.name} on the {kind} runner", f"reading and repacking its weights{requantizing}"
    ):
        draft_runner = make_runner(
            kind,
            draft,
            max_context_length=draft_capacity,
            head_token_ids=head[0],
            context_rows=head[1],
            requantize=requantize,
        )
    if kind in BATCH_INVARIANT:
        return draft_runner, draft_runner
    if kind == "torch":
        return draft_runner, make_runner(kind, draft, max_context_length=draft_capacity)
    return draft_runner, None


def _ensure_curve(cache: CostCache, loaded, runner: Runner, choice: Choice) -> None:
    key = model_key(loaded.name, loaded.path)
    if cache.get(key, choice.cost_key) is None and runner.max_context_length >= QUICK_CURVE["context_tokens"] + max(
        COST_KS
    ):
        why = "the draft-length controller starts from this CPU's costs"
        keep_curve(cache, key, measure(runner, choice.kind, ModelFile(loaded.name, loaded.path), why, choice.cost_key))


def draft_head_token_ids(options: RunnerOptions, draft, size: int, always: tuple[int, ...] = ()):
    """``[kept]`` token ids of the reduced draft head: top ``size`` by the options' corpus counts
    (or by the BPE-rank proxy without a corpus), plus ``always`` (EOS ids)."""
    from verispec.runners.cpu.reduced_vocab import corpus_counts, rank_counts, select_vocabulary

    vocab = draft.vocab_size
    if options.draft_vocab_corpus:
        counts = corpus_counts(draft.tokenizer, options.draft_vocab_corpus, vocab)
    else:
        counts = rank_counts(vocab)
    return select_vocabulary(counts, min(size, vocab), [t for t in always if t < vocab])
