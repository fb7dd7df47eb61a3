"""Which runner executes a model pair, decided once.

:func:`choose_runner` reads the files' GGUF headers, this host's kernels and the cached cost
curves, and returns a :class:`Choice`: the runner, its kernel path, the reasons, and what the user
is told about it (said once per process, :meth:`Choice.say`). ``auto`` takes, on a CPU, the
batch-invariant gguf runner for every GGUF file it can run (exact under speculation, and the
fastest we measured) unless its kernels would run on their portable path here and llama.cpp is
installed, else the fastest of the others by cached cost curves (int8 only where its fast kernel
is exact); a curve not cached yet is measured once the models are loaded
(:func:`time_candidates`, seconds, see :mod:`verispec.runners.costs`). Everything after the
choice reads it. Knows nothing about building runners (:mod:`verispec.runners.select`), drafting
or decoding.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from verispec.errors import InvalidParameterError
from verispec.progress import announce_slow
from verispec.runners import Runner
from verispec.runners.costs import (
    QUICK_CURVE,
    CostCache,
    CostCurve,
    fastest_runner,
    keep_curve,
    measure_cost_curve,
    model_key,
)
from verispec.runners.notices import int8_warning, portable_gguf_warning, runner_label, say_once


@dataclass(frozen=True)
class ModelFile:
    """One model as the choice sees it: its name and, for a file, its path."""

    name: str
    path: Path | None = None


@dataclass(frozen=True)
class ModelFiles:
    """The pair a runner is chosen for (the draft None without one)."""

    target: ModelFile
    draft: ModelFile | None = None

    @classmethod
    def resolve(cls, target: str, draft: str | None = None, store=None) -> ModelFiles:
        """The files behind model references (built-in names fetched on first use, as loading
        does). Raises the model store's errors."""
        from verispec.models.store import ModelStore

        store = store or ModelStore()
        files = [store.resolve(ref) for ref in (target, draft) if ref]
        found = [ModelFile(source.name, source.path) for source in files]
        return cls(found[0], found[1] if draft else None)

    @classmethod
    def of(cls, target, draft=None) -> ModelFiles:
        """The files of loaded models (``LoadedModel``)."""
        return cls(ModelFile(target.name, target.path), None if draft is None else ModelFile(draft.name, draft.path))

    @property
    def both(self) -> tuple[ModelFile, ...]:
        return (self.target,) if self.draft is None else (self.target, self.draft)


@dataclass(frozen=True)
class Host:
    """Where the models run: the torch device, and the cost curves measured on this machine
    (default: :class:`CostCache` under the verispec home). The kernels' facts (gguf path, int8
    product, llama.cpp installed) are read when a choice needs them: the gguf kernels compile on
    first use."""

    device: str = "cpu"
    costs: CostCache | None = None

    @property
    def cpu(self) -> bool:
        return str(self.device).startswith("cpu")

    def cost_cache(self) -> CostCache:
        return self.costs or CostCache()


@dataclass(frozen=True)
class Choice:
    """The runner decision, with what follows from it.

    Attributes:
        kind: the runner (``gguf``, ``int8``, ``llamacpp``, ``torch``); ``auto`` while
            ``untimed`` candidates still have to be timed (:func:`time_candidates`).
        isa: the gguf kernels' instruction-set path (``avx512``, ``avx2``, ``neon``,
            ``portable``); None for the other runners.
        reasons: why, one human-readable sentence each, in the order they were weighed.
        notices: ``(key, text)`` the user is told on stderr, each key once per process.
        facts: the kernels the runner runs here (:func:`kernel_facts`).
        candidates: the runners ``auto`` weighed by cost curves (none where it chose by the files).
        untimed: those of them whose cost curves are not cached yet.
    """

    kind: str
    isa: str | None = None
    reasons: tuple[str, ...] = ()
    notices: tuple[tuple[str, str], ...] = ()
    facts: Mapping[str, str] = field(default_factory=dict)
    candidates: tuple[str, ...] = ()
    untimed: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        """How the load line names the runner: ``gguf runner, avx512 kernels``, ..."""
        return runner_label(self.kind, self.facts)

    @property
    def cost_key(self) -> str:
        """The runner's name in the cost cache (:func:`kernel_key`)."""
        return kernel_key(self.kind, self.facts)

    def say(self) -> None:
        """Print the notices on stderr, each the first time its key is said in this process."""
        for key, text in self.notices:
            say_once(key, text)


