"""Load benchmark: concurrent OpenAI clients against a live server, verispec vs llama.cpp's llama-server.

Starts each server as a subprocess on a loopback port, waits until it answers, then runs closed-loop
clients (each sends its next request when the last one finished) with the official ``openai``
client: streaming completions of HumanEval dev prompts, greedy, ``--max-tokens`` new tokens. Per
concurrency level it prints aggregate output tokens/s (completion tokens of all requests over the
level's wall time), p50/p95 time to first token and p50/p95 request latency, and the error count.
verispec runs one server for every level (continuous batching: ``--max-num-seqs`` 8); llama-server
is restarted per level with as many parallel slots (``-np``) as clients, as its users run it.

``--soak-seconds S``: afterwards, 8 clients for S seconds against verispec, sampling the server's
RSS every 5 s: errors and RSS growth after the first minute (warm-up) are reported.

Run it alone on the machine (``../shared/tools/alone python scripts/load_bench.py ...``).
llama-server: build it from the llama.cpp sources inside llama-cpp-python's sdist::

    version=$(pip show llama-cpp-python | sed -n 's/^Version: //p')
    pip download llama-cpp-python==$version --no-binary :all: --no-deps -d /tmp/lcpp
    tar xzf /tmp/lcpp/llama_cpp_python-*.tar.gz -C /tmp/lcpp && cd /tmp/lcpp/llama_cpp_python-*/vendor/llama.cpp
    cmake -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DGGML_NATIVE=ON
    cmake --build build --target llama-server
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai

ROOT = Path(__file__).resolve().parents[1]
HUMANEVAL = ROOT.parent / "shared" / "data" / "humaneval_dev.jsonl"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server subprocess; ``ready_path`` answers 200 once it can serve."""

    def __init__(self, name: str, command: list[str], port: int, ready_path: str, log_path: Path) -> None:
        self.name, self.command, self.port, self.ready_path = name, command, port, ready_path
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(log_path, "w")  # noqa: SIM115 -- open for the server's whole life; stop() closes it
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}; see {self.log.name}")
            try:
                if httpx.get(self.url + self.ready_path, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} was not ready within {timeout_s:.0f} s")

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()


def one_request(client: openai.OpenAI, model: str, prompt: str, max_tokens: int, extra: dict) -> dict:
    """A streamed completion: TTFT, latency (s), completion tokens (from usage)."""
    start = time.perf_counter()
    first, usage = None, None
    stream = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text and first is None:
            first = time.perf_counter()
        if chunk.usage is not None:
            usage = chunk.usage
    end = time.perf_counter()
    if usage is None:
        raise RuntimeError("the server sent no usage")
    return {"ttft_s": (first or end) - start, "latency_s": end - start, "tokens": usage.completion_tokens}


