"""Which runner executes a loaded model: the ``--runner`` choice, ``auto`` included.

Owns the names (gguf, int8, llamacpp, torch, auto), building a runner for a loaded model, and the
``auto`` decision: on a CPU, the batch-invariant gguf runner for every GGUF file it can run
(exact under speculation, and the fastest we measured) unless its kernels would run on their
portable path here and llama.cpp is installed, else the fastest of the others by cached cost
curves (measured on first use in seconds, see :mod:`verispec.runners.costs`; int8 only where its
fast kernel is exact). A slow choice is said on stderr, once, and so is every step over ~2 s
(:mod:`verispec.runners.notices`). Knows nothing about drafting or decoding.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from verispec.errors import InvalidParameterError
from verispec.progress import announce_slow
from verispec.runners import Runner
from verispec.runners.costs import (
    COST_KS,
    QUICK_CURVE,
    CostCache,
    CostCurve,
    choose_runner,
    measure_cost_curve,
    model_key,
)
from verispec.runners.cpu.weight_cache import default_cache_dir
from verispec.runners.notices import int8_warning, kernel_key, portable_gguf_warning, say_once

RUNNERS = ("auto", "gguf", "int8", "llamacpp", "torch")
BATCH_INVARIANT = ("gguf", "int8")  # runners whose verify rows equal their decode rows, bit for bit
DEFAULT_MAX_CONTEXT = 4096  # the gguf / int8 / llama.cpp window without --max-context: min(the model's, this)


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
            None keeps the full head.
        draft_vocab_corpus: text files whose token counts choose those rows; empty: the BPE
            merge-rank proxy (lowest ids).
    Raises:
        InvalidParameterError: unknown kind or a non-positive size.
    """

    kind: str = "torch"
    max_context_length: int | None = None
    draft_vocab_size: int | None = None
    draft_vocab_corpus: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in RUNNERS:
            raise InvalidParameterError(f"unknown runner {self.kind!r}; choose one of {', '.join(RUNNERS)}")
        if self.max_context_length is not None and self.max_context_length < 1:
            raise InvalidParameterError(f"max_context_length must be >= 1, got {self.max_context_length}")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise InvalidParameterError(f"draft_vocab_size must be >= 1, got {self.draft_vocab_size}")


