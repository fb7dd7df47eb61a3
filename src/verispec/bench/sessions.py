"""Workloads whose requests re-send what came before: a support chat and an editor's completions.

Owns the two session workloads of ``verispec bench --workload`` (issue 53) and their run:
``multiturn``: conversations under one long support-policy system prompt, each turn re-sending
the conversation so far with the assistant's answers fed back; ``completion``: a source file
growing at the cursor, each request the file up to the cursor. Every participant gets the same
requests in the same order (the conversations one after another, their turns in order; answers
fed back are the first participant's, so the prompts are the same bytes for all):
verispec with its prefix cache, verispec without it (the output reference: every output must be
identical), and llama-cpp-python, which keeps its previous prompt's KV cache and evaluates only
what follows the longest common prefix (``Llama.generate`` with ``reset=True``), as a chat
client of it would see. Times are wall clock of each request, TTFT from its start to the first
token. Knows nothing about the single-prompt workloads (:mod:`verispec.bench.run`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from importlib import resources

from verispec.algorithms.sampling import SamplingParams
from verispec.bench.report import markdown_table
from verispec.engine.loader import SpeculativePipeline
from verispec.engine.request import GenerationOutput, SpeculativeConfig
from verispec.errors import InvalidParameterError
from verispec.models.gguf_tokenizer import chat_token_ids
from verispec.progress import announce_slow

SESSION_WORKLOADS = {
    "multiturn": "a support chat: a ~1,150-token policy as the system prompt, conversations of several turns",
    "completion": "an editor's completion: a Python file growing at the cursor, a request at each pause",
}
SESSION_MAX_TOKENS = {"multiturn": 64, "completion": 32}  # an answer, a completion at the cursor
QUESTIONS = (  # two conversations of six turns under the support policy
    (
        "Hi, my order NW-20418837 still says Packed. Can I still change the delivery address?",
        "What would it cost, and how much later would it arrive?",
        "OK. The battery is in the same order, will it come with the parcel?",
        "Can the installers come on a Saturday morning instead?",
        "And if I need to move that visit, how late can I do it for free?",
        "Thanks. One last thing: where do I find my invoice?",
    ),
    (
        "The Northwind app shows error E12 on my inverter since this morning. What should I do?",
        "It was installed four years ago. Do I have to pay for the technician?",
        "The app also shows no production data since yesterday. Is that the same problem?",
        "If the battery turns out to be worn, when would you replace it?",
        "I also saw a second charge for the same invoice on my card. How do I get it back?",
        "I am not happy with how long this takes. Who can I talk to?",
    ),
)
EDITOR_REQUESTS = 6  # completions at the cursor, the file growing between them
EDITOR_FIRST_LINE, EDITOR_LAST_LINE = 200, 250  # the cursor's first and last line (of the packaged file)


@dataclass
class SessionRequest:
    """One request of a session: ``session`` and ``turn`` (0-based), its prompt token ids."""

    session: int
    turn: int
    prompt_token_ids: list[int]


@dataclass
class TurnRecord:
    """What one participant did with one request: times in ms, token counts, whether its tokens
    equal the reference's (None for the reference itself and for peers on other numerics)."""

    participant: str
    session: int
    turn: int
    prompt_tokens: int
    cached_tokens: int | None
    output_tokens: int
    ttft_ms: float
    e2e_ms: float
    identical: bool | None = None


@dataclass
class SessionResults:
    """A session workload's records, per participant and request, and their summary."""

    workload: str
    max_tokens: int
    method: str
    participants: list[str]
    records: list[TurnRecord] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def summary(self) -> list[dict]:
        """Per participant: total seconds, TTFT of the first request and median TTFT of the later
        ones (ms), the ratio of llama.cpp's total to this one's (> 1: faster than llama.cpp),
        cached prompt tokens, outputs identical to the reference."""
        rows = []
        peer = self._total("llama.cpp:plain")
        for name in self.participants:
            mine = [r for r in self.records if r.participant == name]
            later = [r.ttft_ms for r in mine if (r.session, r.turn) != (0, 0)]
            checked = [r.identical for r in mine if r.identical is not None]
            total = sum(r.e2e_ms for r in mine) / 1e3
            rows.append(
                {
                    "participant": name,
                    "requests": len(mine),
                    "total_s": round(total, 2),
                    "first_ttft_ms": round(mine[0].ttft_ms, 1) if mine else None,
                    "median_later_ttft_ms": round(statistics.median(later), 1) if later else None,
                    "vs_llama_cpp": round(peer / total, 3) if peer and total else None,
                    "prompt_tokens": sum(r.prompt_tokens for r in mine),
                    "cached_tokens": None
                    if mine and mine[0].cached_tokens is None
                    else sum(r.cached_tokens or 0 for r in mine),
                    "identical": f"{sum(checked)}/{len(checked)}"
                    if checked
                    else ("reference" if name == self.participants[1] else "not compared"),
                }
            )
        return rows

    def _total(self, name: str) -> float | None:
        mine = [r.e2e_ms for r in self.records if r.participant == name]
        return sum(mine) / 1e3 if mine else None

    def to_dict(self) -> dict:
        return {
            "workload": self.workload,
            "max_tokens": self.max_tokens,
            "method": self.method,
            "participants": self.participants,
            "summary": self.summary(),
            "records": [asdict(r) for r in self.records],
            "notes": self.notes,
        }


