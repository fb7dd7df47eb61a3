"""``verispec bench-runners``: each runner's cost curve and end-to-end speed, beside llama.cpp.

Owns one benchmark run: for every runner asked (int8, llama.cpp, optionally torch) it measures
the target's and the draft's cost curves (ms per forward of k = 1, 2, 4, 8, 16 tokens after a
64-token context, median of >= 5), then decodes the same prompts greedily with each method
(plain, n-gram, draft model, draft model with a reduced-vocabulary head), and llama-cpp-python's
own plain decoding of the same GGUF file as the peer. Optionally checks that speculative output
equals plain output token for token. Produces a dict (written as JSON) and a table. A benchmark,
not a test: timings on a shared machine are noisy; compare ratios within one run.
"""

from __future__ import annotations

import platform
import sysconfig
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from verispec.engine import SpeculativeConfig, SpeculativeEngine
from verispec.metrics import acceptance_rate, mean_acceptance_length
from verispec.proposers.draft_model import DraftModelProposer
from verispec.proposers.ngram import NgramProposer
from verispec.runners.costs import measure_cost_curve, seed_cost_model
from verispec.runners.notices import kernel_facts
from verispec.runners.weight_cache import default_cache_dir
from verispec.spec.sampling import SamplingParams

BENCH_RUNNERS = ("gguf", "int8", "llamacpp", "torch")
BENCH_METHODS = ("none", "ngram", "draft", "draft-frspec", "tree", "auto")
DEFAULT_PROMPTS_FILE = ""  # empty: humaneval_dev.jsonl in the shared data folder (verispec.ops.bench.workload.data_dir)
CAPACITY = 1024  # KV positions: the longest HumanEval dev prompt + 128 new tokens fit
PREFILL_TEXT = "def f(x):\n    return x * 2 + 1  # a line of code\n"  # repeated to make long prompts


@dataclass
class RunnersBenchConfig:
    """What one ``bench-runners`` run measures.

    Attributes:
        prompts_file: JSONL with a ``prompt`` per line (raw completion prompts); empty: HumanEval
            dev from the shared data folder.
        num_prompts: first N prompts decoded by every method.
        max_tokens: new tokens per prompt at most (greedy, stop at EOS).
        num_speculative_tokens: draft length (constant schedule unless ``schedule`` says otherwise).
        draft_vocab_size: rows of the reduced draft head (FR-Spec), chosen by token counts of
            ``draft_vocab_corpus`` (files or directories of ``*.py``; default: Python's stdlib).
        exactness_prompts: also compare plain vs every speculative method's output, 32 tokens
            each, on this many prompts.
        prefill_tokens: also time one prefill of this many prompt tokens per runner (tokens/s).
        quality_prompts: also score each runner against the float32 model, teacher-forced on its
            greedy output (``max_tokens`` capped at 32) on this many prompts (:mod:`verispec.ops.bench.quality`).
        draft_quantization: the gguf runner's drafts re-quantized as they load (``"iq4_nl"``, what
            ``generate`` and ``serve`` do by default, or ``"q4_0"``) or ``"none"`` (the file's blocks).
    """

    target: str = "qwen2.5-coder-1.5b-instruct"
    draft: str = "qwen2.5-coder-0.5b-instruct"
    runners: tuple[str, ...] = ("gguf", "llamacpp")
    methods: tuple[str, ...] = ("none", "ngram", "draft", "draft-frspec", "tree", "auto")
    prompts_file: str = DEFAULT_PROMPTS_FILE
    num_prompts: int = 10
    max_tokens: int = 128
    num_speculative_tokens: int = 4
    schedule: str = "constant"
    draft_vocab_size: int = 32768
    draft_vocab_corpus: tuple[str, ...] = ()
    repeats: int = 7
    threads: int = 0
    exactness_prompts: int = 0
    peer: bool = True
    prefill_tokens: tuple[int, ...] = ()
    quality_prompts: int = 0
    draft_quantization: str = "iq4_nl"

    def __post_init__(self) -> None:
        from verispec.runners.gguf_runner import REQUANTIZATIONS

        if self.draft_quantization != "none" and self.draft_quantization not in REQUANTIZATIONS:
            from verispec.errors import InvalidParameterError

            raise InvalidParameterError(
                f"draft_quantization must be none or one of {', '.join(REQUANTIZATIONS)}, got {self.draft_quantization!r}"
            )


