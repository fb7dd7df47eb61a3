"""Replay of the ``cost`` schedule's draft-length choices on real agreement sequences.

A greedy chain's outcome is fixed by teacher forcing: at each answer position the draft's argmax
(given the target's tokens before it) either equals the target's token or not, and a chain drafted
from position i accepts the run of agreements that starts there. So, given those sequences, the
tokens per target pass of a draft-length policy can be counted exactly. The policy replayed is
:class:`verispec.algorithms.schedules.CostModelSchedule` with its acceptance estimate (switch-off,
probes every ``probe_interval`` plain steps, a follow-up probe after a fully accepted one) on
fixed costs; the time comes from a cost model (verify cost per draft length and draft cost per
token, in plain steps), so the speedups are estimates for that cost model, not measurements.
Left out: the catch-up pricing (a model drafter sitting out a step whose catch-up would not pay),
the costs' own EWMAs, catch-ups, probes' extra cost and Python overhead.

  dump: the draft's agreement with the target's answers of a ``verispec bench`` record (its
        ``gguf:none`` rows; the draft sees the prompt's last WINDOW tokens, 64 as the engine's
        default) or of Spec-Bench answers (``bench_results/specbench_auto.jsonl``, 8 per task):
      ../shared/tools/alone .venv/bin/python scripts/draft_length_sim.py dump RESULTS.json|specbench OUT.json [WINDOW]
  simulate: constant k = 1..4, the ``cost`` schedule's acceptance EWMA at several weights, and
        the oracle (each step's length chosen knowing the outcome: the most any draft-length
        policy of this drafter gets on that cost model):
      python scripts/draft_length_sim.py simulate OUT.json...
"""

import json
import sys
from pathlib import Path

from verispec.algorithms.control import AcceptanceEstimate, ControllerConfig, CostModel, interpolate
from verispec.algorithms.schedules import CostModelSchedule

ROOT = Path(__file__).resolve().parents[1]
# (ms per target pass over 1, 2, 4, 8, 16 tokens, i.e. 0, 1, 3, 7, 15 drafted ones; a drafted
# token's cost over a plain pass), AVX2 host
COSTS = {
    "calm AVX2 host (2026-12-04 morning)": ({1: 68.1, 2: 63.7, 4: 75.8, 8: 134.1, 16: 270.0}, 0.21),
    "slowed AVX2 host (2026-12-04 evening)": ({1: 81.8, 2: 88.9, 4: 124.0, 8: 231.9, 16: 445.3}, 0.27),
    "AVX2 host, one-pass tiles (2026-12-04 night)": ({1: 60.2, 2: 56.4, 4: 67.7, 8: 114.8, 16: 212.1}, 0.23),
    # Zen 4, avx512, default draft head (bench --curves, bench_results/cheap_drafts_zen4_2026-12-07/session5)
    "Zen 4 host, code bench run (2026-12-07)": ({1: 35.3, 2: 35.7, 4: 37.4, 8: 53.5, 16: 101.0}, 0.22),
    "Zen 4 host, chat bench run (2026-12-07)": ({1: 39.6, 2: 47.1, 4: 49.8, 8: 83.8, 16: 164.1}, 0.24),
    "Zen 4 code curve, draft at the bar (0.2)": ({1: 35.3, 2: 35.7, 4: 37.4, 8: 53.5, 16: 101.0}, 0.20),
}
WEIGHTS = (0.2, 0.1, 0.05)
MAX_K = 8


def dump(source: str, out: str, window: int = 64) -> None:
    import torch

    from verispec.bench.workload import load_workload
    from verispec.engine.loader import SpeculativePipeline
    from verispec.runners.select import RunnerOptions

    pipe = SpeculativePipeline.load(
        "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", runners=RunnerOptions(kind="gguf")
    )
    cases = []  # (id, task, prompt ids, answer ids)
    if source == "specbench":
        questions = [
            json.loads(line) for line in (ROOT.parent / "shared" / "data" / "specbench_questions.jsonl").open()
        ]
        by_task: dict[str, list] = {}
        for line in (ROOT / "bench_results" / "specbench_auto.jsonl").open():
            row = json.loads(line)
            if row["config"] == "none" and len(by_task.setdefault(row["category"], [])) < 8:
                by_task[row["category"]].append(row)
        for task, rows in by_task.items():
            cases += [
                (
                    row["question"],
                    task,
                    pipe.encode(questions[row["question"]]["turns"][0], chat=True),
                    row["output_token_ids"],
                )
                for row in rows
            ]
    else:
        data = json.loads(Path(source).read_text())
        records = [r for r in data["records"] if r["runner"] == "gguf:none"]
        items = {item.id: item for item in load_workload(data["config"]["workload"], None, None, len(records))}
        cases = [
            (
                r["prompt_id"],
                r["category"],
                pipe.encode(items[r["prompt_id"]].text, chat=items[r["prompt_id"]].chat),
                r["token_ids"],
            )
            for r in records
        ]
    result = []
    for case_id, task, prompt, answer in cases:
        prompt = prompt[-window:]
        pipe.draft_runner.truncate(0)
        logits = pipe.draft_runner.forward(prompt + answer)[len(prompt) - 1 : -1]
        agree = (logits.argmax(-1) == torch.tensor(answer)).int().tolist()
        result.append({"id": case_id, "task": task, "agree": agree})
    Path(out).write_text(json.dumps(result))
    total = sum(len(r["agree"]) for r in result)
    agreed = sum(sum(r["agree"]) for r in result)
    print(f"{len(result)} answers, {total} positions, draft argmax == target token {agreed / total:.4f}")