def support_policy() -> str:
    """The support chat's system prompt (a fictional company's policy, written for this workload)."""
    return resources.files("verispec.bench").joinpath("data/support_policy.txt").read_text(encoding="utf-8")


def editor_file() -> str:
    """The editor workload's file: a fixed copy of a verispec module, shipped with the package."""
    return resources.files("verispec.bench").joinpath("data/editor_file.py.txt").read_text(encoding="utf-8")


def editor_prompts(
    text: str,
    num_requests: int = EDITOR_REQUESTS,
    first_line: int = EDITOR_FIRST_LINE,
    last_line: int = EDITOR_LAST_LINE,
) -> list[str]:
    """The file up to the cursor at each request: the cursor at the end of lines spread evenly
    from ``first_line`` to ``last_line`` (the user typed the lines between)."""
    lines = text.splitlines(keepends=True)
    last = min(last_line, len(lines))
    first = min(first_line, last)
    step = (last - first) / max(num_requests - 1, 1)
    return ["".join(lines[: round(first + i * step)]) for i in range(num_requests)]


Participant = Callable[[list[int], SamplingParams], GenerationOutput]


def run_sessions(
    pipe: SpeculativePipeline,
    workload: str,
    *,
    method: str = "auto",
    max_tokens: int = 64,
    num_speculative_tokens: int = 5,
    schedule: str = "cost",
    peer=None,
    num_sessions: int | None = None,
    on_request: Callable[[str, SessionRequest], None] | None = None,
    editor_requests: Sequence[str] | None = None,
) -> SessionResults:
    """Run a session workload through verispec with and without the prefix cache, and ``peer``
    (a :class:`verispec.bench.peers.LlamaCppPeer` that reuses its previous prompt, or None).

    Greedy; the answers fed back (multiturn) are the cached run's, whose tokens are checked
    against the uncached run's. ``num_sessions``: conversations (multiturn, at most 2) or
    requests (completion) to run, default all. ``editor_requests``: the completion workload's
    prompts (default :func:`editor_prompts` of the packaged file).

    Raises:
        InvalidParameterError: an unknown workload, a pipeline without a prefix cache, or a
            model without a chat template for ``multiturn``.
    """
    _check_workload(pipe, workload)
    spec = SpeculativeConfig(method=method, num_speculative_tokens=num_speculative_tokens, schedule=schedule)
    participants = _participants(pipe, method, spec, peer)
    results = SessionResults(workload, max_tokens, method, list(participants))
    results.notes.append(
        "llama.cpp:plain is llama-cpp-python keeping its previous prompt's KV cache (it evaluates only what "
        "follows the longest common prefix of its last prompt); verispec's prefix cache keeps every earlier "
        "prompt and answer in 16-token blocks"
    )
    params = SamplingParams(max_tokens=max_tokens)

    def run(request: SessionRequest) -> GenerationOutput:
        """``request`` to every participant; the first one's output."""
        return _run_request(request, participants, params, results, on_request)

    if workload == "multiturn":
        _run_multiturn(pipe, run, num_sessions)
    else:
        prompts = list(editor_requests or editor_prompts(editor_file()))
        for turn, text in enumerate(prompts[: num_sessions or len(prompts)]):
            run(SessionRequest(0, turn, pipe.encode(text)))
    return results


def _check_workload(pipe: SpeculativePipeline, workload: str) -> None:
    """Raise InvalidParameterError for an unknown workload, or one ``pipe`` cannot run."""
    if workload not in SESSION_WORKLOADS:
        raise InvalidParameterError(f"unknown session workload {workload!r}; choose {', '.join(SESSION_WORKLOADS)}")
    if pipe.prefix_cache is None:
        raise InvalidParameterError(
            f"the {workload} workload compares the prefix cache on and off: {pipe.prefix_cache_note}"
        )
    if workload == "multiturn" and not getattr(pipe.tokenizer, "chat_template", None):
        raise InvalidParameterError(f"{pipe.target.name} has no chat template: the multiturn workload is a chat")


