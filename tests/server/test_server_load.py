"""A bounded load test: 8 concurrent streaming clients send 50 requests over loopback.

Pass: 0 errors, every stream complete (a finish reason, then ``[DONE]``), greedy requests of
one prompt all return the same text, and the process's resident memory after the run is within
``RSS_BOUND_MIB`` of before (the server runs in this process). Prints the figures (pytest -s).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from server_support import served

NUM_CLIENTS = 8
NUM_REQUESTS = 50
MAX_TOKENS = 32
RSS_BOUND_MIB = 64


def rss_bytes() -> int:
    """Current resident set size of this process (Linux /proc), bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def request_body(i: int) -> tuple[str, dict]:
    """Alternate chat/completions, greedy/sampled (seeded), speculative/plain."""
    body = {"model": "tiny-target", "max_tokens": MAX_TOKENS, "stream": True, "temperature": 0.0 if i % 2 == 0 else 0.8}
    if i % 2:
        body["seed"] = i
    if i % 5 == 4:
        body["speculative"] = {"method": "none"}
    if i % 4 < 2:
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": f"请求 {i % 3}"}]}
    return "/v1/completions", {**body, "prompt": f"request {i % 3}"}


def stream_one(client: httpx.Client, i: int) -> dict:
    """Run request ``i``; returns its latency (s), text, finish reason and whether [DONE] came."""
    path, body = request_body(i)
    start = time.perf_counter()
    text, finish, done, errors = "", None, False, []
    with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            return {"i": i, "error": f"HTTP {response.status_code}", "latency_s": time.perf_counter() - start}
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if "error" in chunk:
                errors.append(chunk["error"])
            for choice in chunk.get("choices", []):
                text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                finish = choice.get("finish_reason") or finish
    error = errors[0] if errors else None if done and finish in ("stop", "length") else "incomplete"
    return {
        "i": i,
        "path": path,
        "body": body,
        "text": text,
        "finish": finish,
        "error": error,
        "latency_s": time.perf_counter() - start,
    }


def test_load_8_clients_50_requests(served):
    with httpx.Client(base_url=served.url, timeout=120) as warm:
        for i in range(NUM_CLIENTS):  # allocate what steady state needs before measuring
            stream_one(warm, i)
    rss_before = rss_bytes()
    start = time.perf_counter()
    with ThreadPoolExecutor(NUM_CLIENTS) as pool:
        clients = [httpx.Client(base_url=served.url, timeout=120) for _ in range(NUM_CLIENTS)]
        results = list(pool.map(lambda i: stream_one(clients[i % NUM_CLIENTS], i), range(NUM_REQUESTS)))
        for c in clients:
            c.close()
    wall_s = time.perf_counter() - start
    rss_after = rss_bytes()

    latencies = sorted(r["latency_s"] for r in results)
    p50, p95 = statistics.median(latencies), latencies[int(0.95 * (len(latencies) - 1))]
    errors = [r for r in results if r["error"]]
    print(
        f"\nload: {len(results)} requests, {NUM_CLIENTS} clients, {len(errors)} errors, wall {wall_s:.2f} s, "
        f"latency p50 {p50 * 1e3:.0f} ms p95 {p95 * 1e3:.0f} ms, "
        f"RSS before {rss_before / 2**20:.1f} MiB after {rss_after / 2**20:.1f} MiB"
    )
    assert errors == []
    assert len(results) == NUM_REQUESTS and all(r["finish"] in ("stop", "length") for r in results)
    greedy = {}
    for r in results:
        if r["body"]["temperature"] == 0.0:
            greedy.setdefault((r["path"], json.dumps(r["body"].get("messages") or r["body"]["prompt"])), set()).add(
                r["text"]
            )
    assert greedy and all(len(texts) == 1 for texts in greedy.values())  # plain or speculative, same text
    assert rss_after - rss_before < RSS_BOUND_MIB * 2**20