@dataclass
class MethodResult:
    runner: str
    method: str
    tokens: int = 0
    seconds: float = 0.0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    draft_ms: float = 0.0
    target_ms: float = 0.0
    outputs: list[list[int]] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def to_dict(self) -> dict:
        data = asdict(self)
        data.pop("outputs")
        data["tokens_per_s"] = self.tokens_per_s
        data["acceptance_rate"] = acceptance_rate(self.num_accepted_tokens, self.num_draft_tokens)
        data["mean_acceptance_length"] = mean_acceptance_length(self.num_accepted_tokens, self.num_drafts)
        data["draft_ms_per_token"] = self.draft_ms / self.num_draft_tokens if self.num_draft_tokens else None
        return data


def load_prompts(path: str, limit: int) -> list[str]:
    """The first ``limit`` prompt texts of a workload file (empty path: HumanEval dev), read by
    the bench's workload reader (:func:`verispec.ops.bench.workload.read_jsonl`).

    Raises:
        WorkloadError: a missing file or a bad line (the message names the file and line).
    """
    from verispec.ops.bench.workload import data_dir, read_jsonl

    return [item.text for item in read_jsonl(Path(path) if path else data_dir() / "humaneval_dev.jsonl")[:limit]]


def decode_all(engine: SpeculativeEngine, prompts: list[list[int]], spec: SpeculativeConfig, params: SamplingParams, result: MethodResult) -> MethodResult:
    """Greedy-decode every prompt with ``engine``; wall time per request end to end (prefill included)."""
    for prompt in prompts:
        start = time.perf_counter()
        out = engine.generate(prompt, params, spec)
        result.seconds += time.perf_counter() - start
        result.tokens += len(out.token_ids)
        s = out.metrics.spec
        result.num_drafts += s.num_drafts
        result.num_draft_tokens += s.num_draft_tokens
        result.num_accepted_tokens += s.num_accepted_tokens
        result.draft_ms += out.metrics.draft_ms
        result.target_ms += out.metrics.target_ms
        result.outputs.append(list(out.token_ids))
    return result


