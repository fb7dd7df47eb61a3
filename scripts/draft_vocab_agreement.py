"""How much of a draft's agreement with the target a reduced draft LM head (FR-Spec) keeps.

Teacher-forced, no timing: for every answer position of the target's greedy answers in a
``verispec bench`` record (its ``gguf:none`` rows), the draft's argmax over the full vocabulary
and over kept subsets (the lowest ids, the default ``--draft-vocab`` choice; the ids most frequent
in the Python standard library's top-level modules; no EOS ids added, as ``--draft-vocab`` adds
them) against the target's token. The draft sees the whole prompt (the engine shows it the last
64 tokens by default: ``scripts/draft_length_sim.py dump`` measures that case). Usage (from the
repo root): ``../shared/tools/alone .venv/bin/python scripts/draft_vocab_agreement.py
RESULTS.json [WORKLOAD]`` (WORKLOAD: the bench's workload, default humaneval).
"""

import json
import sys
import sysconfig
from pathlib import Path

import torch

from verispec.bench.workload import load_workload
from verispec.engine.loader import SpeculativePipeline
from verispec.runners.cpu.reduced_vocab import corpus_counts, rank_counts, select_vocabulary
from verispec.runners.select import RunnerOptions


def main(results_path: str, workload: str = "humaneval") -> None:
    data = json.loads(Path(results_path).read_text())
    config = data["config"]
    records = [r for r in data["records"] if r["runner"] == "gguf:none"]
    items = {item.id: item for item in load_workload(workload, None, None, len(records))}
    pipe = SpeculativePipeline.load(config["target"], config["draft"], runners=RunnerOptions(kind="gguf"))
    vocab = pipe.draft_runner.vocab_size
    modules = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    stdlib = corpus_counts(pipe.tokenizer, modules, vocab, max_bytes=8_000_000)
    subsets = {f"lowest {n}": select_vocabulary(rank_counts(vocab), n) for n in (32000, 64000)}
    subsets.update({f"stdlib {n}": select_vocabulary(stdlib, n) for n in (16000, 32000, 48000)})
    agree = dict.fromkeys(["full", *subsets], 0)
    total = 0
    for record in records:
        item = items[record["prompt_id"]]
        prompt = pipe.encode(item.text, chat=item.chat)
        answer = torch.tensor(record["token_ids"])
        pipe.draft_runner.truncate(0)
        logits = pipe.draft_runner.forward(prompt + record["token_ids"])[
            len(prompt) - 1 : -1
        ]  # predicts each answer token
        total += len(answer)
        agree["full"] += int((logits.argmax(-1) == answer).sum())
        for name, kept in subsets.items():
            agree[name] += int((kept[logits[:, kept].argmax(-1)] == answer).sum())
    print(f"answer positions: {total}")
    for name, count in agree.items():
        print(f"{name:14s} draft argmax == target token: {count}/{total} = {count / total:.4f}")


if __name__ == "__main__":
    main(*sys.argv[1:])