def make_runner(
    kind: str, loaded, *, max_context_length: int | None = None, head_token_ids=None, requantize: str | None = None
) -> Runner:
    """A runner of kind ``kind`` (not ``auto``) over ``loaded`` (a ``LoadedModel``).

    ``head_token_ids`` ``[kept]``: reduced LM head (gguf, int8). ``requantize``: see
    :data:`verispec.runners.cpu.gguf_weights.REQUANTIZATIONS` (gguf only). Raises InvalidParameterError
    when the kind cannot run this model (no torch model, not a GGUF file, unsupported architecture
    or block type), ``requantize`` is asked of another runner, or ``max_context_length`` exceeds the
    model's trained context (no RoPE scaling here: positions past it are untrained).
    """
    if max_context_length is not None and max_context_length > loaded.context_length:
        raise InvalidParameterError(
            f"--max-context {max_context_length} exceeds {loaded.name}'s trained context of {loaded.context_length} tokens "
            f"(its context_length): give --max-context {loaded.context_length} or less"
        )
    if requantize is not None and kind != "gguf":
        raise InvalidParameterError(f"re-quantizing a draft ({requantize}) needs --runner gguf, not {kind}")
    if kind == "gguf":
        from verispec.runners.cpu.gguf_runner import GGUFRunner

        if loaded.path is None or Path(loaded.path).suffix != ".gguf":
            raise InvalidParameterError(f"the gguf runner needs a .gguf model; {loaded.name} is not one")
        capacity = max_context_length or min(loaded.context_length, DEFAULT_MAX_CONTEXT)
        return GGUFRunner.from_file(
            loaded.path,
            max_context_length=capacity,
            head_token_ids=head_token_ids,
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


def gguf_runner_supports(path: Path | None) -> str | None:
    """Why the gguf runner cannot run the file at ``path`` (None: it can).

    Reads the GGUF header only: what its architecture declares, and every weight matrix's block type.
    """
    from verispec.errors import InvalidParameterError, ModelIntegrityError
    from verispec.models.gguf_file import read_gguf_header
    from verispec.runners.cpu.gguf_arch import read_architecture
    from verispec.runners.cpu.gguf_blocks import SUPPORTED_TYPES

    if path is None or Path(path).suffix != ".gguf":
        return "not a GGUF file"
    try:
        header = read_gguf_header(Path(path))
    except ModelIntegrityError as exc:
        return str(exc)
    try:
        read_architecture(header)
    except InvalidParameterError as exc:
        return str(exc)
    for name, info in header.tensors.items():
        if (
            name.endswith(".weight")
            and len(info.shape) == 2
            and name != "token_embd.weight"
            and info.qtype not in SUPPORTED_TYPES
        ):
            return f"{name} is {info.type_name}"
    return None


def auto_picks_gguf(target_path: Path | None, draft_path: Path | None = None, device: str = "cpu") -> bool:
    """Whether ``auto`` runs these files on the gguf runner: on a CPU, when it supports both and
    its kernels build here (compiled on first use). A failed build is said on stderr, once, and
    ``auto`` falls back to the other runners."""
    if not str(device).startswith("cpu"):
        return False
    if gguf_runner_supports(target_path) is not None or (
        draft_path is not None and gguf_runner_supports(draft_path) is not None
    ):
        return False
    from verispec.runners.kernels import gguf_kernels

    try:
        gguf_kernels()
    except InvalidParameterError as exc:
        if not _WARNED:
            import sys

            print(f"verispec: warning: {exc}; --runner auto uses the other runners", file=sys.stderr)
            _WARNED.append(True)
        return False
    return True


_WARNED: list[bool] = []


def auto_file_runner(target_path: Path | None, draft_path: Path | None = None, device: str = "cpu") -> str | None:
    """The runner ``auto`` takes for these files without measuring: ``gguf`` where
    :func:`auto_picks_gguf`, but ``llamacpp`` when the gguf kernels would run on their portable
    path here and llama.cpp is installed; None: weigh the others by cost curves. A portable path
    is said on stderr, once, with the faster option."""
    from verispec.runners.kernels import kernel_isa
    from verispec.runners.llamacpp import llama_cpp_available

    if not auto_picks_gguf(target_path, draft_path, device):
        return None
    if kernel_isa() != "portable":
        return "gguf"
    installed = llama_cpp_available()
    say_once("portable", portable_gguf_warning(llama_cpp_installed=installed, auto_uses_llama_cpp=installed))
    return "llamacpp" if installed else "gguf"


def auto_candidates(path: Path | None, device: str = "cpu") -> list[str]:
    """Runners ``auto`` weighs for a model file: int8 on CPU where its fast kernel (oneDNN, AVX-512
    VNNI) is exact (else said once on stderr), llama.cpp for GGUF when installed.

    The transformers runner is the fallback (other devices, other architectures, no candidate);
    on this kind of CPU it is several times slower than int8 (``../shared/MODELS.md``).
    """
    from verispec.runners.llamacpp import llama_cpp_available

    if not str(device).startswith("cpu"):
        return ["torch"]
    candidates = ["int8"]
    warning = int8_warning(auto=True)
    if warning is not None:
        say_once("int8-auto", warning)
        candidates = []
    if path is not None and Path(path).suffix == ".gguf" and llama_cpp_available():
        candidates.append("llamacpp")
    return candidates


def resolve_auto(
    name: str,
    path: Path | None,
    build: Callable[[str], Runner],
    *,
    speculative: bool,
    device: str = "cpu",
    cache: CostCache | None = None,
    draft: tuple[str, Path | None, Callable[[str], Runner]] | None = None,
) -> str:
    """The runner ``auto`` picks for model ``name``: the fastest by (cached) cost curves.

    ``build(kind)`` makes a runner of that kind for the model (called only for curves not in
    the cache, then measured and cached). ``draft``: the draft's (name, path, build), whose
    cost(1) per token counts for speculative use. Runners that cannot load the model are
    skipped; falls back to ``"torch"``.
    """
    cache = cache or CostCache()
    targets: dict[str, CostCurve] = {}
    drafts: dict[str, CostCurve] = {}
    for kind in auto_candidates(path, device):
        curve = _curve(cache, name, path, kind, build)
        if curve is None:
            continue
        targets[kind] = curve
        if speculative and draft is not None:
            draft_curve = _curve(cache, draft[0], draft[1], kind, draft[2])
            if draft_curve is not None:
                drafts[kind] = draft_curve
    if not targets:
        return "torch"
    return choose_runner(targets, drafts if speculative else None)


def _curve(
    cache: CostCache, name: str, path: Path | None, kind: str, build: Callable[[str], Runner]
) -> CostCurve | None:
    key = model_key(name, path)
    curve = cache.get(key, kernel_key(kind))
    if curve is None:
        try:
            with announce_slow(
                f"loading {name} on the {kind} runner", "--runner auto times each candidate runner once"
            ):
                runner = build(kind)
        except InvalidParameterError:
            return None
        curve = _measure(runner, kind, key, name, "--runner auto picks the fastest runner by it")
        cache.put(key, curve)
    return curve


def _measure(runner: Runner, kind: str, key: str, name: str, why: str) -> CostCurve:
    """The quick cost curve (:data:`QUICK_CURVE`) of ``runner`` for model ``key``, named by its kernel path."""
    with announce_slow(f"timing the {kind} runner on {name}", f"{why}; once per CPU, model file and kernel path"):
        with torch.inference_mode():
            return measure_cost_curve(runner, runner_name=kernel_key(kind), model=key, **QUICK_CURVE)


@dataclass
class BuiltRunners:
    """The runners a pipeline uses: ``kind`` is the resolved choice (never ``auto``)."""

    kind: str
    target: Runner
    draft: Runner | None
    draft_tree: Runner | None = None  # a second draft runner (own cache) for tree drafting; None: no tree
    load_s: dict[str, float] = field(default_factory=dict)  # seconds each runner took to build ("target", "draft")
    weight_bytes: dict[str, int] = field(default_factory=dict)  # bytes of weights the runner holds, where it knows
    draft_requantize: str | None = None  # what the draft was re-quantized to as it loaded (gguf), None: as stored


def build_runners(
    options: RunnerOptions, target, draft=None, *, cache: CostCache | None = None, draft_requantize: str | None = None
) -> BuiltRunners:
    """Target and draft runners for loaded models (``LoadedModel``) as ``options`` asks.

    ``auto`` is resolved by cost curves (measured and cached on first use). The draft gets the
    reduced LM head when ``options.draft_vocab_size`` is set, and is re-quantized as it loads when
    ``draft_requantize`` is one of :data:`verispec.runners.cpu.gguf_weights.REQUANTIZATIONS` (``"auto"``:
    ``iq4_nl`` when the runner is gguf, else nothing). Raises
    InvalidParameterError when the kind cannot run the models, a reduced head is asked of a runner
    other than gguf / int8, or a re-quantization of a runner other than gguf.
    """
    kind = options.kind
    capacity = options.max_context_length
    device = "cpu" if target.model is None else str(next(target.model.parameters()).device)
    if kind == "auto":
        kind = auto_file_runner(target.path, None if draft is None else draft.path, device) or "auto"
    if kind == "auto":
        draft_spec = None
        if draft is not None:
            draft_spec = (
                draft.name,
                draft.path,
                lambda k: make_runner(k, draft, max_context_length=min(256, draft.context_length)),
            )
        kind = resolve_auto(
            target.name,
            target.path,
            lambda k: make_runner(k, target, max_context_length=min(256, target.context_length)),
            speculative=draft is not None,
            device=device,
            cache=cache,
            draft=draft_spec,
        )
    head_token_ids = None
    if options.draft_vocab_size is not None and draft is not None:
        if kind not in BATCH_INVARIANT:
            raise InvalidParameterError(f"a reduced draft vocabulary needs --runner gguf or int8, not {kind}")
        head_token_ids = draft_head_token_ids(
            options, draft, always=tuple(target.eos_token_ids) + tuple(draft.eos_token_ids)
        )
    if draft_requantize == "auto":
        draft_requantize = "iq4_nl" if kind == "gguf" else None
    if draft_requantize is not None and draft is not None and kind != "gguf":
        raise InvalidParameterError(
            f"--draft-quantization {draft_requantize} needs --runner gguf (or auto choosing it), not {kind}"
        )
    _warn_slow_kernels(kind)
    load_s: dict[str, float] = {}
    start = time.perf_counter()
    with announce_slow(f"loading the target {target.name} on the {kind} runner", "reading and repacking its weights"):
        target_runner = make_runner(kind, target, max_context_length=capacity)
    load_s["target"] = time.perf_counter() - start
    draft_runner = draft_tree = None
    if draft is not None:
        start = time.perf_counter()
        requantizing = f"; re-quantizing them to {draft_requantize} unless cached" if draft_requantize else ""
        with announce_slow(
            f"loading the draft {draft.name} on the {kind} runner", f"reading and repacking its weights{requantizing}"
        ):
            draft_capacity = (
                None if capacity is None else min(capacity, draft.context_length)
            )  # the drafter slides past it
            draft_runner = make_runner(
                kind,
                draft,
                max_context_length=draft_capacity,
                head_token_ids=head_token_ids,
                requantize=draft_requantize,
            )
        load_s["draft"] = time.perf_counter() - start
        if kind in BATCH_INVARIANT:  # same weights, its own KV cache
            draft_tree = type(draft_runner)(draft_runner.weights, max_context_length=draft_runner.max_context_length)
        elif kind == "torch":
            draft_tree = make_runner(kind, draft, max_context_length=draft_capacity)
    if kind == "gguf":  # seconds to measure: the controller then starts from this machine's costs
        _ensure_curve(cache or CostCache(), target, target_runner, kind)
        if draft_runner is not None and options.draft_vocab_size is None and draft_requantize is None:
            _ensure_curve(cache or CostCache(), draft, draft_runner, kind)
    weight_bytes = {
        role: runner.weights.nbytes()
        for role, runner in (("target", target_runner), ("draft", draft_runner))
        if runner is not None and hasattr(runner, "weights")
    }
    return BuiltRunners(
        kind,
        target_runner,
        draft_runner,
        draft_tree,
        load_s,
        weight_bytes,
        draft_requantize if draft_runner is not None else None,
    )


def _ensure_curve(cache: CostCache, loaded, runner: Runner, kind: str) -> None:
    key = model_key(loaded.name, loaded.path)
    if cache.get(key, kernel_key(kind)) is None and runner.max_context_length >= QUICK_CURVE["context_tokens"] + max(
        COST_KS
    ):
        cache.put(
            key, _measure(runner, kind, key, loaded.name, "the draft-length controller starts from this CPU's costs")
        )


def _warn_slow_kernels(kind: str) -> None:
    """Say once on stderr when the chosen runner runs a slow kernel here (gguf's portable path,
    int8 without oneDNN's exact product), naming the faster option."""
    from verispec.runners.kernels import kernel_isa
    from verispec.runners.llamacpp import llama_cpp_available

    warning = None
    if kind == "gguf" and kernel_isa() == "portable":
        warning = portable_gguf_warning(llama_cpp_installed=llama_cpp_available())
    elif kind == "int8":
        warning = int8_warning(auto=False)
    if warning is not None:
        say_once("portable" if kind == "gguf" else "int8", warning)


def draft_head_token_ids(options: RunnerOptions, draft, always: tuple[int, ...] = ()):
    """``[kept]`` token ids of the reduced draft head: top ``draft_vocab_size`` by corpus counts
    (or by the BPE-rank proxy without a corpus), plus ``always`` (EOS ids)."""
    from verispec.runners.cpu.reduced_vocab import corpus_counts, rank_counts, select_vocabulary

    vocab = draft.vocab_size
    if options.draft_vocab_corpus:
        counts = corpus_counts(draft.tokenizer, options.draft_vocab_corpus, vocab)
    else:
        counts = rank_counts(vocab)
    return select_vocabulary(counts, min(options.draft_vocab_size, vocab), [t for t in always if t < vocab])


def cached_curve(name: str, path: Path | None, kind: str, cache: CostCache | None = None) -> CostCurve | None:
    """The cached cost curve of ``kind`` for a model, if one was measured on this machine."""
    return (cache or CostCache()).get(model_key(name, path), kernel_key(kind))


def cached_auto_choice(
    name: str,
    path: Path | None,
    *,
    speculative: bool,
    device: str = "cpu",
    draft: tuple[str, Path | None] | None = None,
    cache: CostCache | None = None,
) -> str | None:
    """What ``auto`` would pick from cached curves alone; None when a candidate's curve is missing;
    ``"torch"`` when there is no candidate (as :func:`resolve_auto`)."""
    cache = cache or CostCache()
    targets, drafts = {}, {}
    for kind in auto_candidates(path, device):
        curve = cached_curve(name, path, kind, cache)
        if curve is None:
            return None
        targets[kind] = curve
        if speculative and draft is not None:
            draft_curve = cached_curve(draft[0], draft[1], kind, cache)
            if draft_curve is None:
                return None
            drafts[kind] = draft_curve
    if not targets:  # no candidate on this CPU (int8 left out, no llama.cpp): resolve_auto's fallback
        return "torch"
    return choose_runner(targets, drafts if speculative else None)