def run_runners_bench(config: RunnersBenchConfig, log: Callable[[str], None] = print) -> dict:
    """Run the benchmark; returns the JSON-ready report (see :func:`verispec.ops.bench.runners_table.format_table`).

    All runners stay loaded and the (runner, method) pairs take turns prompt by prompt, in an
    order rotated per prompt, so a load change on a shared machine hits every pair alike.
    """
    from verispec.runners.llamacpp import default_num_threads, load_gguf_info

    if config.threads:
        torch.set_num_threads(config.threads)
    threads = torch.get_num_threads()
    target_info, draft_info = load_gguf_info(config.target), load_gguf_info(config.draft)
    tokenizer = target_info.tokenizer
    eos = tuple(target_info.eos_token_ids)
    texts = load_prompts(config.prompts_file, max(config.num_prompts, config.exactness_prompts, config.quality_prompts))
    prompts = [list(tokenizer.encode(p, add_special_tokens=False)) for p in texts]
    report: dict = {
        "config": asdict(config),
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": threads, "usable_cpus": default_num_threads(), "torch": torch.__version__},
        "prompt_tokens": [len(p) for p in prompts[: config.num_prompts]],
        "curves": {},
        "methods": [],
        "exactness": {},
        "prefill": {},
        "quality": {},
        "notes": "shared machine: timings are noisy; compare ratios within one run",
    }
    built = {}
    for kind in config.runners:
        log(f"[{kind}] loading")
        try:
            start = time.perf_counter()
            built[kind] = _build(kind, config, target_info, draft_info, threads, log)
            log(f"[{kind}] loaded target + drafts in {time.perf_counter() - start:.1f} s")
            report["machine"].update(kernel_facts(kind))  # gguf: the kernels' ISA path and the CPU's features; int8: its product
        except Exception as exc:  # a missing extra or an unsupported model: report and go on
            log(f"[{kind}] skipped: {exc}")
            report["curves"][kind] = {"skipped": str(exc)}
    target_curves = {}
    for kind, (target, drafts) in built.items():
        report["curves"][kind] = {}
        for role, runner in [("target", target)] + [(f"draft:{name}", r) for name, r in drafts.items()]:
            curve = measure_cost_curve(runner, runner_name=kind, model=role, repeats=config.repeats)
            report["curves"][kind][role] = {"ms": curve.ms, "samples": curve.samples}
            log(f"[{kind}] {role} cost ms " + " ".join(f"k={k}:{v:.1f}" for k, v in curve.ms.items()))
            target_curves.setdefault(kind, curve)
    pairs = []
    for kind, (target, drafts) in built.items():
        for method in config.methods:
            engine, spec = _engine(kind, method, target, drafts, tokenizer, eos, config)
            if engine is not None:
                seed_cost_model(engine.cost_model, target_curves[kind])
                pairs.append((engine, spec, MethodResult(kind, method)))
    peer = _peer_runner(config, target_info, tokenizer, eos, threads, log) if config.peer else None
    peer_result = MethodResult("llama-cpp-python", "plain (peer)")
    params = SamplingParams(max_tokens=config.max_tokens)
    for index, prompt in enumerate(prompts[: config.num_prompts]):
        turn = pairs[index % len(pairs):] + pairs[: index % len(pairs)] if pairs else []
        for engine, spec, result in turn:
            decode_all(engine, [prompt], spec, params, result)
        if peer is not None:
            start = time.perf_counter()
            out = peer.generate(prompt, params)
            peer_result.seconds += time.perf_counter() - start
            peer_result.tokens += len(out.token_ids)
            peer_result.outputs.append(list(out.token_ids))
        log(f"prompt {index + 1}/{config.num_prompts} done")
    plain = {r.runner: r.outputs for _, _, r in pairs if r.method == "none"}
    for _, _, result in pairs:
        report["methods"].append(result.to_dict())
        if result.method != "none" and result.runner in plain:
            same = sum(a == b for a, b in zip(result.outputs, plain[result.runner]))
            report["exactness"][f"{result.runner}:{result.method}:{config.max_tokens}"] = f"{same}/{len(result.outputs)}"
        log(f"[{result.runner}] {result.method}: {result.tokens_per_s:.2f} tokens/s ({result.tokens} tokens, {result.seconds:.1f} s)")
    if peer is not None:
        report["methods"].append(peer_result.to_dict())
        if "llamacpp" in plain:
            same = sum(a == b for a, b in zip(peer_result.outputs, plain["llamacpp"]))
            report["exactness"][f"llama-cpp-python:plain vs llamacpp:none:{config.max_tokens}"] = f"{same}/{len(peer_result.outputs)}"
        log(f"[peer] llama-cpp-python plain: {peer_result.tokens_per_s:.2f} tokens/s")
    if config.quality_prompts:
        from verispec.ops.bench.quality import measure_quality
        from verispec.models.loading import load_model

        log("[quality] loading the float32 reference (transformers)")
        reference = load_model(config.target, dtype="float32").model
        targets = {kind: target for kind, (target, _) in built.items()}
        report["quality"] = measure_quality(reference, targets, prompts[: config.quality_prompts], min(32, config.max_tokens), eos, log)
        del reference
    if config.prefill_tokens:
        report["prefill"] = _measure_prefill(built, tokenizer, config, target_info, threads, log)
    if config.exactness_prompts:
        for kind, (target, drafts) in built.items():
            report["exactness"].update(_check_exactness(kind, target, drafts, tokenizer, eos, prompts[: config.exactness_prompts], config, log))
    return report


