"""Positions per second of ``train-head``'s optimiser step in f32 and bf16, and a profile of one
step each, on a synthetic batch of the default head's shape (Qwen2.5-Coder-1.5B target: hidden
1536, 3 fused layers, 32,000 draft rows, MLP 2048, its own LM head, 3 unrolled steps).

Every precision trains the same head from the same initialisation on the same batches (random
features, tokens and teacher states: the cost of a step does not depend on the values).
``autocast`` is the f32 step under plain ``torch.autocast("cpu", torch.bfloat16)`` (the issue's
first try), for comparison. Prints the CPU flags and torch's view of them first.

Usage (from the repo root, alone on the machine):
``../shared/tools/alone .venv/bin/python scripts/train_step_bench.py [--precisions f32,bf16]
[--positions 512] [--steps 4] [--adamw fused] [--profile]``
"""

import argparse
import contextlib
import statistics
import time
from dataclasses import replace

import torch
from torch import nn
from transformers import Qwen2Config

from verispec.runners.eagle.head import EagleHead, HeadShape
from verispec.training.loop import Batch, TrainOptions
from verispec.training.precision import NATIVE_BF16_FLAGS, cpu_flags, native_bf16
from verispec.training.step import TrainStep, make_optimizer


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--precisions", default="f32,bf16", help="comma list of f32, bf16, autocast")
    p.add_argument("--positions", default="512", help="anchors per step (comma list)")
    p.add_argument(
        "--steps", type=int, default=5, help="timed steps per precision (their median; after a warm-up step)"
    )
    p.add_argument("--adamw", default="fused", help="comma list of fused, foreach, loop")
    p.add_argument("--draft-vocab", type=int, default=32_000)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--shared-lm-head", action="store_true", help="the target's LM head, frozen (CLI default)")
    p.add_argument("--profile", action="store_true", help="torch.profiler table of one step each")
    p.add_argument("--rows", type=int, default=14, help="rows of each profile table")
    return p.parse_args()


def make_head(args) -> EagleHead:
    config = Qwen2Config(  # Qwen2.5-Coder-1.5B's dimensions
        vocab_size=151_936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        rope_theta=1e6,
    )
    shape = HeadShape.of_target(config, (2, 14, 25), args.draft_vocab)
    shape = replace(shape, intermediate_size=args.intermediate, lm_head_from_target=args.shared_lm_head)
    embedding = nn.Embedding(config.vocab_size, config.hidden_size)
    embedding.weight.requires_grad_(False)
    d2t = torch.randperm(config.vocab_size, generator=torch.Generator().manual_seed(0))[: args.draft_vocab]
    return EagleHead(shape, embedding, d2t.sort().values, seed=0)


def make_batch(head: EagleHead, positions: int, ttt_steps: int, seed: int, window: int = 512) -> Batch:
    g = torch.Generator().manual_seed(seed)
    hidden, layers = head.shape.hidden_size, len(head.shape.feature_layers)
    anchor = torch.arange(positions) % window
    valid = torch.stack([(anchor + j + 1) < window for j in range(ttt_steps)])
    return Batch(
        features=torch.randn(positions, layers * hidden, generator=g),
        positions=anchor,
        segments=torch.arange(positions) // window,
        token_ids=torch.randint(0, head.shape.vocab_size, (ttt_steps, positions), generator=g),
        target_argmax=torch.randint(0, head.shape.vocab_size, (ttt_steps, positions), generator=g),
        teacher_hidden=3 * torch.randn(ttt_steps, positions, hidden, generator=g),
        valid=valid,
    )


def measure(step: TrainStep, batches: list[Batch], precision: str, args) -> tuple[float, list[float], list[float]]:
    """Median seconds of ``args.steps`` steps after a warm-up one, every step's seconds and
    loss; the profile of one more step printed with ``args.profile``."""
    autocast = torch.autocast("cpu", torch.bfloat16) if precision == "autocast" else contextlib.nullcontext()

    def run(batch: Batch) -> float:  # autocast around each step: its cache of cast weights ends with the step
        with autocast:
            return float(step(batch)[0])

    losses, seconds = [run(batches[0])], []  # warm-up: oneDNN primitives, the allocator
    for i in range(args.steps):
        start = time.perf_counter()
        losses.append(run(batches[i % 2]))
        seconds.append(time.perf_counter() - start)
    if args.profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            run(batches[0])
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows)
        print(f"profile of one {precision} step:\n{table}")
    return statistics.median(seconds), seconds, losses


def main() -> None:
    args = parse()
    flags = cpu_flags()
    threads, capability = torch.get_num_threads(), torch.backends.cpu.get_cpu_capability()
    print(f"torch {torch.__version__}, {threads} threads, capability {capability}")
    seen = sorted(f for f in flags if f.startswith(("amx", "avx512_bf16", "avx512f", "avx512_vnni")))
    print(f"CPU flags (/proc/cpuinfo): {' '.join(seen) or 'none of amx*, avx512*'}")
    torch_view = {name: getattr(torch.cpu, name)() for name in dir(torch.cpu) if name.startswith("_is_")}
    print(f"torch.cpu: {torch_view}")
    print(f"native bf16: {native_bf16()} (from {', '.join(NATIVE_BF16_FLAGS)})")
    target_weight = torch.randn(args.draft_vocab, 1536, generator=torch.Generator().manual_seed(1)) * 0.05
    rows = []
    for positions in [int(x) for x in args.positions.split(",")]:
        batches = [make_batch(make_head(args), positions, 3, seed) for seed in range(2)]
        for adamw in args.adamw.split(","):
            for precision in args.precisions.split(","):
                head = make_head(args)
                options = TrainOptions(precision="f32" if precision == "autocast" else precision)
                optimizer = make_optimizer(head, options, implementation=adamw)
                step = TrainStep(head, optimizer, (target_weight, None), options)
                median, seconds, losses = measure(step, batches, precision, args)
                rows.append((positions, adamw, precision, positions / median))
                print(
                    f"{precision:>8} adamw {adamw:<7} {positions:5d} positions: {positions / median:7.1f} positions/s "
                    f"(median step {median:.3f} s of {' '.join(f'{x:.3f}' for x in seconds)}); "
                    f"losses {' '.join(f'{x:.4f}' for x in losses)}",
                    flush=True,
                )
    base = {(p, a): r for p, a, prec, r in rows if prec == "f32"}
    for p, a, prec, r in rows:
        if prec != "f32" and (p, a) in base:
            print(f"{prec} / f32 at {p} positions, adamw {a}: {r / base[(p, a)]:.2f}x")


if __name__ == "__main__":
    main()