def choose_runner(asked: str, files: ModelFiles | None, host: Host | None = None) -> Choice:
    """The runner for ``files`` on ``host``: ``asked`` itself unless it is ``auto``.

    ``auto`` reads each file's GGUF header (:func:`gguf_runner_supports`) and, where the gguf
    runner cannot take them, the cached cost curves of the candidates (``files`` is needed then).
    Says nothing itself: :meth:`Choice.say`.

    Raises:
        InvalidParameterError: ``--runner gguf`` where its kernels cannot build.
    """
    host = host or Host()
    if asked != "auto":
        return _decided(asked, [f"--runner {asked} was asked for"], [])
    if files is None:
        raise ValueError("--runner auto needs the model files")
    reasons: list[str] = []
    notices: list[tuple[str, str]] = []
    kind = _file_runner(files, host, reasons, notices)
    if kind is not None:
        return _decided(kind, reasons, notices)
    candidates = _candidates(files.target.path, host, reasons, notices)
    targets, drafts, untimed = _cached_curves(files, candidates, host)
    if untimed:
        reasons.append(f"cost curves not cached yet for {', '.join(untimed)}: timed once the models are loaded")
        return Choice("auto", None, tuple(reasons), tuple(notices), {}, tuple(candidates), tuple(untimed))
    return _decided(_fastest(targets, drafts, files, reasons, "cached"), reasons, notices, candidates)


def time_candidates(choice: Choice, files: ModelFiles, host: Host, build: Callable[[str, str], Runner]) -> Choice:
    """``choice`` with its untimed candidates timed: the fastest by cost curves, measured where
    not cached (then cached) on runners ``build(kind, role)`` makes (``role``: ``"target"`` or
    ``"draft"``; a runner that cannot load the model is left out). A decided choice comes back
    as it is; no candidate left: ``torch``."""
    if choice.kind != "auto":
        return choice
    cache = host.cost_cache()
    targets: dict[str, CostCurve] = {}
    drafts: dict[str, CostCurve] = {}
    for kind in choice.candidates:
        curve = _curve(cache, files.target, kind, lambda k: build(k, "target"))
        if curve is None:
            continue
        targets[kind] = curve
        if files.draft is not None:
            draft_curve = _curve(cache, files.draft, kind, lambda k: build(k, "draft"))
            if draft_curve is not None:
                drafts[kind] = draft_curve
    reasons = list(choice.reasons)
    kind = _fastest(targets, drafts, files, reasons, "measured")
    return _decided(kind, reasons, list(choice.notices), choice.candidates)


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
            return f"its {name} is {info.type_name}, a block type the gguf kernels do not multiply"
    return None


def cached_curve(name: str, path: Path | None, kind: str, cache: CostCache | None = None) -> CostCurve | None:
    """The cached cost curve of ``kind`` for a model, if one was measured on this machine."""
    return (cache or CostCache()).get(model_key(name, path), kernel_key(kind))


def measure(runner: Runner, kind: str, model: ModelFile, why: str, key: str | None = None) -> CostCurve:
    """The quick cost curve (:data:`QUICK_CURVE`) of ``runner`` for ``model``, named by its
    kernel path (``key``: that name, default :func:`kernel_key`); said on stderr if slow."""
    key = key or kernel_key(kind)
    timing = announce_slow(
        f"timing the {kind} runner on {model.name}", f"{why}; once per CPU, model file and kernel path"
    )
    with timing, torch.inference_mode():
        return measure_cost_curve(runner, runner_name=key, model=model_key(model.name, model.path), **QUICK_CURVE)


def kernel_facts(kind: str) -> dict[str, str]:
    """The kernels the ``kind`` runner runs here: gguf ``{"kernel_isa", "cpu_features"}`` (the
    instruction-set path, :func:`verispec.runners.kernels.kernel_isa`, and the CPU features the
    kernels detected), int8 ``{"int8_kernel"}`` (``onednn`` or ``int_mm``); ``{}`` for llamacpp
    and torch, which choose their own kernels.

    Raises InvalidParameterError (gguf) as :func:`~verispec.runners.kernels.kernel_isa` does.
    """
    if kind == "gguf":
        from verispec.runners.kernels import gguf_kernels, kernel_isa

        return {"kernel_isa": kernel_isa(), "cpu_features": gguf_kernels().cpu_features()}
    if kind == "int8":
        from verispec.runners.cpu.int8_ops import default_kernel

        return {"int8_kernel": default_kernel()}
    return {}


def kernel_key(kind: str, facts: Mapping[str, str] | None = None) -> str:
    """The runner's name in the cost cache: ``gguf:<isa>@<build>``, ``int8:<kernel>``, else
    ``kind`` (each kernel path has its own costs; ``<build>`` is the kernels' source hash,
    :func:`verispec.runners.kernels.build_key`, so a faster or slower kernel after an upgrade is
    timed again instead of steering ``auto`` and the draft-length controller by old costs).
    ``facts``: :func:`kernel_facts` of ``kind``, read here when not given."""
    facts = kernel_facts(kind) if facts is None else facts
    if "kernel_isa" in facts:
        from verispec.runners.kernels import build_key

        return f"{kind}:{facts['kernel_isa']}@{build_key()}"
    detail = facts.get("int8_kernel")
    return f"{kind}:{detail}" if detail else kind


def _decided(kind: str, reasons: list[str], notices: list[tuple[str, str]], candidates=()) -> Choice:
    """The choice of ``kind``, with its kernels' facts and the warning where they are slow here."""
    facts = kernel_facts(kind)
    slow = _slow_kernels(kind, facts)
    if slow is not None and all(key != slow[0] for key, _ in notices):
        notices = [*notices, slow]
    return Choice(kind, facts.get("kernel_isa"), tuple(reasons), tuple(notices), facts, tuple(candidates))


