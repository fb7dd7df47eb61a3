"""Loading a target (and optionally a draft) into a ready-to-use engine: the library entry point.

Owns: the wiring of model store -> runners -> drafters -> engine (draft model, optionally int8;
n-gram lookup; layer skip over the target), the compatibility check of the pair, prompt
encoding (chat template or raw) and the description of the loaded models (load time, memory).
Knows nothing about the decoding algorithm itself.

Example::

    pipe = SpeculativePipeline.load()                    # built-in Qwen2.5-Coder 1.5B + 0.5B
    out = pipe.generate("def fibonacci(n):", SamplingParams(max_tokens=64))
    print(out.text, out.metrics.spec.acceptance_rate)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from verispec.algorithms.control import ControllerConfig
from verispec.algorithms.sampling import SamplingParams
from verispec.engine.loop import DEFAULT_MAX_NUM_BATCHED_TOKENS, SpeculativeEngine
from verispec.engine.prefix_cache import BLOCK_SIZE, DEFAULT_PREFIX_CACHE_GIB, PrefixCache
from verispec.engine.prompts import PromptCheck, PromptMethods, check_prompt_first, check_window
from verispec.engine.request import GenerationOutput, SpeculativeConfig, StreamChunk
from verispec.errors import InvalidParameterError
from verispec.models.compat import check_draft_compatibility
from verispec.models.loading import (
    DTYPES,
    LoadedModel,
    TokenizerInfo,
    load_gguf_info,
    load_model,
    load_tokenizer_info,
)
from verispec.models.preflight import check_before_loading
from verispec.progress import announce_slow
from verispec.proposers.factory import DRAFT_QUANTIZATIONS, DrafterOptions, build_drafters, with_own_suffix_cache
from verispec.proposers.suffix import SuffixCache
from verispec.runners import kv_cache_bytes
from verispec.runners.choice import Choice, Host, ModelFiles, choose_runner
from verispec.runners.costs import seed_cost_model
from verispec.runners.cpu.quantize import quantize_linear_layers
from verispec.runners.select import RunnerOptions, build_runners

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"


@dataclass
class ModelSummary:
    """What a user needs to know about one loaded model. Bytes and seconds."""

    role: str
    name: str
    path: str | None
    load_time_s: float
    param_bytes: int
    vocab_size: int
    context_length: int

    @classmethod
    def of(cls, role: str, loaded: LoadedModel) -> ModelSummary:
        return cls(
            role=role,
            name=loaded.name,
            path=str(loaded.path) if loaded.path else None,
            load_time_s=loaded.load_time_s,
            param_bytes=loaded.param_bytes,
            vocab_size=loaded.vocab_size,
            context_length=loaded.context_length,
        )


class SpeculativePipeline(PromptMethods):
    """A target, an optional draft, their tokenizer and the engine over them.

    Use :meth:`load`; the constructor takes already loaded models (tests, custom setups). With
    ``drafters.draft_quantization="int8"`` the constructor quantizes ``draft.model`` in place.
    Drafters: ``draft`` (if a draft is given), ``ngram`` and ``layer-skip`` (unless disabled).

    ``prefix_cache_gib``: memory for automatic prefix caching across requests
    (:class:`verispec.engine.prefix_cache.PrefixCache`; the target's and the draft's KV entries of
    earlier prompts and answers, reused bit for bit); 0 turns it off. On a runner whose entries
    depend on how a prompt is split into passes (torch, llama.cpp) there is no prefix cache:
    :attr:`prefix_cache_note` says why.

    Raises:
        IncompatibleDraftError: the draft's tokenizer or EOS differs from the target's.
        InvalidParameterError: int8 asked for a draft that is the target's own model, a bad
            layer-skip layer count, or a negative ``prefix_cache_gib``.
    """

    def __init__(
        self,
        target: LoadedModel,
        draft: LoadedModel | None = None,
        drafters: DrafterOptions | None = None,
        controller: ControllerConfig | None = None,
        runners: RunnerOptions | None = None,
        max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
        *,
        choice: Choice | None = None,
        prefix_cache_gib: float = DEFAULT_PREFIX_CACHE_GIB,
    ) -> None:
        if prefix_cache_gib < 0:
            raise InvalidParameterError(f"--prefix-cache-gib must be >= 0 (0 turns it off), got {prefix_cache_gib}")
        drafters = drafters or DrafterOptions()
        runners = runners or RunnerOptions()
        if choice is None:  # load() chose before loading; models handed in directly are chosen for here
            device = "cpu" if target.model is None else str(next(target.model.parameters()).device)
            choice = choose_runner(runners.kind, ModelFiles.of(target, draft), Host(device))
        choice.say()
        if draft is not None:
            check_draft_compatibility(
                target.tokenizer,
                draft.tokenizer,
                target_vocab_size=target.vocab_size,
                draft_vocab_size=draft.vocab_size,
                target_eos_token_ids=target.eos_token_ids,
                draft_eos_token_ids=draft.eos_token_ids,
            )
        if draft is not None and drafters.draft_quantization == "int8" and choice.kind != "torch":
            raise InvalidParameterError(
                f"--draft-quantization int8 needs --runner torch, not {choice.kind} (gguf: iq4_nl or q4_0)"
            )
        if draft is not None and drafters.draft_quantization == "int8":
            if draft.model is target.model:
                raise InvalidParameterError("cannot quantize a draft that is the target model itself")
            quantize_linear_layers(draft.model, drafters.draft_quantization)
            draft = dataclasses.replace(draft, param_bytes=_tensor_bytes(draft.model))
        self.drafters = drafters
        self.tokenizer = target.tokenizer
        quantization = drafters.draft_quantization
        requantize = quantization if quantization == "auto" or DRAFT_QUANTIZATIONS[quantization] == "gguf" else None
        built = build_runners(runners, choice, target, draft, draft_requantize=requantize)  # auto's candidates timed
        self.runner_choice = built.choice  # which runner, its kernels and why
        self.runner_kind = built.kind
        self.draft_requantize = built.draft_requantize  # e.g. "iq4_nl": the gguf draft's 4-bit blocks
        # what the user is told: the load time including the runner's own weight loading, and the
        # bytes the runner really holds (packed blocks, int8 matrices) where it knows them
        target = _with_runner_facts(target, built, "target")
        draft = None if draft is None else _with_runner_facts(draft, built, "draft")
        self.target = target
        self.draft = draft
        self.target_runner, self.draft_runner = (
            built.target,
            built.draft,
        )  # verispec.runners.Runner (draft: None without one)
        self.suffix_cache = SuffixCache()  # past requests the suffix drafter drafts from (serve persists it)
        proposers = build_drafters(
            drafters,
            target,
            built.draft if draft is not None else None,
            built.draft_tree,
            built.target,
            self.suffix_cache,
        )
        self.prefix_cache, self.prefix_cache_note = _prefix_cache(built.target, built.kind, prefix_cache_gib)
        self.engine = SpeculativeEngine(
            built.target,
            self.tokenizer,
            eos_token_ids=target.eos_token_ids,
            proposers=proposers,
            controller=controller,
            max_num_batched_tokens=max_num_batched_tokens,
            prefix_cache=self.prefix_cache,
        )
        if built.target_curve is not None:  # the controller starts from this machine's measured verify costs
            seed_cost_model(self.engine.cost_model, built.target_curve)

    @classmethod
    def load(
        cls,
        target: str = DEFAULT_TARGET,
        draft: str | None = DEFAULT_DRAFT,
        *,
        dtype: str = "float32",
        device: str = "cpu",
        drafters: DrafterOptions | None = None,
        controller: ControllerConfig | None = None,
        runners: RunnerOptions | None = None,
        max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
        prefix_cache_gib: float = DEFAULT_PREFIX_CACHE_GIB,
        check_prompt: PromptCheck | None = None,
    ) -> SpeculativePipeline:
        """Load the target and (unless ``draft`` is None) the draft, then check they fit together.

        Before anything loads or downloads, every named file's header and the pair's vocabularies
        are checked from the GGUF metadata and the built-in models' table
        (:func:`verispec.models.preflight.check_before_loading`, well under a second), so a
        wrong file or an incompatible draft is refused at once, not after minutes of loading.
        With ``runners.kind == "llamacpp"`` (or ``auto`` choosing it from cached costs) only the
        GGUF metadata and tokenizer are read in Python; llama.cpp maps the weights.

        Raises:
            ModelNotFoundError, ModelIntegrityError, ModelFetchError: from the model store.
            IncompatibleDraftError: the draft's tokenizer or EOS differs from the target's.
            InvalidParameterError: unknown dtype, or a runner that cannot run the models.
            ModelIntegrityError: also a file that is not a GGUF file or is truncated (its size, the
                size its tensor table needs and how to fetch it again).

        ``runners`` defaults to ``auto``: on a CPU the gguf runner for GGUF files it can run.
        ``max_num_batched_tokens``: the engine's chunked-prefill budget (:class:`SpeculativeEngine`).
        ``prefix_cache_gib``: the prefix cache's memory (see the class; 0: off).
        ``check_prompt``: a request refused (InvalidParameterError: no chat template;
        ContextLengthError: past the window) once the target's tokenizer is read, before any
        weights load (a hub id's only after, by :meth:`check_window`).
        """
        if prefix_cache_gib < 0:
            raise InvalidParameterError(f"--prefix-cache-gib must be >= 0 (0 turns it off), got {prefix_cache_gib}")
        if dtype not in DTYPES:  # checked on every runner, so a typo is not ignored where it does not apply
            raise InvalidParameterError(f"dtype {dtype!r} is not supported; use one of {', '.join(DTYPES)}")
        check_before_loading(target, draft)  # headers and vocabularies: seconds, before minutes of loading
        runners = runners or RunnerOptions(kind="auto")
        files = ModelFiles.resolve(target, draft) if runners.kind == "auto" else None
        choice = choose_runner(runners.kind, files, Host(device))  # auto: from headers and cached curves
        choice.say()
        if choice.kind in ("llamacpp", "gguf") or (choice.kind == "int8" and _is_gguf(target, draft)):
            # weights are read by the runner itself
            name = {"llamacpp": "llama.cpp"}.get(choice.kind, choice.kind)
            with announce_slow(
                f"reading the GGUF headers and tokenizer of {target}" + (f" and {draft}" if draft else ""),
                "the tokenizer is built from the file once, then cached",
            ):
                target_model = load_gguf_info(target, runner=name)
                if check_prompt is not None:
                    info = TokenizerInfo(target_model.name, target_model.tokenizer, target_model.context_length)
                    check_prompt_first(check_prompt, info, choice.kind, runners)
                draft_model = load_gguf_info(draft, runner=name) if draft else None
        else:
            info = None if check_prompt is None else load_tokenizer_info(target)
            if info is not None:
                check_prompt_first(check_prompt, info, choice.kind, runners)
            with announce_slow(
                f"loading {target}" + (f" and {draft}" if draft else "") + " into torch",
                f"--runner {choice.kind} starts from the float model",
            ):
                target_model = load_model(target, dtype=dtype, device=device)
                draft_model = load_model(draft, dtype=dtype, device=device) if draft else None
        return cls(
            target_model,
            draft_model,
            drafters,
            controller,
            runners,
            max_num_batched_tokens,
            choice=choice,
            prefix_cache_gib=prefix_cache_gib,
        )

    def generate(
        self,
        prompt: str,
        params: SamplingParams | None = None,
        spec: SpeculativeConfig | None = None,
        *,
        chat: bool = False,
        learn: bool = True,
    ) -> GenerationOutput:
        """Encode ``prompt`` and generate; see :meth:`SpeculativeEngine.stream` (``learn`` too)."""
        return self.engine.generate(self.encode(prompt, chat=chat), params, spec, learn=learn)

    def stream(
        self,
        prompt: str,
        params: SamplingParams | None = None,
        spec: SpeculativeConfig | None = None,
        *,
        chat: bool = False,
    ) -> Iterator[StreamChunk]:
        """Encode ``prompt`` and stream chunks; the last one carries the output."""
        return self.engine.stream(self.encode(prompt, chat=chat), params, spec)

    @property
    def context_window(self) -> int:
        """Tokens one request may hold, prompt and output together: the target runner's KV
        capacity (``RunnerOptions.max_context_length``), at most the model's trained context."""
        return min(self.target.context_length, self.target_runner.max_context_length)

    def check_window(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Refuse a request that cannot finish inside :attr:`context_window` (as OpenAI and vLLM
        do, instead of cutting it at the window): the CLI and the server call it before generating;
        the engine alone would stop at the window with ``finish_reason="length"``.

        Raises:
            ContextLengthError: ``num_prompt_tokens`` >= the window, or ``num_prompt_tokens +
                max_tokens`` > the window; the message gives the numbers.
        """
        check_window(num_prompt_tokens, max_tokens, self.context_window)

    def window_summary(self, num_sequences: int = 1) -> str:
        """One line: the context window and what its KV caches cost, per sequence and for
        ``num_sequences`` (bytes = layers x 2 x kv_heads x head_dim x bytes per element x tokens,
        target and draft; allocated at the window, pages resident only as tokens fill them)."""
        sizes = {
            role: kv_cache_bytes(runner)
            for role, runner in (("target", self.target_runner), ("draft", self.draft_runner))
            if runner is not None
        }
        known = {role: size for role, size in sizes.items() if size is not None}
        line = f"context window {self.context_window} tokens"
        if not known:
            return line
        total = sum(known.values())
        parts = " + ".join(f"{role} {size / 2**20:.0f} MiB" for role, size in known.items())
        line += f"; KV cache per sequence: {parts}" + (f" = {total / 2**20:.0f} MiB" if len(known) > 1 else "")
        if num_sequences > 1:
            line += f"; {num_sequences} sequences: {num_sequences * total / 2**30:.2f} GiB"
        return line

    def prefix_cache_summary(self) -> str:
        """One line: the prefix cache's budget, what one token costs in it (target and draft KV
        entries, float32) and so how many tokens it holds; or why there is none."""
        if self.prefix_cache is None:
            return self.prefix_cache_note
        sizes = {
            role: runner.kv_bytes_per_token
            for role, runner in (("target", self.target_runner), ("draft", self.draft_runner))
            if runner is not None and runner.kv_bytes_per_token and runner.exports_kv
        }
        per_token = sum(sizes.values())
        parts = " + ".join(f"{role} {size / 1024:.0f}" for role, size in sizes.items())
        budget = self.prefix_cache.budget_bytes
        return (
            f"prefix cache {budget / 2**30:.2f} GiB (--prefix-cache-gib): {per_token / 1024:.0f} KiB a token "
            f"({parts} KiB), about {budget // max(per_token, 1):,} tokens in blocks of {self.prefix_cache.block_size}"
        )

    def prefix_cache_identity(self) -> dict:
        """What the prefix cache's entries depend on, for :mod:`verispec.engine.prefix_file`: the
        model files (name, size, modification time), the runner, the draft's re-quantization, the
        kernel build (gguf runner) and the layers an EAGLE head reads."""
        from verispec.runners.kernels import build_key

        def file_id(loaded: LoadedModel | None) -> str | None:
            if loaded is None or loaded.path is None:
                return None if loaded is None else loaded.name
            stat = Path(loaded.path).stat()
            return f"{Path(loaded.path).name}:{stat.st_size}:{stat.st_mtime_ns}"

        return {
            "target": file_id(self.target),
            "draft": file_id(self.draft),
            "runner": self.runner_kind,
            "draft_requantize": self.draft_requantize,
            "kernels": build_key() if self.target_runner.runs_block_kernels else None,
            "features": sorted({tuple(p.feature_layers) for p in self.engine.proposers.values() if p.feature_layers}),
        }

    def engine_with_own_suffix_cache(self) -> SpeculativeEngine:
        """Another engine over the same target, drafters, controller and measured costs, whose
        suffix drafter has its own empty cache (same settings and datastore).

        Benchmarks give each method one: a method run after another on the same prompt must not
        be drafted from the other's answer (a cache shared across methods would be).
        """
        return self.engine.with_proposers(with_own_suffix_cache(self.engine.proposers))

    def model_summaries(self) -> list[ModelSummary]:
        summaries = [ModelSummary.of("target", self.target)]
        if self.draft is not None:
            summaries.append(ModelSummary.of("draft", self.draft))
        return summaries


def _prefix_cache(target, kind: str, gib: float) -> tuple[PrefixCache | None, str]:
    """The pipeline's prefix cache (None when ``gib`` is 0 or the runner cannot copy its cache
    out) and a line saying why there is none."""
    if gib == 0:
        return None, "prefix cache off (--prefix-cache-gib 0)"
    if not target.exports_kv:
        return None, (
            f"prefix cache off: the {kind} runner's cache entries depend on how a prompt is split into passes, "
            "so a copied prefix would not be exact (the gguf and int8 runners have one)"
        )
    return PrefixCache(int(gib * 2**30), BLOCK_SIZE), ""


def _with_runner_facts(loaded: LoadedModel, built, role: str) -> LoadedModel:
    return dataclasses.replace(
        loaded,
        load_time_s=loaded.load_time_s + built.load_s.get(role, 0.0),
        param_bytes=built.weight_bytes.get(role, loaded.param_bytes),
    )


def _is_gguf(*refs: str | None) -> bool:
    """Whether every given reference resolves to a GGUF file (the int8 runner then reads it directly)."""
    from verispec.models.store import ModelStore

    store = ModelStore()
    return all(store.resolve(ref).kind == "gguf" for ref in refs if ref)


def _tensor_bytes(model) -> int:
    """Bytes of a model's parameters and buffers (after quantization: int8 weights + scales)."""
    return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
