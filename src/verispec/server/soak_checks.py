"""The fault soak's pure parts (``scripts/fault_soak.py``; lives in the package so the suite imports
it plainly): the seeded fault schedule, what became of each request, and the checks over them
(lost, 5xx outside kills, requests cut by a kill, the greedy texts, RSS growth). Knows nothing
about HTTP or processes: the soak fills in :class:`Outcome` records, these functions count them."""

from __future__ import annotations

import random
import statistics
from collections import Counter
from dataclasses import dataclass

REQUEST_FAULTS = ("disconnect", "malformed_json", "oversized_body", "over_context", "invalid_params", "n16", "greedy")
KILL_KINDS = ("kill", "replica_kill")
INVALID_PARAMS = (  # each one a refusal (400/404/422), never a 5xx
    {"temperature": -1.0},
    {"top_p": 2.0},
    {"n": 17},
    {"max_tokens": -5},
    {"logprobs": 50},
    {"model": "no-such-model"},
    {"prompt": 12.5},
    {"stop": {"not": "a list"}},
)
REFUSAL_STATUSES = frozenset({400, 404, 413, 422, 429})
KILL_ANSWER_S = 5.0  # a request in flight during a kill ends (error JSON / event / cut) within this
ENDED = ("answered", "http_error", "stream_error", "connection_error", "closed")


@dataclass(frozen=True)
class Fault:
    """One injected fault: ``at_s`` seconds after the soak started; ``variant`` picks among a
    kind's forms (the invalid parameter, the greedy prompt)."""

    at_s: float
    kind: str
    variant: int = 0


def fault_schedule(
    seed: int, seconds: float, every_s: float, kills: int, kill_kind: str = "kill", num_greedy: int = 3
) -> list[Fault]:
    """The faults of a soak, sorted by time, the same for the same arguments.

    Request faults arrive as a Poisson process (mean gap ``every_s`` seconds), each kind equally
    likely, over the whole run but its last 5 %; ``kills`` kills (``kill_kind``) fall uniformly in
    the middle of the run (40..80 % of ``seconds``), so the server has served (and snapshotted) for
    a while before and serves again after. Every greedy prompt (``num_greedy``) is probed at least
    once. Raises ValueError for a non-positive ``seconds`` or ``every_s``, or an unknown kill kind.
    """
    if seconds <= 0 or every_s <= 0:
        raise ValueError(f"seconds and every_s must be > 0, got {seconds} and {every_s}")
    if kill_kind not in KILL_KINDS:
        raise ValueError(f"kill_kind must be one of {KILL_KINDS}, got {kill_kind!r}")
    rng = random.Random(seed)
    faults, t, end = [], 0.0, 0.95 * seconds
    while True:
        t += rng.expovariate(1.0 / every_s)
        if t >= end:
            break
        kind = rng.choice(REQUEST_FAULTS)
        variant = rng.randrange(len(INVALID_PARAMS)) if kind == "invalid_params" else rng.randrange(max(1, num_greedy))
        faults.append(Fault(round(t, 3), kind, variant if kind in ("invalid_params", "greedy") else 0))
    probed = {f.variant for f in faults if f.kind == "greedy"}
    for variant in range(num_greedy):
        if variant not in probed:
            faults.append(Fault(round(rng.uniform(0.1, 0.9) * seconds, 3), "greedy", variant))
    faults += [Fault(round(rng.uniform(0.4, 0.8) * seconds, 3), kill_kind) for _ in range(kills)]
    return sorted(faults, key=lambda f: (f.at_s, f.kind, f.variant))


@dataclass
class Outcome:
    """What became of one request. ``result``: answered (2xx, complete), http_error (``status``
    >= 400, ``error_json`` when the body is OpenAI's ``{"error": {"message", "type"}}``),
    stream_error (an error event inside a 200 stream), connection_error (refused or cut), closed
    (the client hung up on purpose), lost (no answer within the timeout); empty while in flight.
    Times are seconds since the soak started."""

    kind: str
    sent_s: float
    end_s: float | None = None
    result: str = ""
    status: int | None = None
    error_json: bool = False
    text: str | None = None
    variant: int = 0
    detail: str = ""


