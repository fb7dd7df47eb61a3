"""Eight clients, one system prompt: ``verispec serve`` with its prefix cache off and on (issue 53).

Starts ``verispec serve`` twice on a loopback port, ``--prefix-cache-gib 0`` then the default,
and each time sends ``--clients`` streamed chat completions at once: the support-policy system
prompt of ``verispec bench --workload multiturn`` and a different question each, greedy,
``--max-tokens`` new tokens. Per server: aggregate output tokens/s (completion tokens over the
wall time of the burst), TTFT median and max, the prefix cache's figures from ``/metrics``
(blocks held, hits). With the cache off, each request is then sent again alone: the reference
every concurrent answer of both servers must equal (greedy; batch-invariant kernels).

Run it alone on the machine: ``../shared/tools/alone .venv/bin/python scripts/shared_prompt_clients.py``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load_bench import Server, free_port

from verispec.bench.sessions import QUESTIONS, support_policy

VERISPEC = str(Path(sys.executable).parent / "verispec")


def chat(client: openai.OpenAI, model: str, question: str, max_tokens: int) -> dict:
    """One streamed chat completion: TTFT and latency (s), text, usage."""
    start = time.perf_counter()
    first, usage, text = None, None, []
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": support_policy()}, {"role": "user", "content": question}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    end = time.perf_counter()
    return {
        "ttft_s": (first or end) - start,
        "latency_s": end - start,
        "text": "".join(text),
        "tokens": usage.completion_tokens,
        "cached_tokens": getattr(usage.prompt_tokens_details, "cached_tokens", None),  # the SDK's typed field
    }


def burst(url: str, model: str, questions: list[str], max_tokens: int) -> tuple[list[dict], float]:
    """Every question at once, one client each; the results in question order and the wall time."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=1200)
    results: list[dict | None] = [None] * len(questions)

    def one(i: int) -> None:
        results[i] = chat(client, model, questions[i], max_tokens)

    start = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(questions))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - start


def prefix_metrics(url: str) -> dict:
    text = httpx.get(url + "/metrics").text
    wanted = ("verispec_prefix_cache_blocks", "verispec_prefix_cache_hits_total", "verispec_prefix_cache_queries_total")
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line.startswith(wanted)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--serve-args", default="", help="extra `verispec serve` flags")
    parser.add_argument(
        "--warm", action="store_true", help="the cached server also prefills the policy at start (--warm-prompt)"
    )
    parser.add_argument("--out", default="shared_prompt_clients.json")
    args = parser.parse_args()
    questions = [q for conversation in QUESTIONS for q in conversation][: args.clients]
    report = {"clients": args.clients, "max_tokens": args.max_tokens, "runs": {}}
    alone = None
    on_flags = []
    if args.warm:
        policy = Path(args.out).with_suffix(".policy.txt")
        policy.write_text(support_policy())
        on_flags = ["--warm-prompt", str(policy)]
    for name, flags in (("prefix cache off", ["--prefix-cache-gib", "0"]), ("prefix cache on", on_flags)):
        port = free_port()
        command = [VERISPEC, "serve", "--port", str(port), *flags, *args.serve_args.split()]
        server = Server(name, command, port, "/health", Path(f"/tmp/shared_prompt_{port}.log"))
        try:
            server.wait_ready()
            model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
            results, wall = burst(server.url, model, questions, args.max_tokens)
            metrics = prefix_metrics(server.url)
            if alone is None:  # the reference: each request alone, on the server without the cache
                client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=1200)
                alone = [chat(client, model, q, args.max_tokens)["text"] for q in questions]
            rss = server.rss_bytes()
        finally:
            server.stop()
        ttft = [r["ttft_s"] for r in results]
        tokens = sum(r["tokens"] for r in results)
        row = {
            "aggregate_tokens_per_s": round(tokens / wall, 2),
            "wall_s": round(wall, 1),
            "ttft_median_s": round(statistics.median(ttft), 2),
            "ttft_max_s": round(max(ttft), 2),
            "completion_tokens": tokens,
            "cached_tokens": [r["cached_tokens"] for r in results],
            "identical_to_alone": sum(r["text"] == a for r, a in zip(results, alone)),
            "rss_mib": round(rss / 2**20),
            "metrics": metrics,
        }
        report["runs"][name] = row
        print(name, json.dumps(row), flush=True)
    off, on = report["runs"]["prefix cache off"], report["runs"]["prefix cache on"]
    print(
        "\n| server | aggregate tok/s | TTFT median s | TTFT max s | identical to alone | prefix cache blocks |\n"
        "|---|---|---|---|---|---|\n"
        + "\n".join(
            f"| {n} | {r['aggregate_tokens_per_s']} | {r['ttft_median_s']} | {r['ttft_max_s']} | "
            f"{r['identical_to_alone']}/{args.clients} | {r['metrics'].get('verispec_prefix_cache_blocks', '—')} |"
            for n, r in report["runs"].items()
        )
        + f"\n\naggregate ratio on/off: {on['aggregate_tokens_per_s'] / off['aggregate_tokens_per_s']:.2f}x"
    )
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
