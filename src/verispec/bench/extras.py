"""What ``verispec bench`` can measure besides the decoding runs: prefill speed and quality.

Owns two optional measurements over the pipelines of one run, taken after the decoding runs:
the time of one prefill of N prompt tokens on each target runner (``--prefill-tokens``; with
llama.cpp's own prefill beside when it is a peer), and each target runner's agreement with the
float32 model, teacher-forced on that model's greedy output (``--quality-prompts``,
:mod:`verispec.bench.quality`). Both go into results.json (``prefill``, ``quality``). A
benchmark, not a test: compare figures of one run.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

from verispec.engine.loader import SpeculativePipeline

PREFILL_TEXT = "def f(x):\n    return x * 2 + 1  # a line of code\n"  # repeated to the asked length
QUALITY_TOKENS = 32  # continuation tokens scored per prompt


def prefill_prompt(pipe: SpeculativePipeline, length: int) -> list[int]:
    """``length`` token ids of :data:`PREFILL_TEXT` repeated (the same for every runner)."""
    ids = list(pipe.tokenizer.encode(PREFILL_TEXT, add_special_tokens=False))
    return (ids * (length // len(ids) + 1))[:length]


def time_prefill(runner, prompt: Sequence[int]) -> dict:
    """One prefill of ``prompt`` from an empty cache: ``{"seconds", "tokens_per_s"}`` (the cache
    is emptied again after)."""
    runner.truncate(0)
    start = time.perf_counter()
    runner.forward(list(prompt), num_logits=1)
    seconds = time.perf_counter() - start
    runner.truncate(0)
    return {"seconds": seconds, "tokens_per_s": len(prompt) / seconds}


def measure_prefill(
    pipes: Mapping[str, SpeculativePipeline],
    lengths: Sequence[int],
    *,
    llama_cpp: bool,
    threads: int | None,
    log: Callable[[str], None],
) -> dict:
    """``{runner: {length: {"seconds", "tokens_per_s"}}}``: one prefill of each length on each
    pipeline's target runner, and on llama.cpp's (``llama_cpp``: a peer of the run) when
    llama-cpp-python is installed. A length over a runner's context is left out, said why."""
    first = next(iter(pipes.values()))
    runners = {kind: pipe.target_runner for kind, pipe in pipes.items()}
    found: dict = {}
    for length in lengths:
        prompt = prefill_prompt(first, length)
        contenders = dict(runners)
        if llama_cpp and "llamacpp" not in contenders and first.target.path is not None:
            try:
                from verispec.runners.llamacpp import LlamaCppRunner

                contenders["llama.cpp"] = LlamaCppRunner(
                    first.target.path, max_context_length=length + 8, num_threads=threads
                )
            except Exception as exc:  # llama-cpp-python missing, or a file it cannot read
                log(f"prefill: no llama.cpp beside ({exc})")
        for name, runner in contenders.items():
            if runner.max_context_length < length + 1:
                log(f"prefill {length} tokens: {name} skipped (its context holds {runner.max_context_length})")
                continue
            found.setdefault(name, {})[length] = entry = time_prefill(runner, prompt)
            log(f"prefill {length} tokens: {name} {entry['seconds']:.2f} s ({entry['tokens_per_s']:.1f} tokens/s)")
    return found


def measure_quality_of(
    pipes: Mapping[str, SpeculativePipeline], prompts: Sequence[Sequence[int]], target: str, log: Callable[[str], None]
) -> dict:
    """``{runner: {"positions", "top1_agreement", "mean_kl_nats"}}`` of each pipeline's target
    runner against the float32 model of ``target`` (loaded here with transformers), teacher-forced
    on its greedy continuations of ``prompts`` (:data:`QUALITY_TOKENS` tokens each).

    Raises:
        ModelNotFoundError, ModelFetchError: ``target`` cannot be loaded as a float32 model.
    """
    from verispec.bench.quality import measure_quality
    from verispec.models.loading import load_model

    log("quality: loading the float32 reference (transformers)")
    reference = load_model(target, dtype="float32")
    runners = {kind: pipe.target_runner for kind, pipe in pipes.items()}
    eos = tuple(next(iter(pipes.values())).target.eos_token_ids)
    return measure_quality(reference.model, runners, prompts, QUALITY_TOKENS, eos, log)