@dataclass(frozen=True)
class Outage:
    """A kill at ``kill_s`` and the server (or replica) serving again at ``ready_s``."""

    kill_s: float
    ready_s: float


def overlaps(outcome: Outcome, outages: list[Outage]) -> bool:
    """Whether the request was in flight or sent while the server was down (it may fail there)."""
    end = outcome.end_s if outcome.end_s is not None else float("inf")
    return any(outcome.sent_s <= o.ready_s and end >= o.kill_s for o in outages)


def is_openai_error(body) -> bool:
    """OpenAI's error shape: ``{"error": {"message": str, "type": str, ...}}``."""
    error = body.get("error") if isinstance(body, dict) else None
    return isinstance(error, dict) and isinstance(error.get("message"), str) and isinstance(error.get("type"), str)


def tally(outcomes: list[Outcome], outages: list[Outage]) -> dict:
    """The soak's counts: sent, answered, HTTP errors by status, stream error events, connection
    errors, closed on purpose, lost (must be 0), and the server's faults outside the injected kills
    (5xx and stream error events of requests that no outage touched: must be 0). Refusals of bad
    input (400/404/413/422) and of a full queue (429) are not faults."""
    lost = [o for o in outcomes if o.result == "lost" or o.end_s is None]
    by_status = Counter(o.status for o in outcomes if o.result == "http_error")
    faults_outside = [
        o
        for o in outcomes
        if ((o.result == "http_error" and (o.status or 0) >= 500) or o.result == "stream_error")
        and not overlaps(o, outages)
    ]
    return {
        "sent": len(outcomes),
        "answered": sum(o.result == "answered" for o in outcomes),
        "http_errors_by_status": {str(k): v for k, v in sorted(by_status.items())},
        "http_errors_without_openai_json": sum(o.result == "http_error" and not o.error_json for o in outcomes),
        "stream_error_events": sum(o.result == "stream_error" for o in outcomes),
        "connection_errors": sum(o.result == "connection_error" for o in outcomes),
        "closed_by_client": sum(o.result == "closed" for o in outcomes),
        "lost": len(lost),
        "server_faults_outside_kills": len(faults_outside),
        "server_fault_samples": [f"{o.kind} {o.status} {o.detail[:160]}" for o in faults_outside[:5]],
    }


def by_kind(outcomes: list[Outcome]) -> dict[str, dict[str, int]]:
    """Per request kind: how many, and how many of each result (``http_error`` split by status)."""
    table: dict[str, Counter] = {}
    for o in outcomes:
        row = table.setdefault(o.kind, Counter())
        row["sent"] += 1
        row[f"http_{o.status}" if o.result == "http_error" else (o.result or "lost")] += 1
    return {kind: dict(sorted(row.items())) for kind, row in sorted(table.items())}


def unexpected_answers(outcomes: list[Outcome]) -> list[str]:
    """Bad input that was not refused (a 2xx for malformed JSON, an oversized body, a prompt over
    the context or an invalid parameter), or an ``n`` = 16 answer without 16 choices."""
    found = []
    for o in outcomes:
        if o.kind in ("malformed_json", "oversized_body", "over_context", "invalid_params") and o.result == "answered":
            found.append(f"{o.kind} (variant {o.variant}) answered {o.status}")
        if o.kind == "n16" and o.result == "answered" and o.detail != "16 choices":
            found.append(f"n16 answered with {o.detail}")
    return found