def _build(kind: str, config: RunnersBenchConfig, target_info, draft_info, threads: int, log) -> tuple:
    """The target runner and the draft runners (``draft``, ``tree`` (own cache) and ``draft-frspec``
    for the batch-invariant runners)."""
    if kind == "gguf":
        from verispec.runners.gguf_runner import GGUFRunner

        from verispec.runners.gguf_runner import GGUFWeights

        def load(info, **options):  # RoPE tables for 4096 positions: the prefill lengths fit
            weights = GGUFWeights.from_file(info.path, 4096, cache_dir=default_cache_dir(), **options)
            return GGUFRunner(weights, max_context_length=CAPACITY)

        requantize = None if config.draft_quantization == "none" else config.draft_quantization
        target, draft = load(target_info), load(draft_info, requantize=requantize)
        drafts = {"draft": draft, "tree": GGUFRunner(draft.weights, max_context_length=CAPACITY)}
        if "draft-frspec" in config.methods:
            drafts["draft-frspec"] = load(draft_info, head_token_ids=_frspec_rows(config, draft_info, log, kind), requantize=requantize)
        return target, drafts
    if kind == "llamacpp":
        from verispec.runners.llamacpp import LlamaCppRunner

        target = LlamaCppRunner(target_info.path, max_context_length=CAPACITY, num_threads=threads)
        return target, {"draft": LlamaCppRunner(draft_info.path, max_context_length=CAPACITY, num_threads=threads)}
    if kind == "int8":
        from verispec.runners.int8_gguf import int8_weights_from_gguf
        from verispec.runners.int8 import Int8Runner

        def load(info, **options):  # straight from the GGUF blocks, seconds
            weights = int8_weights_from_gguf(info.path, 4096, cache_dir=default_cache_dir(), **options)
            return Int8Runner(weights, max_context_length=CAPACITY)

        target, draft = load(target_info), load(draft_info)
        drafts = {"draft": draft, "tree": Int8Runner(draft.weights, max_context_length=CAPACITY)}
        if "draft-frspec" in config.methods:
            drafts["draft-frspec"] = load(draft_info, head_token_ids=_frspec_rows(config, draft_info, log, kind))
        return target, drafts
    if kind == "torch":
        from verispec.models.loading import load_model
        from verispec.runners.torch_runner import TransformersRunner

        target = TransformersRunner(load_model(config.target, dtype="bfloat16").model, max_context_length=CAPACITY)
        return target, {"draft": TransformersRunner(load_model(config.draft, dtype="bfloat16").model, max_context_length=CAPACITY)}
    raise ValueError(f"unknown runner {kind!r}")


def _frspec_rows(config: RunnersBenchConfig, draft_info, log, kind: str):
    """``[kept]`` token ids of the reduced draft head, counted over Python files (FR-Spec)."""
    from verispec.runners.reduced_vocab import corpus_counts, coverage, select_vocabulary

    corpus = config.draft_vocab_corpus or (sysconfig.get_paths()["stdlib"],)
    counts = corpus_counts(draft_info.tokenizer, _python_files(corpus), draft_info.vocab_size, max_bytes=4_000_000)
    kept = select_vocabulary(counts, config.draft_vocab_size, [t for t in draft_info.eos_token_ids])
    log(f"[{kind}] reduced draft head: {len(kept)} tokens, corpus coverage {coverage(counts, kept):.4f}")
    return kept


