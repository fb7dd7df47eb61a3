"""Fault soak (issue 29): closed-loop clients against a live ``verispec serve`` with faults injected.

``--clients`` clients (default 8) stream completions (and, every other request, non-streamed chat)
for ``--seconds`` (default 600) while a seeded schedule (``--seed``, one fault every
``--fault-every`` s on average) injects: clients that hang up mid-stream, malformed JSON, bodies of
several MB, a prompt over the model's context, invalid parameters, requests with ``n`` = 16, greedy
probes, and ``--kills`` (default 1) ``kill -9`` of the server with a restart on the same port and
``--suffix-cache`` file (with ``--replicas 2``: a replica's process killed instead; Ray restarts it).

Checks (the exit status is 1 when one fails): no request lost (every one answered, refused or cut
within ``--request-timeout``); no 5xx or stream error event outside the kills; every request in
flight at a kill ended within 5 s with an OpenAI error JSON, an error event or a cut connection;
the restarted server holds at least its last suffix cache snapshot's entries; every greedy probe's
text equals the same request sent alone to the idle server at the start; bad input is refused; no
request in flight on the server at the end. Prints a table, writes ``--out DIR``: soak.json,
rss.png (RSS over time, MiB), requests.jsonl (each request's outcome) and the server logs. The counting is in
``verispec.server.soak_checks``, the server's start, kills and RSS in ``soak_server.py``.

Run it alone on the machine (``../shared/tools/alone .venv/bin/python scripts/fault_soak.py``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import httpx
from load_bench import HUMANEVAL, free_port
from soak_server import ServerSide, metric, plot_rss, rss_figures

from verispec.server.soak_checks import (
    INVALID_PARAMS,
    Outage,
    Outcome,
    by_kind,
    fault_schedule,
    greedy_mismatches,
    is_openai_error,
    tally,
    unexpected_answers,
)

GREEDY_MAX_TOKENS = 32


class Soak(ServerSide):
    """The live run: the server (restarted after a kill), the request records and the clients."""

    def __init__(self, args, command: list[str], port: int, out: Path) -> None:
        self.args, self.command, self.port, self.out = args, command, port, out
        self.url = f"http://127.0.0.1:{port}"
        self.lock = threading.Lock()
        self.outcomes: list[Outcome] = []
        self.outages: list[Outage] = []
        self.kills: list[dict] = []
        self.rss: list[tuple[float, int, int]] = []  # (s since the soak started, bytes, server generation)
        self.rss_processes: list[tuple[float, dict[str, int]]] = []  # (s since the soak started, {process: bytes})
        self.generation_start: list[float] = [0.0]
        self.generation = 0
        self.server = self.start_server()
        self.start = time.perf_counter()
        timeout = httpx.Timeout(connect=10.0, read=args.request_timeout, write=60.0, pool=None)
        self.http = httpx.Client(timeout=timeout, limits=httpx.Limits(max_connections=64, max_keepalive_connections=0))
        self.stop = threading.Event()

    def now(self) -> float:
        return time.perf_counter() - self.start

    # --- one request, recorded ---

    def send(
        self,
        kind: str,
        path: str,
        *,
        body=None,
        content: bytes | None = None,
        stream: bool = False,
        close_after: int | None = None,
        variant: int = 0,
    ) -> Outcome:
        """POST and record the outcome; ``close_after``: hang up after that many stream events."""
        outcome = Outcome(kind, self.now(), variant=variant)
        with self.lock:
            self.outcomes.append(outcome)
        headers = {"content-type": "application/json"}
        data = content if content is not None else json.dumps(body).encode()
        try:
            with self.http.stream("POST", self.url + path, content=data, headers=headers) as response:
                outcome.status = response.status_code
                if response.status_code >= 400:
                    raw = response.read()
                    try:
                        outcome.error_json = is_openai_error(json.loads(raw))
                    except ValueError:
                        outcome.error_json = False
                    outcome.result, outcome.detail = "http_error", raw[:300].decode(errors="replace")
                elif stream:
                    self.read_stream(response, outcome, close_after)
                else:
                    answer = json.loads(response.read())
                    choices = answer.get("choices", [])
                    outcome.result, outcome.detail = "answered", f"{len(choices)} choices"
                    first = choices[0] if choices else {}
                    outcome.text = first.get("text", (first.get("message") or {}).get("content"))
        except httpx.TimeoutException as exc:
            outcome.result, outcome.detail = "lost", repr(exc)
        except (httpx.TransportError, json.JSONDecodeError) as exc:
            outcome.result, outcome.detail = "connection_error", repr(exc)
        outcome.end_s = self.now()
        return outcome

    @staticmethod
    def read_stream(response: httpx.Response, outcome: Outcome, close_after: int | None) -> None:
        events, text = 0, []
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                outcome.result = outcome.result or "answered"
                outcome.text = "".join(text)
                return
            event = json.loads(data)
            if "error" in event:
                outcome.result, outcome.detail = "stream_error", data[:300]
                continue  # [DONE] follows
            events += 1
            for choice in event.get("choices", []):
                text.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
            if close_after is not None and events >= close_after:
                outcome.result = "closed"
                return  # leaving the with-block closes the connection mid-stream
        outcome.result = outcome.result or "connection_error"
        outcome.detail = outcome.detail or "the stream ended without [DONE]"

    # --- clients and faults ---

    def client(self, index: int, prompts: list[str], model: str) -> None:
        """Closed loop until the deadline: streamed completions and non-streamed chat, greedy."""
        i = index
        while not self.stop.is_set():
            prompt = prompts[i % len(prompts)]
            if i % 2 == 0:
                body = {
                    "model": model,
                    "prompt": prompt,
                    "max_tokens": self.args.max_tokens,
                    "temperature": 0,
                    "stream": True,
                }
                outcome = self.send("normal", "/v1/completions", body=body, stream=True)
            else:
                body = {
                    "model": model,
                    "messages": [{"role": "user", "content": prompt}],
                    "max_tokens": self.args.max_tokens,
                    "temperature": 0,
                }
                outcome = self.send("normal", "/v1/chat/completions", body=body)
            if outcome.result == "connection_error":
                time.sleep(0.5)  # the server is down: do not spin
            i += self.args.clients

    def inject(self, kind: str, variant: int, model: str, prompts: list[str], greedy: list[str]) -> None:
        """One request fault (run in its own thread)."""
        base = {"model": model, "prompt": prompts[variant % len(prompts)], "max_tokens": 16}
        if kind == "disconnect":
            self.send(
                kind, "/v1/completions", body={**base, "max_tokens": 200, "stream": True}, stream=True, close_after=3
            )
        elif kind == "malformed_json":
            self.send(kind, "/v1/completions", content=b'{"model": "' + model.encode() + b'", "prompt": "hi", "max_')
        elif kind == "oversized_body":
            self.send(kind, "/v1/completions", body={**base, "prompt": "x" * (self.args.oversized_mib * 2**20)})
        elif kind == "over_context":
            self.send(kind, "/v1/completions", body={**base, "prompt": " hello" * self.args.over_context_words})
        elif kind == "invalid_params":
            self.send(kind, "/v1/completions", body={**base, **INVALID_PARAMS[variant]}, variant=variant)
        elif kind == "n16":
            self.send(kind, "/v1/completions", body={**base, "n": 16, "temperature": 0.8, "seed": variant})
        elif kind == "greedy":
            self.send(kind, "/v1/completions", body=greedy_body(model, greedy[variant]), variant=variant)

    def in_flight(self) -> list[Outcome]:
        with self.lock:
            return [o for o in self.outcomes if o.end_s is None]


def greedy_body(model: str, prompt: str) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": GREEDY_MAX_TOKENS, "temperature": 0}


def run(args) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = [json.loads(line)["prompt"] for line in HUMANEVAL.read_text().splitlines() if line.strip()]
    greedy = prompts[-args.greedy_prompts :]
    port = args.port or free_port()
    command = [str(Path(sys.executable).parent / "verispec"), "serve", "--port", str(port), *args.server_args.split()]
    command += [f"--{name}={value}" for name, value in (("target", args.target), ("draft", args.draft)) if value]
    if args.replicas:
        command += ["--replicas", str(args.replicas)]
    else:
        command += ["--suffix-cache", str(args.suffix_cache)]
    print("server:", " ".join(command), flush=True)
    soak = Soak(args, command, port, out)
    try:
        model = httpx.get(soak.url + "/v1/models", timeout=30).json()["data"][0]["id"]
        reference = {}
        for variant, prompt in enumerate(greedy):  # alone, on the idle server
            reply = httpx.post(soak.url + "/v1/completions", json=greedy_body(model, prompt), timeout=600)
            reply.raise_for_status()
            reference[variant] = reply.json()["choices"][0]["text"]
        schedule = fault_schedule(
            args.seed,
            args.seconds,
            args.fault_every,
            args.kills,
            "replica_kill" if args.replicas else "kill",
            len(greedy),
        )
        soak.start = time.perf_counter()
        threads = [threading.Thread(target=soak.client, args=(i, prompts, model)) for i in range(args.clients)]
        threads.append(threading.Thread(target=soak.sample_rss))
        for t in threads:
            t.start()
        injected = []
        for fault in schedule:
            time.sleep(max(0.0, fault.at_s - soak.now()))
            if fault.kind == "kill":
                soak.kill()
            elif fault.kind == "replica_kill":
                soak.kill_replica()
            else:
                thread = threading.Thread(target=soak.inject, args=(fault.kind, fault.variant, model, prompts, greedy))
                thread.start()
                injected.append(thread)
        time.sleep(max(0.0, args.seconds - soak.now()))
        soak.stop.set()
        for t in threads + injected:
            t.join(timeout=args.request_timeout + 30)
        wall_s = soak.now()
        soak.judge_replica_kills()
        time.sleep(1.0)  # let the server see the last hang-ups
        in_flight_after = metric(soak.url, "verispec_requests_in_flight")
    finally:
        soak.stop.set()
        soak.server.stop()
    with soak.lock:
        outcomes = list(soak.outcomes)
    counts = tally(outcomes, soak.outages)
    report = {
        "seconds": args.seconds,
        "wall_s": round(wall_s, 1),
        "clients": args.clients,
        "seed": args.seed,
        "server": command,
        **counts,
        "faults_injected": dict(sorted(Counter(f.kind for f in schedule).items())),
        "by_kind": by_kind(outcomes),
        "unexpected_answers": unexpected_answers(outcomes),
        "kills": soak.kills,
        "greedy_probes": sum(o.kind == "greedy" and o.result == "answered" for o in outcomes),
        "greedy_mismatches": greedy_mismatches(reference, [o for o in outcomes if o.kind == "greedy"]),
        "in_flight_after": in_flight_after,
        "rss": rss_figures(soak),
        "answered_latency_p50_s": _median(
            [o.end_s - o.sent_s for o in outcomes if o.kind == "normal" and o.result == "answered"]
        ),
    }
    report["checks"] = {
        "no_request_lost": counts["lost"] == 0,
        "no_5xx_outside_kills": counts["server_faults_outside_kills"] == 0,
        "kills_answered_within_5s": all(k["ok"] for k in soak.kills),
        "suffix_snapshot_restored": all(k.get("snapshot_ok", True) for k in soak.kills),
        "greedy_equal": not report["greedy_mismatches"] and report["greedy_probes"] > 0,
        "bad_input_refused": not report["unexpected_answers"],
        "nothing_in_flight_after": in_flight_after == 0,
        "errors_are_openai_json": counts["http_errors_without_openai_json"] == 0,
    }
    plot_rss(soak.rss, soak.outages, out / "rss.png")
    (out / "soak.json").write_text(json.dumps(report, indent=1))
    (out / "requests.jsonl").write_text("".join(json.dumps(asdict(o)) + "\n" for o in outcomes))
    return report


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 2) if values else None


def print_report(report: dict, out: Path) -> None:
    rows = [
        ("requests sent", report["sent"]),
        ("answered (2xx, complete)", report["answered"]),
        ("latency p50 of answered client requests s", report["answered_latency_p50_s"]),
        ("HTTP errors by status", report["http_errors_by_status"]),
        ("error events inside streams", report["stream_error_events"]),
        ("connection errors (most while down)", report["connection_errors"]),
        ("closed by the client", report["closed_by_client"]),
        ("lost", report["lost"]),
        ("5xx / error events outside kills", report["server_faults_outside_kills"]),
        ("faults injected", report["faults_injected"]),
        (
            "kills: at s / in flight / ended within 5 s / back after s",
            [
                (
                    k.get("kill_s"),
                    k.get("in_flight"),
                    k.get("ended_in_time"),
                    k.get("restart_s", k.get("replica_back_s")),
                )
                for k in report["kills"]
            ],
        ),
        (
            "replica kills: in flight answered in full by the other replicas",
            [k.get("answered_by_others") for k in report["kills"]],
        ),
        (
            "suffix snapshot entries -> restored",
            [(k.get("snapshot_entries"), k.get("restored_entries")) for k in report["kills"]],
        ),
        ("greedy probes (mismatches)", f"{report['greedy_probes']} ({len(report['greedy_mismatches'])})"),
        ("in flight after the soak", report["in_flight_after"]),
        (
            "RSS first / max / last MiB",
            f"{report['rss'].get('first_mib')} / {report['rss'].get('max_mib')} / {report['rss'].get('last_mib')}",
        ),
        ("RSS growth after 1st minute MiB (last - first sample)", report["rss"]["growth_after_first_minute_mib"]),
        (
            "RSS growth after 1st minute MiB (median of last minute - of 2nd)",
            report["rss"]["median_growth_after_first_minute_mib"],
        ),
        (
            "  the same, per process of the tree",
            {k: v for k, v in report["rss"]["median_growth_by_process_mib"].items() if v is not None},
        ),
    ]
    print(f"\nfault soak: {report['clients']} clients, {report['wall_s']} s, seed {report['seed']}")
    print("| figure | value |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")
    print("\n| kind | results |\n|---|---|")
    for kind, row in report["by_kind"].items():
        print(f"| {kind} | {row} |")
    print("\n| check | passed |\n|---|---|")
    for name, ok in report["checks"].items():
        print(f"| {name} | {'yes' if ok else 'NO'} |")
    for line in report["server_fault_samples"] + report["unexpected_answers"] + report["greedy_mismatches"][:5]:
        print("  ", line)
    for kill in report["kills"]:
        for line in kill.get("late", [])[:5]:
            print("   late after a kill:", line)
    print(f"\nwrote {out / 'soak.json'} and {out / 'rss.png'}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fault-every", type=float, default=3.0, help="mean seconds between request faults")
    parser.add_argument("--kills", type=int, default=1, help="kill -9 of the server (a replica with --replicas)")
    parser.add_argument("--target", default=None, help="passed to verispec serve (default: the project's)")
    parser.add_argument("--draft", default=None, help="passed to verispec serve (default: the project's)")
    parser.add_argument("--server-args", default="", help="more `verispec serve` flags")
    parser.add_argument("--suffix-cache", type=Path, default=None, help="default: OUT/suffix.cache (fresh)")
    parser.add_argument("--replicas", type=int, default=0, help="serve N Ray replicas (no suffix cache file then)")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--greedy-prompts", type=int, default=3)
    parser.add_argument("--oversized-mib", type=int, default=6)
    parser.add_argument("--over-context-words", type=int, default=40000, help="' hello' repeats: over a 32k context")
    parser.add_argument("--request-timeout", type=float, default=180.0, help="seconds without an answer: lost")
    parser.add_argument("--rss-every", type=float, default=5.0)
    parser.add_argument("--out", default="fault_soak")
    args = parser.parse_args()
    if args.suffix_cache is None:
        args.suffix_cache = Path(args.out) / "suffix.cache"
        Path(args.out).mkdir(parents=True, exist_ok=True)
        args.suffix_cache.unlink(missing_ok=True)
    report = run(args)
    print_report(report, Path(args.out))
    sys.exit(0 if all(report["checks"].values()) else 1)


if __name__ == "__main__":
    main()