def kill_check(
    in_flight: list[Outcome], kill_s: float, within_s: float = KILL_ANSWER_S, others_may_answer: bool = False
) -> dict:
    """Whether every request in flight at a kill (``kill_s``) ended within ``within_s`` seconds:
    with an OpenAI error JSON, an error event, a cut connection, or (already written) its answer.
    ``others_may_answer`` (a replica killed, the others serving): a request answered in full later
    was on a replica that lived, and counts as ``answered_by_others`` (judge it once they ended)."""
    late, by_others = [], 0
    for o in in_flight:
        ok_end = o.result in ENDED and (o.result != "http_error" or o.error_json)
        if o.end_s is not None and ok_end and o.end_s - kill_s <= within_s:
            continue
        if others_may_answer and o.result == "answered":
            by_others += 1
            continue
        late.append(f"{o.kind} sent at {o.sent_s:.1f} s: {o.result or 'unanswered'} at {o.end_s}")
    check = {
        "kill_s": round(kill_s, 2),
        "in_flight": len(in_flight),
        "ended_in_time": len(in_flight) - len(late) - by_others,
        "late": late,
        "ok": not late,
    }
    if others_may_answer:
        check["answered_by_others"] = by_others
    return check


def greedy_mismatches(reference: dict[int, str], probes: list[Outcome]) -> list[str]:
    """Greedy probes answered during the soak whose text differs from the same request sent alone
    to the idle server (``reference``: variant -> text). Probes that failed (a kill) are not texts."""
    return [
        f"greedy prompt {o.variant} at {o.sent_s:.1f} s: {o.text!r} != {reference.get(o.variant)!r}"
        for o in probes
        if o.result == "answered" and o.text != reference.get(o.variant)
    ]


def rss_growth_mib(samples: list[tuple[float, int]], warmup_s: float = 60.0) -> float | None:
    """RSS growth (MiB) of one process from its first sample at or after ``warmup_s`` seconds to
    its last (``samples``: (seconds since it started, bytes)); None with fewer than 2 such samples."""
    after = [rss for t, rss in samples if t >= warmup_s]
    return round((after[-1] - after[0]) / 2**20, 1) if len(after) >= 2 else None


def rss_trend_mib(samples: list[tuple[float, int]], warmup_s: float = 60.0, window_s: float = 60.0) -> float | None:
    """RSS growth (MiB) of one process as a trend: the median of its samples in the last
    ``window_s`` seconds minus the median of those in the ``window_s`` after ``warmup_s``
    (``samples``: (seconds since it started, bytes)). Unlike :func:`rss_growth_mib` one sample
    does not decide it: the KV pages of the requests running at that instant (tens of MiB
    under 8 clients) come and go with them. None when the windows would overlap (a process that
    lived less than ``warmup_s + 2 * window_s``) or either holds fewer than 3 samples."""
    after = [(t, rss) for t, rss in samples if t >= warmup_s]
    if not after or after[-1][0] - window_s < warmup_s + window_s:
        return None
    first = [rss for t, rss in after if t < warmup_s + window_s]
    last = [rss for t, rss in after if t > after[-1][0] - window_s]
    if len(first) < 3 or len(last) < 3:
        return None
    return round((statistics.median(last) - statistics.median(first)) / 2**20, 1)


def process_trends(samples: list[tuple[float, dict[str, int]]]) -> dict[str, float | None]:
    """Each process's RSS trend (:func:`rss_trend_mib`, its seconds counted from its own first
    sample) from ``samples`` of (s since the soak started, {"label:pid": bytes}). A process is
    its pid: one whose label changed (a Ray worker sets its title after it starts) is reported
    once, under its last label."""
    series: dict[str, list[tuple[float, int]]] = {}
    labels: dict[str, str] = {}
    for t, processes in samples:
        for label, rss in processes.items():
            pid = label.rsplit(":", 1)[-1]
            series.setdefault(pid, []).append((t, rss))
            labels[pid] = label
    return {
        labels[pid]: rss_trend_mib([(t - points[0][0], rss) for t, rss in points]) for pid, points in series.items()
    }
