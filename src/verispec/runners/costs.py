"""Measured cost curves of runners: ms per forward of k new tokens, cached per machine and model.

Owns the measurement (a fixed pseudo-random context, then forwards of k = 1, 2, 4, 8, 16 tokens,
median of several), the on-disk cache (``$VERISPEC_HOME/costs/<machine>.json``) and the choice
of the fastest runner from those curves (``--runner auto``). Seeds the draft-length
controller's cost model with a curve. Knows nothing about how a runner computes.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import torch

from verispec.control import CostModel, expected_tokens, interpolate
from verispec.runners import Runner

COST_KS = (1, 2, 4, 8, 16)
CONTEXT_TOKENS = 64


@dataclass
class CostCurve:
    """Median ms of one forward of k new tokens after ``context_tokens`` cached ones.

    ``ms`` maps k (tokens per forward) to milliseconds; ``samples`` keeps every timing.
    """

    runner: str
    model: str
    ms: dict[int, float]
    context_tokens: int = CONTEXT_TOKENS
    threads: int = 0
    measured_at: float = 0.0
    samples: dict[int, list[float]] = field(default_factory=dict)

    def at(self, k: int) -> float:
        """ms of a forward of ``k`` tokens, interpolated between measured points."""
        return interpolate(self.ms, k)

    def ratio(self, k: int) -> float:
        """cost(k) / cost(1): how much more a k-token verify pass costs than a decode step."""
        return self.at(k) / self.at(1)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping) -> CostCurve:
        data = dict(data)
        data["ms"] = {int(k): float(v) for k, v in data["ms"].items()}
        data["samples"] = {int(k): list(v) for k, v in data.get("samples", {}).items()}
        return cls(**data)


def measure_cost_curve(
    runner: Runner,
    *,
    runner_name: str,
    model: str,
    ks: Sequence[int] = COST_KS,
    context_tokens: int = CONTEXT_TOKENS,
    repeats: int = 7,
    warmup: int = 2,
) -> CostCurve:
    """Time ``runner.forward`` of k tokens after a ``context_tokens`` context (median of ``repeats``).

    The context and the new tokens are fixed pseudo-random ids below the vocabulary size; the
    k values are timed in turn within each repeat. The runner's cache is left empty. Raises
    ValueError if the context does not fit the runner.
    """
    generator = torch.Generator().manual_seed(0)
    vocab = min(runner.vocab_size, 32000)
    context = torch.randint(10, vocab, (context_tokens,), generator=generator).tolist()
    if context_tokens + max(ks) > runner.max_context_length:
        raise ValueError(f"a {context_tokens}-token context and {max(ks)} new tokens do not fit the runner")
    runner.truncate(0)
    runner.forward(context, num_logits=1)
    new_tokens = {k: torch.randint(10, vocab, (k,), generator=generator).tolist() for k in ks}
    samples: dict[int, list[float]] = {k: [] for k in ks}
    for i in range(warmup + repeats):
        for k in ks:  # k round-robin: a load change on a shared machine hits every k alike
            runner.truncate(context_tokens)
            start = time.perf_counter()
            runner.forward(new_tokens[k])
            if i >= warmup:
                samples[k].append(round((time.perf_counter() - start) * 1000, 3))
    ms = {k: statistics.median(v) for k, v in samples.items()}
    runner.truncate(0)
    return CostCurve(runner_name, model, ms, context_tokens, torch.get_num_threads(), time.time(), samples)


def machine_key() -> str:
    """Short id of this machine kind: CPU model, usable CPUs, torch threads, torch version."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), cpu)
    except OSError:
        pass
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    text = f"{cpu}|{cpus}|{torch.get_num_threads()}|{torch.__version__}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def model_key(name: str, path: Path | None) -> str:
    """A model's cache key: its name plus the weight file's size (a changed file re-measures)."""
    if path is not None and Path(path).is_file():
        return f"{name}:{Path(path).stat().st_size}"
    return name


class CostCache:
    """Cost curves on disk: ``{model_key: {runner: curve}}`` in ``<directory>/<machine>.json``."""

    def __init__(self, directory: Path | None = None, machine: str | None = None) -> None:
        if directory is None:
            from verispec.models.store import verispec_home

            directory = verispec_home() / "costs"
        self.path = Path(directory) / f"{machine or machine_key()}.json"

    def _read(self) -> dict:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}

    def get(self, model: str, runner: str) -> CostCurve | None:
        data = self._read().get(model, {}).get(runner)
        try:
            return CostCurve.from_dict(data) if data else None
        except (TypeError, KeyError, ValueError):
            return None  # an unreadable entry is re-measured

    def put(self, model: str, curve: CostCurve) -> None:
        data = self._read()
        data.setdefault(model, {})[curve.runner] = curve.to_dict()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.path.with_suffix(".tmp")
        temporary.write_text(json.dumps(data, indent=1))
        temporary.replace(self.path)


def tokens_per_second(target: CostCurve, draft_ms: float | None, acceptance_rate: float, max_k: int = 8) -> float:
    """Expected decode tokens/s of the best constant draft length on this target curve.

    ``draft_ms``: ms per drafted token (None: no drafter, plain decoding). A step drafts k
    tokens and verifies k + 1; it yields ``expected_tokens(acceptance_rate, k)`` tokens
    (Leviathan et al. 2023, §3.3).
    """
    best = 1000.0 / target.at(1)
    if draft_ms is None:
        return best
    for k in range(1, max_k + 1):
        best = max(best, 1000.0 * expected_tokens(acceptance_rate, k) / (target.at(k + 1) + k * draft_ms))
    return best


def choose_runner(
    targets: Mapping[str, CostCurve], drafts: Mapping[str, CostCurve] | None = None, acceptance_rate: float = 0.6
) -> str:
    """The runner name with the highest expected tokens/s (plain when ``drafts`` is None).

    ``drafts[name]``: the draft model's curve on runner ``name`` (its cost(1) is one drafted
    token). Raises ValueError for an empty ``targets``.
    """
    if not targets:
        raise ValueError("no runner to choose from")

    def speed(name: str) -> float:
        draft = None if drafts is None else drafts.get(name)
        return tokens_per_second(targets[name], None if draft is None else draft.at(1), acceptance_rate)

    return max(sorted(targets), key=speed)


def seed_cost_model(cost_model: CostModel, curve: CostCurve) -> None:
    """Give the draft-length controller the measured verify costs before its first step.

    A forward of k tokens verifies k - 1 drafted ones: ``verify_s[k - 1] = ms[k] / 1000``.
    Online timings then refine these (EWMA).
    """
    for k, ms in curve.ms.items():
        cost_model.verify_s.setdefault(k - 1, ms / 1000.0)