def _participants(pipe: SpeculativePipeline, method: str, spec: SpeculativeConfig, peer) -> dict[str, Participant]:
    """verispec with its prefix cache (emptied), without it (the reference), and ``peer`` if any."""
    cached_engine = pipe.engine_with_own_suffix_cache()  # its own suffix cache: never drafts the other's answer
    uncached_engine = pipe.engine_with_own_suffix_cache()
    uncached_engine.prefix_cache = None
    cached_engine.prefix_cache.clear()
    participants: dict[str, Participant] = {
        f"verispec:{method} (prefix cache)": lambda ids, p: cached_engine.generate(ids, p, spec),
        f"verispec:{method} (no cache)": lambda ids, p: uncached_engine.generate(ids, p, spec),
    }
    if peer is not None:
        peer.reuse_prompt = True
        peer.llm.reset()
        participants["llama.cpp:plain"] = peer.generate
    return participants


def _run_request(
    request: SessionRequest,
    participants: dict[str, Participant],
    params: SamplingParams,
    results: SessionResults,
    on_request: Callable[[str, SessionRequest], None] | None,
) -> GenerationOutput:
    """``request`` to each participant in turn, timed; their records appended to ``results``.
    Returns the first participant's output (the answer fed back)."""
    names = list(participants)
    reference = names[1]
    outputs, times = {}, {}
    for name in names:
        if on_request is not None:
            on_request(name, request)
        start = time.perf_counter()
        outputs[name] = participants[name](request.prompt_token_ids, params)
        times[name] = (time.perf_counter() - start) * 1e3
    for name in names:
        out, ours = outputs[name], name.startswith("verispec")
        identical = out.token_ids == outputs[reference].token_ids if ours and name != reference else None
        results.records.append(
            TurnRecord(
                name,
                request.session,
                request.turn,
                len(request.prompt_token_ids),
                out.metrics.cached_tokens if ours else None,
                len(out.token_ids),
                out.metrics.ttft_ms,
                times[name],
                identical,
            )
        )
    return outputs[names[0]]


def _run_multiturn(
    pipe: SpeculativePipeline, run: Callable[[SessionRequest], GenerationOutput], num_sessions: int | None
) -> None:
    """The support chats, each turn the conversation so far with the answers ``run`` gave fed back."""
    system = support_policy()
    for session, questions in enumerate(QUESTIONS[: num_sessions or len(QUESTIONS)]):
        messages = [{"role": "system", "content": system}]
        for turn, question in enumerate(questions):
            messages.append({"role": "user", "content": question})
            out = run(SessionRequest(session, turn, chat_token_ids(pipe.tokenizer, messages)))
            messages.append({"role": "assistant", "content": out.text})


def warm_up(pipe: SpeculativePipeline, peer, method: str) -> None:
    """One short untimed request per participant (kernels, thread pools, the first pass's one-off
    costs), on a prompt unlike the workload's; the prefix cache is emptied afterwards."""
    with announce_slow("warming up the session participants", "8 untimed tokens each"):
        ids = pipe.encode("def warm_up():")
        pipe.engine.generate(ids, SamplingParams(max_tokens=8), SpeculativeConfig(method=method), learn=False)
        if peer is not None:
            peer.generate(ids, SamplingParams(max_tokens=8))
        pipe.prefix_cache.clear()


def session_table(results: SessionResults) -> list[list[str]]:
    """The summary as printable rows (header first)."""
    header = [
        "participant",
        "requests",
        "total s",
        "first TTFT ms",
        "median later TTFT ms",
        "vs llama.cpp (e2e)",
        "cached / prompt tokens",
        "identical",
    ]
    rows = [header]
    for row in results.summary():
        cached = "—" if row["cached_tokens"] is None else f"{row['cached_tokens']:,} / {row['prompt_tokens']:,}"
        ratio = "—" if row["vs_llama_cpp"] is None else f"{row['vs_llama_cpp']:.2f}x"
        rows.append(
            [
                row["participant"],
                str(row["requests"]),
                f"{row['total_s']:.1f}",
                f"{row['first_ttft_ms']:.0f}",
                "—" if row["median_later_ttft_ms"] is None else f"{row['median_later_ttft_ms']:.0f}",
                ratio,
                cached,
                row["identical"],
            ]
        )
    return rows


def session_markdown(results: SessionResults) -> str:
    """The summary as a Markdown table (what a note or report copies)."""
    rows = session_table(results)
    return markdown_table(rows[0], rows[1:])


def check_sessions_limit(num_sessions: int | None, workload: str) -> None:
    """Raises InvalidParameterError for a ``--limit`` the session workload cannot take."""
    most = len(QUESTIONS) if workload == "multiturn" else EDITOR_REQUESTS
    if num_sessions is not None and not 1 <= num_sessions <= most:
        raise InvalidParameterError(f"--limit for the {workload} workload must be in 1..{most}, got {num_sessions}")