def _measure_prefill(built: dict, tokenizer, config: RunnersBenchConfig, target_info, threads: int, log) -> dict:
    """Prefill tokens/s of each target runner (and the llama.cpp peer) for prompts of each length."""
    found: dict = {}
    text_ids = list(tokenizer.encode(PREFILL_TEXT, add_special_tokens=False))
    for length in config.prefill_tokens:
        prompt = (text_ids * (length // len(text_ids) + 1))[:length]
        runners = {kind: target for kind, (target, _) in built.items()}
        if config.peer and "llamacpp" not in runners:
            try:
                from verispec.runners.llamacpp import LlamaCppRunner

                runners["llamacpp"] = LlamaCppRunner(target_info.path, max_context_length=length + 8, num_threads=threads)
            except Exception as exc:  # llama-cpp-python missing
                log(f"[prefill] no llama.cpp peer: {exc}")
        for kind, runner in runners.items():
            if runner.max_context_length < length:
                runner = _with_capacity(kind, runner, target_info, length + 8, threads)
            runner.truncate(0)
            start = time.perf_counter()
            runner.forward(prompt, num_logits=1)
            seconds = time.perf_counter() - start
            runner.truncate(0)
            found.setdefault(kind, {})[length] = {"seconds": seconds, "tokens_per_s": length / seconds}
            log(f"[{kind}] prefill {length} tokens: {seconds:.2f} s ({length / seconds:.1f} tokens/s)")
    return found


def _with_capacity(kind: str, runner, target_info, capacity: int, threads: int):
    """The same model with a KV cache of ``capacity`` positions (weights shared where possible)."""
    if kind == "llamacpp":
        from verispec.runners.llamacpp import LlamaCppRunner

        return LlamaCppRunner(target_info.path, max_context_length=capacity, num_threads=threads)
    if hasattr(runner, "weights"):
        return type(runner)(runner.weights, max_context_length=min(capacity, runner.weights.cos.shape[0]))
    return runner


def _python_files(paths) -> list[Path]:
    files: list[Path] = []
    for entry in paths:
        entry = Path(entry)
        files.extend(sorted(entry.rglob("*.py")) if entry.is_dir() else [entry])
    return files


def _engine(kind, method, target, drafts, tokenizer, eos, config):
    """The engine and request config for one method; (None, None) when the runner lacks it."""
    from verispec.proposers.draft_tree import DraftTreeProposer

    draft_key = "draft-frspec" if method == "draft-frspec" else "draft"
    proposers = {"ngram": NgramProposer()}
    if method in ("draft", "draft-frspec", "auto"):
        if draft_key not in drafts:
            return None, None
        proposers["draft"] = DraftModelProposer(drafts[draft_key])
    if method in ("tree", "auto") and "tree" in drafts and hasattr(target, "forward_tree"):
        proposers["tree"] = DraftTreeProposer(drafts["tree"])
    elif method == "tree":
        return None, None
    engine_method = {"draft-frspec": "draft"}.get(method, method)
    spec = SpeculativeConfig(method=engine_method, num_speculative_tokens=config.num_speculative_tokens, schedule=config.schedule)
    return SpeculativeEngine(target, tokenizer, eos_token_ids=eos, proposers=proposers), spec


def _check_exactness(kind, target, drafts, tokenizer, eos, prompts, config, log) -> dict:
    """Plain vs speculative greedy output, 32 tokens per prompt: how many prompts agree."""
    params = SamplingParams(max_tokens=32)
    plain_engine, plain_spec = _engine(kind, "none", target, drafts, tokenizer, eos, config)
    plain = [plain_engine.generate(p, params, plain_spec).token_ids for p in prompts]
    found = {}
    for method in [m for m in config.methods if m != "none"]:
        engine, spec = _engine(kind, method, target, drafts, tokenizer, eos, config)
        if engine is None:
            continue
        outputs = [engine.generate(p, params, spec).token_ids for p in prompts]
        same = sum(a == b for a, b in zip(outputs, plain))
        found[f"{kind}:{method}:32"] = f"{same}/{len(prompts)}"
        log(f"[{kind}] exactness {method}: {same}/{len(prompts)} prompts identical to plain (32 tokens)")
    return found


def _peer_runner(config, target_info, tokenizer, eos, threads, log):
    """llama-cpp-python's own plain decoding of the target GGUF (None when not installed)."""
    try:
        from verispec.ops.bench.peers import LlamaCppPeer

        return LlamaCppPeer(str(target_info.path), tokenizer, eos, threads, context_length=CAPACITY)
    except ImportError as exc:
        log(f"[peer] llama-cpp-python missing: {exc}")
        return None