def verify_ratios(curve: dict[int, float]) -> list[float]:
    """Verify cost of k drafted tokens (k + 1 rows) over a plain pass, non-decreasing."""
    ratios, highest = [], 1.0
    for k in range(MAX_K + 1):
        highest = max(highest, interpolate(curve, k + 1) / curve[1])
        ratios.append(highest)
    return ratios


def replay(answers: list[list[int]], verify: list[float], c: float, weight: float | None, constant: int = 0) -> float:
    """Tokens per plain-step cost over ``answers`` (one request after another, each with a new
    schedule and the acceptance estimate carried over, as the engine does); ``weight`` None: a
    constant draft length ``constant``."""
    tokens = cost = 0.0
    last_alpha = ControllerConfig().alpha_prior
    step_costs = [verify[k] + k * c for k in range(MAX_K + 1)]
    costs = CostModel(weight=0.0)  # frozen: the replay prices every step alike
    costs.verify_s = {k: ratio for k, ratio in enumerate(verify)}
    costs.draft_ratio["draft"] = c
    for agree in answers:
        if weight is not None:
            config = ControllerConfig(alpha_weight=weight)
            alpha = AcceptanceEstimate(last_alpha, weight)
            schedule = CostModelSchedule("draft", MAX_K, alpha, costs, config)
        i = 0
        while i < len(agree):
            k = constant if weight is None else schedule.next_k()
            k = min(k, len(agree) - i - 1)
            if k <= 0:
                tokens, cost, i = tokens + 1, cost + 1, i + 1
                continue
            accepted = 0
            while accepted < k and agree[i + accepted]:
                accepted += 1
            tokens += accepted + 1
            cost += step_costs[k]
            i += accepted + 1
            if weight is not None:  # as DraftPolicy.observe
                alpha.update(k, accepted)
                schedule.update(k, accepted)
        if weight is not None:
            last_alpha = alpha.alpha
    return tokens / cost


def oracle(answers: list[list[int]], verify: list[float], c: float) -> float:
    """Tokens per plain-step cost of the best draft lengths there are: each step's length chosen
    knowing how many of the draft's tokens the target will accept (an upper bound for every
    draft-length policy of this drafter on this cost model). Maximises total tokens over total
    cost by Dinkelbach's method (a dynamic program over answer positions per ratio guess)."""
    runs = []  # per answer: agreements in a row from each position
    for agree in answers:
        run = [0] * (len(agree) + 1)
        for i in range(len(agree) - 1, -1, -1):
            run[i] = run[i + 1] + 1 if agree[i] else 0
        runs.append(run)
    rate = 1.0
    for _ in range(50):
        tokens = cost = 0.0
        for run in runs:
            n = len(run) - 1
            best = [(0.0, 0.0, 0.0)] * (n + 1)  # (objective, tokens, cost) from position i on
            for i in range(n - 1, -1, -1):
                options = []
                for k in range(min(MAX_K, n - i - 1) + 1):
                    accepted = min(k, run[i])
                    step = verify[k] + k * c
                    rest = best[i + accepted + 1]
                    options.append((accepted + 1 - rate * step + rest[0], accepted + 1 + rest[1], step + rest[2]))
                best[i] = max(options)
            tokens, cost = tokens + best[0][1], cost + best[0][2]
        if abs(tokens / cost - rate) < 1e-9:
            break
        rate = tokens / cost
    return rate


def simulate(paths: list[str]) -> None:
    for path in paths:
        data = json.loads(Path(path).read_text())
        groups = {"all": [r["agree"] for r in data]}
        for r in data:
            groups.setdefault(r["task"], []).append(r["agree"])
        for name, (curve, c) in COSTS.items():
            verify = verify_ratios(curve)
            print(f"{path}, {name}: verify ratios k = 0..4 {[round(v, 2) for v in verify[:5]]}, draft {c} per token")
            print(
                "  task            "
                + "".join(f"   k={k}" for k in range(1, 5))
                + "".join(f"  w={w:<4}" for w in WEIGHTS)
                + "  oracle"
            )
            for task, answers in groups.items():
                row = [f"{replay(answers, verify, c, None, k):6.3f}" for k in range(1, 5)]
                row += [f"{replay(answers, verify, c, w):7.3f}" for w in WEIGHTS]
                row.append(f"{oracle(answers, verify, c):7.3f}")
                print(f"  {task:15s} " + " ".join(row))


if __name__ == "__main__":
    if len(sys.argv) >= 4 and sys.argv[1] == "dump":
        dump(sys.argv[2], sys.argv[3], *(int(a) for a in sys.argv[4:5]))
    elif len(sys.argv) >= 3 and sys.argv[1] == "simulate":
        simulate(sys.argv[2:])
    else:
        print(__doc__)
        sys.exit(2)
