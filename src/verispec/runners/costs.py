"""Measured cost curves of runners: ms per forward of k new tokens, cached per machine and model.

Owns the measurement (a fixed pseudo-random context, then forwards of k = 1, 2, 4, 8, 16 tokens,
median of several; :data:`QUICK_CURVE` for a first run: seconds, not minutes), the on-disk cache
(``$VERISPEC_HOME/costs/<machine>.json``, one file per CPU model and features, threads and torch
version; inside it per model file and per runner and kernel path; a checked file, see
:class:`CostCache`) and the choice of the fastest
runner from those curves (``--runner auto``). Seeds the draft-length controller's cost model with
a curve. Knows nothing about how a runner computes.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from verispec.algorithms.control import CostModel, expected_tokens, interpolate
from verispec.errors import CacheFileError
from verispec.models.cache_files import read_checked, report_damaged, write_checked
from verispec.runners import Runner

COST_KS = (1, 2, 4, 8, 16)
CONTEXT_TOKENS = 64
SLOW_PASS_S = 0.25  # a one-token pass this slow needs no warm-up round: first-touch effects are noise beside it
# what auto and the controller's seed measure on first use (bench measures in full): a short
# context, a few rounds, and a time budget that ends the measurement early on a slow path
QUICK_CURVE = {"context_tokens": 16, "repeats": 3, "warmup": 1, "budget_s": 2.0}
LEAST_FALL = 0.6  # a longer pass is never timed below this share of a shorter one (CostCurve.disturbed)
MOST_GROWTH = 1.5  # nor above this many times proportional growth


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

    def disturbed(self) -> str | None:
        """Why these timings cannot be one machine's steady costs, or None when they can.

        A pass over more tokens reads the same weights and does more arithmetic, so between
        two timed lengths ``k1 < k2`` the cost neither falls below :data:`LEAST_FALL` of
        ``cost(k1)`` (a 2-core Xeon's AVX-512 one-row pass has measured 0.76x its two-row one)
        nor grows past :data:`MOST_GROWTH` times proportionally, ``cost(k2) <= MOST_GROWTH *
        (k2 / k1) * cost(k1)`` (llama.cpp's, compute-bound from two rows, grows ~1.8x from
        k = 1 to 2). Curves timed while another process held the cores break one of the two:
        e.g. 40.6 ms at k = 1 and 652 ms at k = 2, or 293 ms then 68 ms."""
        ks = sorted(self.ms)
        for k1, k2 in itertools.pairwise(ks):
            a, b = self.ms[k1], self.ms[k2]
            if b < LEAST_FALL * a:
                return f"{b:g} ms for {k2} tokens after {a:g} ms for {k1}"
            if b > MOST_GROWTH * (k2 / k1) * a:
                return f"{b:g} ms for {k2} tokens after {a:g} ms for {k1}"
        return None

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
    budget_s: float | None = None,
) -> CostCurve:
    """Time ``runner.forward`` of k tokens after a ``context_tokens`` context (median of ``repeats``).

    The context and the new tokens are fixed pseudo-random ids below the vocabulary size; the
    k values are timed in turn within each repeat. With ``budget_s`` (seconds) it stops early, so
    a slow kernel path costs seconds, not minutes: a first one-token pass over
    :data:`SLOW_PASS_S` means no warm-up and one round; once ``budget_s`` have passed since the
    context was cached it stops as soon as two k values are timed (``ks`` ascending: the larger
    ones are then left out and :meth:`CostCurve.at` extrapolates them). The runner's cache is left
    empty. Raises ValueError if the context does not fit the runner.
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
    start = time.perf_counter()
    if budget_s is not None and _timed_pass(runner, context_tokens, new_tokens[ks[0]]) > SLOW_PASS_S * 1000:
        warmup, repeats = 0, 1
    enough = min(2, len(ks))
    for i, k in [
        (i, k) for i in range(warmup + repeats) for k in ks
    ]:  # k round-robin: a load change hits every k alike
        ms = _timed_pass(runner, context_tokens, new_tokens[k])
        if i >= warmup:
            samples[k].append(ms)
        if (
            budget_s is not None
            and time.perf_counter() - start > budget_s
            and sum(map(bool, samples.values())) >= enough
        ):
            break
    samples = {k: v for k, v in samples.items() if v}
    ms = {k: statistics.median(v) for k, v in samples.items()}
    runner.truncate(0)
    return CostCurve(runner_name, model, ms, context_tokens, torch.get_num_threads(), time.time(), samples)


def _timed_pass(runner: Runner, context_tokens: int, token_ids: list[int]) -> float:
    """ms of one forward of ``token_ids`` after the first ``context_tokens`` cached ones."""
    runner.truncate(context_tokens)
    start = time.perf_counter()
    runner.forward(token_ids)
    return round((time.perf_counter() - start) * 1000, 3)


def machine_key() -> str:
    """Short id of this machine kind: CPU model and features, usable CPUs, torch threads, torch version."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    text = f"{cpu_description()}|{cpus}|{torch.get_num_threads()}|{torch.__version__}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cpu_description() -> str:
    """The CPU's model name and feature flags (Linux ``/proc/cpuinfo``: ``flags`` on x86,
    ``Features`` on ARM), else the platform's processor name."""
    found: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                name, _, value = line.partition(":")
                found.setdefault(name.strip(), value.strip())  # the first CPU's
    except OSError:
        pass
    cpu = found.get("model name") or platform.processor() or platform.machine()
    return f"{cpu}|{found.get('flags') or found.get('Features', '')}"