def run_level(
    url: str,
    model: str,
    prompts: list[str],
    num_clients: int,
    num_requests: int,
    max_tokens: int,
    extra: dict,
    deadline_s: float | None = None,
) -> dict:
    """Closed-loop clients until ``num_requests`` are done (or ``deadline_s`` passes)."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
    lock, results, errors, next_index = threading.Lock(), [], [], [0]

    def worker() -> None:
        while True:
            with lock:
                i = next_index[0]
                if (deadline_s is None and i >= num_requests) or (
                    deadline_s is not None and time.perf_counter() > deadline_s
                ):
                    return
                next_index[0] += 1
            try:
                result = one_request(client, model, prompts[i % len(prompts)], max_tokens, extra)
                with lock:
                    results.append(result)
            except Exception as exc:  # counted, reported
                with lock:
                    errors.append(repr(exc))

    start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(num_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    return summarise(results, errors, wall, num_clients)


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))] if values else float("nan")


def summarise(results: list[dict], errors: list[str], wall_s: float, num_clients: int) -> dict:
    tokens = sum(r["tokens"] for r in results)
    ttft = [r["ttft_s"] for r in results]
    latency = [r["latency_s"] for r in results]
    return {
        "clients": num_clients,
        "requests": len(results),
        "errors": len(errors),
        "error_samples": errors[:3],
        "output_tokens": tokens,
        "wall_s": round(wall_s, 2),
        "tokens_per_s": round(tokens / wall_s, 2) if wall_s else 0.0,
        "ttft_p50_s": round(statistics.median(ttft), 3) if ttft else None,
        "ttft_p95_s": round(percentile(ttft, 0.95), 3),
        "latency_p50_s": round(statistics.median(latency), 3) if latency else None,
        "latency_p95_s": round(percentile(latency, 0.95), 3),
    }


def print_table(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    print(
        "| clients | requests | errors | output tokens | wall s | tokens/s "
        "| TTFT p50 s | TTFT p95 s | latency p50 s | latency p95 s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['clients']} | {r['requests']} | {r['errors']} | {r['output_tokens']} | {r['wall_s']} "
            f"| {r['tokens_per_s']} | {r['ttft_p50_s']} | {r['ttft_p95_s']} | {r['latency_p50_s']} "
            f"| {r['latency_p95_s']} |"
        )
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", default="1,2,4,8", help="concurrency levels")
    parser.add_argument(
        "--requests-per-client", type=int, default=3, help="requests per client at each level (at least 8 per level)"
    )
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--verispec-args", default="--runner gguf --method auto", help="extra `verispec serve` flags")
    parser.add_argument(
        "--target-gguf",
        default=str(
            Path.home() / ".cache/verispec/models/qwen2.5-coder-1.5b-instruct/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
        ),
    )
    parser.add_argument("--llama-server", default=None, help="path to llama-server (omit to skip the peer)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--soak-seconds", type=float, default=0.0)
    parser.add_argument("--only", choices=["verispec", "llama-server"], default=None)
    parser.add_argument("--out", default="load_bench.json")
    args = parser.parse_args()
    levels = [int(x) for x in args.clients.split(",")]
    prompts = [json.loads(line)["prompt"] for line in HUMANEVAL.read_text().splitlines() if line.strip()]
    report: dict = {"max_tokens": args.max_tokens, "levels": levels, "verispec": [], "llama_server": []}
    logs = Path(args.out).with_suffix("")

    if args.only in (None, "verispec"):
        port = free_port()
        command = [
            str(Path(sys.executable).parent / "verispec"),
            "serve",
            "--port",
            str(port),
            *args.verispec_args.split(),
        ]
        server = Server("verispec", command, port, "/health", Path(f"{logs}-verispec.log"))
        try:
            server.wait_ready()
            model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
            run_level(server.url, model, prompts[-4:], 1, 2, 16, {})  # warm-up, not timed
            for n in levels:
                row = run_level(
                    server.url, model, prompts, n, max(8, n * args.requests_per_client), args.max_tokens, {}
                )
                report["verispec"].append(row)
                print_table(f"verispec ({args.verispec_args})", report["verispec"])
            if args.soak_seconds > 0:
                report["soak"] = soak(server, model, prompts, args)
                print(json.dumps(report["soak"], indent=1))
        finally:
            server.stop()

    if args.llama_server and args.only in (None, "llama-server"):
        for n in levels:
            port = free_port()
            command = [
                args.llama_server,
                "-m",
                args.target_gguf,
                "--port",
                str(port),
                "-np",
                str(n),
                "-c",
                str(4096 * n),
                "-t",
                str(args.threads),
                "--host",
                "127.0.0.1",
                "--no-webui",
            ]
            server = Server("llama-server", command, port, "/health", Path(f"{logs}-llama-server-{n}.log"))
            try:
                server.wait_ready()
                run_level(server.url, "target", prompts[-4:], 1, 2, 16, {})  # warm-up
                row = run_level(
                    server.url, "target", prompts, n, max(8, n * args.requests_per_client), args.max_tokens, {}
                )
                report["llama_server"].append(row)
                print_table("llama-server (plain decoding, -np = clients)", report["llama_server"])
            finally:
                server.stop()
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"\nwrote {args.out}")


def soak(server: Server, model: str, prompts: list[str], args) -> dict:
    """8 clients for ``--soak-seconds``; RSS sampled every 5 s (MiB), growth after the first 60 s."""
    samples: list[tuple[float, int]] = []
    stop = threading.Event()
    start = time.perf_counter()

    def sample() -> None:
        while not stop.is_set():
            samples.append((time.perf_counter() - start, server.rss_bytes()))
            stop.wait(5.0)

    sampler = threading.Thread(target=sample)
    sampler.start()
    row = run_level(server.url, model, prompts, 8, 0, args.max_tokens, {}, deadline_s=start + args.soak_seconds)
    stop.set()
    sampler.join()
    after = [rss for t, rss in samples if t >= 60.0] or [rss for _, rss in samples]
    return {
        **row,
        "seconds": args.soak_seconds,
        "rss_mib_first": round(samples[0][1] / 2**20, 1),
        "rss_mib_after_warmup_min": round(min(after) / 2**20, 1),
        "rss_mib_after_warmup_max": round(max(after) / 2**20, 1),
        "rss_growth_after_warmup_mib": round((after[-1] - after[0]) / 2**20, 1),
    }


if __name__ == "__main__":
    main()
