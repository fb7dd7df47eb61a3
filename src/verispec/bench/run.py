"""The interleaved benchmark runner: every runner on prompt 1, then every runner on prompt 2, ...

Owns the benchmark settings, the list of runners (verispec methods and peers) and the order of
runs (rotated per prompt, so neither machine drift nor cache warmth favours one runner); what each
run records, and the greedy exactness marks, are :mod:`verispec.bench.records`'. Knows nothing
about figures or file formats (see ``figures``, ``results`` and ``report``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from verispec.algorithms.sampling import SamplingParams
from verispec.bench.audit import QualityAuditor
from verispec.bench.peers import PEER_FAMILIES, TRANSFORMERS_METHODS, LlamaCppPeer, TransformersPeer
from verispec.bench.records import Participant, ParticipantInfo, RunRecord, mark_exactness
from verispec.bench.workload import WorkloadItem
from verispec.engine import METHODS, GenerationOutput, SpeculativeConfig, SpeculativeEngine
from verispec.engine.loader import SpeculativePipeline
from verispec.engine.methods import MISSING_DRAFTER_HINTS
from verispec.errors import InvalidParameterError
from verispec.runners.choice import kernel_facts

WARMUP_TOKENS = 4


@dataclass(frozen=True)
class BenchConfig:
    """What to run. ``methods``: verispec methods (``none`` is added); ``peers``: families from
    :data:`PEER_FAMILIES`; ``chat``: None = per prompt (``turns`` lines use the chat template),
    True/False forces it; ``threads``: torch (and llama.cpp) threads, None = torch's current.

    Raises:
        InvalidParameterError: an unknown method or peer, or an out-of-range number.
    """

    methods: tuple[str, ...] = ("none", "draft")
    peers: tuple[str, ...] = PEER_FAMILIES
    num_speculative_tokens: int = 5
    schedule: str = "cost"
    max_tokens: int = 128
    temperature: float = 0.0
    seed: int = 0
    sampling: str = "coupled"
    threads: int | None = None
    warmup: bool = True
    chat: bool | None = None
    audit_rate: float = 0.0

    def __post_init__(self) -> None:
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown:
            raise InvalidParameterError(f"unknown method {', '.join(unknown)}; choose from {', '.join(METHODS)}")
        object.__setattr__(
            self, "methods", tuple(dict.fromkeys(("none",) + tuple(self.methods)))
        )  # none first, no repeats
        bad_peers = [p for p in self.peers if p not in PEER_FAMILIES]
        if bad_peers:
            raise InvalidParameterError(
                f"unknown peer {', '.join(bad_peers)}; choose from {', '.join(PEER_FAMILIES)} or none"
            )
        if self.threads is not None and self.threads < 1:
            raise InvalidParameterError(f"threads must be >= 1, got {self.threads}")
        SpeculativeConfig(
            num_speculative_tokens=self.num_speculative_tokens, schedule=self.schedule
        )  # validates k and schedule
        SamplingParams(temperature=self.temperature, max_tokens=self.max_tokens, sampling=self.sampling)  # validates
        if not 0.0 <= self.audit_rate <= 1.0:
            raise InvalidParameterError(f"audit rate must be in [0, 1], got {self.audit_rate}")

    def params(self, prompt_index: int) -> SamplingParams:
        """Sampling parameters of one prompt: the same for every runner (seed + index when sampling)."""
        seed = self.seed + prompt_index if self.temperature > 0 else None
        return SamplingParams(
            temperature=self.temperature, max_tokens=self.max_tokens, seed=seed, sampling=self.sampling
        )


@dataclass(frozen=True)
class BenchStep:
    """What :func:`run_bench` is doing, for a progress display: ``runner`` (a participant's name)
    on prompt ``prompt`` of ``num_prompts`` (1-based; 0 with ``item`` None: its untimed
    warm-up); ``output`` None when the run starts, its output once it ended."""

    prompt: int
    num_prompts: int
    item: WorkloadItem | None
    runner: str
    output: GenerationOutput | None = None


class VerispecParticipant:
    """verispec's engine with one method (``none`` = plain decoding) on one runner kind; named
    ``"<kind>:<method>"`` (``int8:draft``), its family is the kind. ``settings`` name the kernels
    it runs (gguf: ``kernel_isa``; int8: ``int8_kernel``)."""

    def __init__(
        self,
        engine: SpeculativeEngine,
        method: str,
        num_speculative_tokens: int,
        kind: str = "verispec",
        schedule: str = "cost",
    ) -> None:
        self.engine, self.method, self.family, self.name = engine, method, kind, f"{kind}:{method}"
        self.spec = SpeculativeConfig(method=method, num_speculative_tokens=num_speculative_tokens, schedule=schedule)
        self.settings = (
            {} if method == "none" else {"num_speculative_tokens": num_speculative_tokens, "schedule": schedule}
        )
        self.settings |= {key: value for key, value in kernel_facts(kind).items() if key != "cpu_features"}

    def generate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> GenerationOutput:
        return self.engine.generate(prompt_token_ids, params, self.spec)


def build_participants(
    pipes: Mapping[str, SpeculativePipeline], config: BenchConfig
) -> tuple[list[Participant], list[ParticipantInfo]]:
    """The participants ``config`` asks for over each pipeline of ``pipes`` (``{runner kind: pipeline}``,
    the first is the reference), then the peers, and a description of each (skipped ones too).
    The transformers peers run on the pipeline that holds a torch model; llama.cpp on the
    first pipeline's target file.

    Raises:
        InvalidParameterError: a method whose drafter a pipeline did not load.
    """
    runners: list[Participant] = []
    for kind, pipe in pipes.items():
        loaded = set(pipe.engine.proposers)
        missing = [m for m in config.methods if m not in ("none", "auto") and m not in loaded]
        if missing:
            hints = dict.fromkeys(MISSING_DRAFTER_HINTS[m] for m in missing if m in MISSING_DRAFTER_HINTS)
            raise InvalidParameterError(
                f"method {', '.join(missing)} needs a drafter the {kind} runner did not load (loaded: "
                f"{', '.join(sorted(loaded))})" + "".join(f"; {hint}" for hint in hints)
            )
        # each method its own suffix cache: it learns from its own earlier answers, never from
        # another method's answer to the same prompt (the methods take turns on every prompt)
        runners += [
            VerispecParticipant(_cold(pipe), m, config.num_speculative_tokens, kind, config.schedule)
            for m in config.methods
        ]
    infos = [ParticipantInfo(r.name, r.family, r.method, settings=r.settings) for r in runners]
    first = next(iter(pipes.values()))
    if "transformers" in config.peers:
        torch_pipe = next((p for p in pipes.values() if p.target.model is not None), None)
        for method in TRANSFORMERS_METHODS:
            if torch_pipe is None:
                which = (
                    f"the {next(iter(pipes))} runner holds no torch model"
                    if len(pipes) == 1
                    else f"none of the {', '.join(pipes)} runners holds a torch model"
                )
                infos.append(
                    ParticipantInfo(
                        f"transformers:{method}", "transformers", method, f"skipped: {which} (add torch to --runner)"
                    )
                )
                continue
            if method == "assisted" and torch_pipe.draft is None:
                infos.append(
                    ParticipantInfo(f"transformers:{method}", "transformers", method, "skipped: no draft model loaded")
                )
                continue
            draft_model = torch_pipe.draft.model if torch_pipe.draft is not None else None
            peer = TransformersPeer(
                method,
                torch_pipe.target.model,
                torch_pipe.tokenizer,
                torch_pipe.target.eos_token_ids,
                draft_model,
                config.num_speculative_tokens,
            )
            runners.append(peer)
            infos.append(ParticipantInfo(peer.name, peer.family, method, settings=peer.settings))
    if "llama.cpp" in config.peers:
        runner, info = _llama_cpp(first, config)
        infos.append(info)
        if runner is not None:
            runners.append(runner)
    return runners, infos


def _cold(pipe: SpeculativePipeline) -> SpeculativeEngine:
    """A participant's engine: its own suffix cache, and no prefix cache (the methods take turns
    on each prompt: a later one would read the earlier one's prompt; single prompts are measured
    cold, as a first request is; the session workloads measure the cache, :mod:`verispec.bench.sessions`)."""
    engine = pipe.engine_with_own_suffix_cache()
    engine.prefix_cache = None
    return engine


def _llama_cpp(pipe: SpeculativePipeline, config: BenchConfig) -> tuple[LlamaCppPeer | None, ParticipantInfo]:
    info = ParticipantInfo("llama.cpp:plain", "llama.cpp", "plain")
    path = pipe.target.path
    if path is None or Path(path).suffix != ".gguf":
        info.status = "skipped: the target is not a GGUF file"
        return None, info
    try:
        peer = LlamaCppPeer(
            str(path), pipe.tokenizer, pipe.target.eos_token_ids, config.threads or torch.get_num_threads()
        )
    except ImportError:
        info.status = "not installed"
        return None, info
    info.settings, info.load_time_s = peer.settings, peer.load_time_s
    return peer, info


def encode(pipe: SpeculativePipeline, item: WorkloadItem, chat: bool | None) -> list[int]:
    """Token ids of one prompt: the chat template for ``turns`` items unless ``chat`` forces it."""
    return pipe.encode(item.text, chat=item.chat if chat is None else chat)


def run_bench(
    pipes: SpeculativePipeline | Mapping[str, SpeculativePipeline],
    items: Sequence[WorkloadItem],
    config: BenchConfig,
    on_run: Callable[[BenchStep], None] | None = None,
) -> tuple[list[RunRecord], list[ParticipantInfo], QualityAuditor]:
    """Run every runner on every item, interleaved prompt by prompt; returns the records (prompt
    order, then runner order), the runner descriptions and the auditor with its counts.

    ``pipes``: one pipeline, or ``{runner kind: pipeline}`` to compare several runners in one
    run (the same model files; prompts are encoded with the first one's tokenizer).
    ``on_run(step)`` is called before each warm-up and before and after each timed run (a
    :class:`BenchStep`: the progress display of :mod:`verispec.bench.live`). Threads are set to
    ``config.threads`` for the whole run. The audit (``config.audit_rate``) compares selected
    speculative records with the plain record of the same runner and prompt, after the prompt's
    timed runs.
    """
    pipes = as_pipelines(pipes)
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    runners, infos = build_participants(pipes, config)
    auditor = QualityAuditor(config.audit_rate, seed=config.seed)
    first = next(iter(pipes.values()))
    prompts = [encode(first, item, config.chat) for item in items]
    if config.warmup and prompts:
        warm = SamplingParams(max_tokens=min(WARMUP_TOKENS, config.max_tokens))
        for runner in runners:
            if on_run:
                on_run(BenchStep(0, len(items), None, runner.name))
            if isinstance(runner, VerispecParticipant):  # its suffix cache keeps nothing of a warm-up
                runner.engine.generate(prompts[0], warm, runner.spec, learn=False)
            else:
                runner.generate(prompts[0], warm)
    records: list[RunRecord] = []
    for index, (item, prompt) in enumerate(zip(items, prompts)):
        params = config.params(index)
        shift = index % len(runners)
        outputs: dict[str, GenerationOutput] = {}
        for runner in runners[shift:] + runners[:shift]:
            if on_run:
                on_run(BenchStep(index + 1, len(items), item, runner.name))
            outputs[runner.name] = runner.generate(prompt, params)
            if on_run:
                on_run(BenchStep(index + 1, len(items), item, runner.name, outputs[runner.name]))
        batch = [RunRecord.of(item, runner, outputs[runner.name]) for runner in runners]
        if params.is_greedy or params.sampling == "coupled":  # coupled: a seed fixes the text under every method
            mark_exactness(batch, across_runners=params.is_greedy)
        for kind, pipe in pipes.items():
            _audit(auditor, pipe.engine, prompt, params, outputs, item.id, kind)
        records.extend(batch)
    return records, infos, auditor


def as_pipelines(pipes: SpeculativePipeline | Mapping[str, SpeculativePipeline]) -> dict[str, SpeculativePipeline]:
    """``{runner kind: pipeline}`` from one pipeline (keyed by its runner kind) or a mapping."""
    if isinstance(pipes, SpeculativePipeline):
        return {pipes.runner_kind: pipes}
    if not pipes:
        raise InvalidParameterError("no runner to benchmark")
    return dict(pipes)


def _audit(
    auditor: QualityAuditor, engine, prompt, params, outputs: dict[str, GenerationOutput], request_id: str, kind: str
) -> None:
    plain = outputs.get(f"{kind}:none")
    for name, output in outputs.items():
        if name.startswith(f"{kind}:") and name != f"{kind}:none" and auditor.select():
            auditor.audit(engine, prompt, params, output, plain=plain, request_id=f"{request_id} {name}")