def model_key(name: str, path: Path | None) -> str:
    """A model's cache key: its name plus the weight file's size (a changed file re-measures)."""
    if path is not None and Path(path).is_file():
        return f"{name}:{Path(path).stat().st_size}"
    return name


class CostCache:
    """Cost curves on disk: ``{model_key: {runner: curve}}`` in ``<directory>/<machine>.json``.

    The file is a checked file (:mod:`verispec.models.cache_files`): a header line with the JSON
    payload's size and sha256, then the payload, written atomically (temporary file, fsync,
    rename). A file that fails the check (truncated, corrupt, an older verispec's without a
    header) or an entry that is not a curve is said once on stderr and read as empty, so its
    curves are measured again and the next :meth:`put` replaces the file; it never raises for a
    damaged file.
    """

    KIND = "verispec-costs/1"

    def __init__(self, directory: Path | None = None, machine: str | None = None) -> None:
        if directory is None:
            from verispec.models.store import verispec_home

            directory = verispec_home() / "costs"
        self.path = Path(directory) / f"{machine or machine_key()}.json"

    def _read(self) -> dict:
        try:
            data = json.loads(read_checked(self.path, self.KIND))
            if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
                raise CacheFileError("does not hold {model: {runner: curve}}")
            return data
        except FileNotFoundError:
            return {}
        except (CacheFileError, ValueError, OSError) as exc:
            report_damaged(self.path, str(exc), "its cost curves are measured again")
            return {}

    def get(self, model: str, runner: str) -> CostCurve | None:
        """The curve of ``model`` on ``runner``; None when there is none, or when it is unreadable
        or :meth:`CostCurve.disturbed` (said once on stderr: it is then measured again)."""
        data = self._read().get(model, {}).get(runner)
        try:
            curve = CostCurve.from_dict(data) if data else None
        except (TypeError, KeyError, ValueError, AttributeError):
            report_damaged(self.path, f"has an unreadable curve of {model} on {runner}", "it is measured again")
            return None
        reason = None if curve is None else curve.disturbed()
        if reason is not None:
            report_damaged(
                self.path,
                f"has a curve of {model} on {runner} timed while the machine was busy ({reason})",
                "it is measured again",
            )
            return None
        return curve

    def put(self, model: str, curve: CostCurve) -> None:
        """Add (or replace) ``model``'s curve on ``curve.runner`` and rewrite the file atomically.
        Raises OSError when the file cannot be written."""
        data = self._read()
        data.setdefault(model, {})[curve.runner] = curve.to_dict()
        write_checked(self.path, self.KIND, json.dumps(data, indent=1).encode())


def keep_curve(cache: CostCache, model: str, curve: CostCurve) -> None:
    """Put ``curve`` in ``cache`` unless it is :meth:`CostCurve.disturbed`: then say so on stderr
    (this run still uses it; the next one times it again). Raises OSError as :meth:`CostCache.put`."""
    reason = curve.disturbed()
    if reason is None:
        cache.put(model, curve)
        return
    print(
        f"verispec: the timings of {model} on {curve.runner} were disturbed ({reason}; was another process "
        "busy?): not kept, timed again next run",
        file=sys.stderr,
        flush=True,
    )


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


def fastest_runner(
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

    A forward of k tokens verifies k - 1 drafted ones. The one-token pass seeds the plain step
    (``verify_s[0] = ms[1] / 1000``, counted as one pass); the others seed the curve's shape,
    ``seed_ratios[k - 1] = ms[k] / ms[1]``, which the controller multiplies by the plain step it
    measures (:meth:`~verispec.algorithms.control.CostModel.verify_points`): the level comes
    from this run, so a curve measured while the machine was busier does not price drafting
    out. Online timings of each length then replace the seed (EWMA).
    """
    if 1 not in curve.ms or curve.ms[1] <= 0:
        return
    cost_model.verify_s.setdefault(0, curve.ms[1] / 1000.0)
    for k, ms in curve.ms.items():
        if k > 1:
            cost_model.seed_ratios.setdefault(k - 1, ms / curve.ms[1])
