"""What a request asks for and what it gets back: the speculation config, the output, the
stream chunks. Plain data with their own checks; knows nothing about models or decoding.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from verispec.algorithms.schedules import SCHEDULES
from verispec.engine.methods import METHODS
from verispec.errors import InvalidParameterError
from verispec.metrics import RequestMetrics

__all__ = ["MAX_SPECULATIVE_TOKENS", "METHODS", "GenerationOutput", "SpeculativeConfig", "StreamChunk"]
MAX_SPECULATIVE_TOKENS = 64


@dataclass(frozen=True)
class SpeculativeConfig:
    """How to speculate for one request.

    Attributes:
        method: ``"none"`` (plain decoding), the name of a loaded drafter (``"draft"``,
            ``"ngram"``, ``"suffix"``: suffix drafting over earlier requests and this one,
            ``"layer-skip"``, ``"eagle"``: an EAGLE-3 head over the target's features, a chain;
            ``"eagle-tree"``: the same head's dynamic tree, EAGLE-2, where the target verifies
            trees) or ``"auto"`` (suffix lookup when it matches -- n-gram lookup
            where no suffix drafter is loaded --, else whichever of the EAGLE head and the draft
            model (chain, or tree where the target verifies trees) realises more tokens per unit
            time, else layer skip; decided per step) or ``"tree"`` (token trees:
            n-gram branches when the lookup matches, else the draft model's tree; per step).
        num_speculative_tokens: tokens drafted per target pass, 1..64 (ignored for ``none``):
            the draft length of the ``constant`` schedule, the upper bound of the others; for
            ``tree``, the number of tree nodes verified per target pass.
        schedule: ``"cost"`` (the default, as in the CLI and the server: the k maximising
            expected tokens per unit of measured time, priced for the whole batch under continuous
            batching; may switch speculation off, so it never drafts where its own estimate says
            plain decoding is faster; for ``tree``, the node budget maximising the realised
            accepted length per unit time: :class:`verispec.algorithms.schedules.TreeBudgetSchedule`),
            ``"heuristic"`` (+2 after a full accept, -1 otherwise) or ``"constant"`` (always
            ``num_speculative_tokens``: drafts even where it is slower than plain decoding);
            see :mod:`verispec.algorithms.control`.
        draft_stop_threshold: a model drafter stops drafting once its own top probability for
            the token it just drafted is below this, in [0, 1); 0 disables.
    Raises:
        InvalidParameterError: unknown method or schedule, or an out-of-range number.
    """

    method: str = "draft"
    num_speculative_tokens: int = 5
    schedule: str = "cost"
    draft_stop_threshold: float = 0.0

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise InvalidParameterError(f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise InvalidParameterError(
                f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], got {self.num_speculative_tokens}"
            )
        if self.schedule not in SCHEDULES:
            raise InvalidParameterError(f"unknown schedule {self.schedule!r}; choose one of {', '.join(SCHEDULES)}")
        if not 0.0 <= self.draft_stop_threshold < 1.0:
            raise InvalidParameterError(f"draft_stop_threshold must be in [0, 1), got {self.draft_stop_threshold}")


@dataclass
class GenerationOutput:
    """Result of one request: ``token_ids`` ``[output_tokens]``, its text, why it ended, metrics.

    ``token_sources`` ``[output_tokens]``: for each output token, the drafter whose accepted
    draft token it was, or ``"target"`` (first token, recovered and bonus tokens, plain steps).
    ``logprobs`` ``[output_tokens]``: each token's :class:`~verispec.algorithms.sampling.TokenLogprob`
    when the request asked (``SamplingParams.logprobs``), else None; ``prompt_logprobs``
    ``[prompt_tokens - 1]`` likewise for the prompt's tokens after the first.
    """

    token_ids: list[int]
    text: str
    finish_reason: str
    metrics: RequestMetrics
    token_sources: list[str] = field(default_factory=list)
    logprobs: list | None = None
    prompt_logprobs: list | None = None

    def to_dict(self) -> dict:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "metrics": self.metrics.to_dict(),
            "token_sources": self.token_sources,
        }


@dataclass
class StreamChunk:
    """What one verify step committed: new visible text and token ids; ``output`` on the last.
    ``logprobs``: the committed tokens' log-probabilities when the request asked, else None;
    ``prompt_logprobs``: on the first chunk, the prompt's (``SamplingParams.prompt_logprobs``)."""

    text: str
    token_ids: list[int] = field(default_factory=list)
    output: GenerationOutput | None = None
    logprobs: list | None = None
    prompt_logprobs: list | None = None
