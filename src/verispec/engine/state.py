"""What the engine keeps per sequence slot and per request between its steps.

Owns :class:`Slot` (a target sequence and the drafters that follow it, and the checks that they
fit together: :func:`check_draft_widths`, :func:`capture_features`) and :class:`RequestState`
(one request's prompt, parameters, policy, generator, output, masks, logprobs and metrics).
Knows nothing about running a pass (:mod:`verispec.engine` does).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from verispec.algorithms.sampling import SamplingParams, TokenLogprob, token_logprobs
from verispec.engine.constraints import TokenConstraints
from verispec.engine.policy import DraftPolicy
from verispec.engine.prefix_state import PrefixState
from verispec.engine.request import GenerationOutput, SpeculativeConfig
from verispec.errors import IncompatibleDraftError, InvalidParameterError
from verispec.metrics import RequestTimes, SpecDecodeStats
from verispec.output import Detokenizer, OutputBuilder
from verispec.proposers import Proposer
from verispec.runners import Runner


@dataclass
class Slot:
    """One sequence slot of an engine: a target sequence and the drafters whose caches follow it.

    The engine's own slot is its ``target`` with its ``proposers``; :meth:`SpeculativeEngine.new_slot`
    makes more (``new_sequence()`` of the runner and of each stateful drafter) for batching.
    """

    target: Runner
    proposers: dict[str, Proposer]
    feature_readers: list[Proposer] = field(
        init=False
    )  # drafters fed the target's features (``Proposer.feature_layers``)

    def __post_init__(self) -> None:
        self.feature_readers = list({id(p): p for p in self.proposers.values() if p.feature_layers}.values())

    def release(self) -> None:
        """The slot's request left it: empty the target's cache and every drafter's per-sequence
        state, and hand their memory back to the OS where the runner can (:meth:`verispec.runners.Runner.release`,
        ``truncate(0)`` at least). A slot waiting in the
        scheduler's pool then holds no KV pages, and the next request starts from a clean state."""
        self.target.release()
        for proposer in {id(p): p for p in self.proposers.values()}.values():
            proposer.release()


@dataclass
class RequestState:
    """Everything one request carries between the engine's steps (see :meth:`SpeculativeEngine.step`).

    ``num_prefilled``: prompt tokens already in the target's cache (the prompt is prefilled in
    chunks when other requests share the passes). ``pending``: the last committed token, not yet in
    the cache. ``constraints``: the request's token masks (min_tokens, grammar). ``logprobs``:
    per output token, ``prompt_logprobs`` per prompt token after the first, when asked for.
    ``learn``: drafters that learn across requests (the suffix cache) keep its answer once it
    finishes; False for warm-ups and audit re-decodes, which are not users' requests.
    ``prefix``: its view of the engine's prefix cache (:mod:`verispec.engine.prefix_reuse`); None
    without one, or for a request that asks for every prompt row's logprobs.
    """

    prompt: list[int]
    params: SamplingParams
    spec: SpeculativeConfig
    slot: Slot
    policy: DraftPolicy
    generator: torch.Generator
    out: OutputBuilder
    constraints: TokenConstraints
    stats: SpecDecodeStats = field(default_factory=SpecDecodeStats)
    times: RequestTimes = field(default_factory=lambda: RequestTimes(start=time.perf_counter()))
    sources: list[str] = field(default_factory=list)
    num_prefilled: int = 0
    pending: int | None = None
    output: GenerationOutput | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    learn: bool = True
    prefix: PrefixState | None = None

    @property
    def num_cached_prompt_tokens(self) -> int:
        """Prompt tokens read from the prefix cache instead of computed (OpenAI's ``cached_tokens``)."""
        return 0 if self.prefix is None else self.prefix.num_cached_tokens

    @property
    def finished(self) -> bool:
        return self.output is not None

    @property
    def prefilling(self) -> bool:
        return self.pending is None

    def record_logprobs(self, rows: torch.Tensor, committed: Sequence[int], scoring_rows: Sequence[int] = (0,)) -> None:
        """Log-probabilities of the ``committed`` tokens, token i from processed row ``scoring_rows[i]``
        (``rows``: ``[rows, vocab]`` float32, :attr:`verispec.algorithms.sampling.ProcessedRows.logits`)."""
        if self.params.logprobs is None:
            return
        for token_id, row in zip(committed, scoring_rows):
            self.logprobs.append(token_logprobs(rows[row], token_id, self.params.logprobs))

    def chunk_logprobs(self, committed: Sequence[int]) -> list[TokenLogprob] | None:
        """The last ``len(committed)`` entries (a stream chunk's); None when not asked for."""
        if self.params.logprobs is None:
            return None
        return self.logprobs[len(self.logprobs) - len(committed) :] if committed else []


def capture_features(target: Runner, proposers) -> None:
    """Make ``target`` record the hidden states the feature drafters read (EAGLE heads), for
    every row of every pass, where any drafter asks for them (``Proposer.feature_layers``).

    Raises:
        InvalidParameterError: drafters asking for different layers, or a runner that cannot
            hand out its hidden states.
    """
    layers = {tuple(p.feature_layers) for p in proposers if p.feature_layers}
    if not layers:
        return
    if len(layers) > 1:
        raise InvalidParameterError(
            f"the drafters read different target layers ({sorted(layers)}): load one feature drafter"
        )
    if not target.supports_features:
        raise InvalidParameterError(
            f"the {type(target).__name__} cannot hand its hidden states to a feature drafter (EAGLE head): "
            "use the gguf, int8 or torch runner"
        )
    target.capture_features(next(iter(layers)))


def check_draft_widths(target: Runner, proposers: Mapping[str, Proposer], tokenizer: Detokenizer) -> None:
    """Refuse a model drafter whose logits rows are not the target's width, unless both cover the
    tokenizer (``len(tokenizer)``; padded rows, as in Qwen2.5-7B's 152064 against 0.5B's 151936).

    Otherwise a token id of one model past the other's rows would end generation with an
    IndexError mid-request (:func:`verispec.models.compat.check_draft_compatibility` checks the
    tokenizers themselves when a pipeline loads).

    Raises:
        IncompatibleDraftError: naming the drafter and both widths.
    """
    size = len(tokenizer) if hasattr(tokenizer, "__len__") else None
    for name, proposer in proposers.items():
        runner = proposer.runner
        if runner is None or runner is target or runner.vocab_size == target.vocab_size:
            continue
        width = runner.vocab_size
        if size is None or min(width, target.vocab_size) < size:
            covered = "" if size is None else f" and the tokenizer has {size} tokens"
            raise IncompatibleDraftError(
                f"the {name} drafter's logits are {width} wide, the target's {target.vocab_size}{covered}: "
                "the draft must share the target's vocabulary"
            )