def _slow_kernels(kind: str, facts: Mapping[str, str]) -> tuple[str, str] | None:
    """The warning when ``kind`` runs a slow kernel here (gguf's portable path, int8 without
    oneDNN's exact product), naming the faster option."""
    from verispec.runners.llamacpp import llama_cpp_available

    if kind == "gguf" and facts.get("kernel_isa") == "portable":
        return "portable", portable_gguf_warning(llama_cpp_installed=llama_cpp_available())
    if kind == "int8":
        warning = int8_warning(auto=False)
        return None if warning is None else ("int8", warning)
    return None


def _file_runner(files: ModelFiles, host: Host, reasons: list[str], notices: list[tuple[str, str]]) -> str | None:
    """``gguf`` where it runs every file and its kernels build here, ``llamacpp`` instead when
    those kernels would run on their portable path and llama.cpp is installed; None: weigh the
    others by cost curves."""
    from verispec.runners.kernels import gguf_kernels, kernel_isa
    from verispec.runners.llamacpp import llama_cpp_available

    if not host.cpu:
        reasons.append(f"the gguf runner runs on the CPU, not {host.device}")
        return None
    for model in files.both:
        why = gguf_runner_supports(model.path)
        if why is not None:
            reasons.append(f"the gguf runner cannot run {model.name}: {why}")
            if model.path is not None and Path(model.path).suffix == ".gguf":  # a GGUF file: say why, once
                pair = "the pair" if files.draft is not None else "it"
                notices.append(
                    (
                        f"gguf-cannot-run:{model.path}",
                        f"the gguf runner cannot run {model.name} ({why}); --runner auto runs {pair} on another runner",
                    )
                )
            return None
    try:
        gguf_kernels()
    except InvalidParameterError as exc:
        reasons.append(f"the gguf kernels do not build here: {exc}")
        notices.append(("gguf-build", f"warning: {exc}; --runner auto uses the other runners"))
        return None
    if kernel_isa() != "portable":
        reasons.append("the gguf runner runs every file: exact under speculation, and the fastest measured")
        return "gguf"
    installed = llama_cpp_available()
    text = portable_gguf_warning(llama_cpp_installed=installed, auto_uses_llama_cpp=installed)
    notices.append(("portable", text))
    reasons.append(f"the gguf kernels would run on their portable path here; llama.cpp installed: {installed}")
    return "llamacpp" if installed else "gguf"


def _candidates(path: Path | None, host: Host, reasons: list[str], notices: list[tuple[str, str]]) -> list[str]:
    """Runners ``auto`` weighs for a model file: int8 on CPU where its fast kernel (oneDNN,
    AVX-512 VNNI) is exact, llama.cpp for GGUF when installed; torch on other devices.

    The transformers runner is the fallback (other devices, other architectures, no candidate);
    on this kind of CPU it is several times slower than int8 (``../shared/MODELS.md``).
    """
    from verispec.runners.llamacpp import llama_cpp_available

    if not host.cpu:
        return ["torch"]
    candidates = ["int8"]
    warning = int8_warning(auto=True)
    if warning is not None:
        notices.append(("int8-auto", warning))
        reasons.append("the int8 runner is left out: its fast kernel is not exact on this CPU")
        candidates = []
    if path is not None and Path(path).suffix == ".gguf" and llama_cpp_available():
        candidates.append("llamacpp")
    return candidates


def _cached_curves(
    files: ModelFiles, candidates: list[str], host: Host
) -> tuple[dict[str, CostCurve], dict[str, CostCurve], list[str]]:
    """The cached target and draft curves of each candidate, and the candidates missing one."""
    cache = host.cost_cache()
    targets, drafts, untimed = {}, {}, []
    for kind in candidates:
        curves = [cached_curve(model.name, model.path, kind, cache) for model in files.both]
        if any(curve is None for curve in curves):
            untimed.append(kind)
            continue
        targets[kind] = curves[0]
        if files.draft is not None:
            drafts[kind] = curves[1]
    return targets, drafts, untimed


def _fastest(
    targets: dict[str, CostCurve], drafts: dict[str, CostCurve], files: ModelFiles, reasons: list[str], how: str
) -> str:
    if not targets:
        reasons.append("no other runner can run it here: the torch runner")
        return "torch"
    kind = fastest_runner(targets, drafts if files.draft is not None else None)
    reasons.append(f"the fastest of {', '.join(sorted(targets))} by {how} cost curves")
    return kind


def _curve(cache: CostCache, model: ModelFile, kind: str, build: Callable[[str], Runner]) -> CostCurve | None:
    curve = cache.get(model_key(model.name, model.path), kernel_key(kind))
    if curve is None:
        try:
            with announce_slow(
                f"loading {model.name} on the {kind} runner", "--runner auto times each candidate runner once"
            ):
                runner = build(kind)
        except InvalidParameterError:
            return None
        curve = measure(runner, kind, model, "--runner auto picks the fastest runner by it")
        keep_curve(cache, model_key(model.name, model.path), curve)
    return curve
