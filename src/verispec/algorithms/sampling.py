"""Sampling parameters and the logits -> distribution pipeline shared by target and draft.

Owns: validation of user sampling parameters, the penalties (repetition, presence, frequency),
temperature, top-k and top-p, and drawing a token from a distribution with an explicit
``torch.Generator``. Speculative decoding is lossless only if the target's rows are processed
*exactly* as plain decoding processes them, so both paths call :func:`process_logits` here and
nowhere else. Knows nothing about models, KV caches or tokenization.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from verispec.errors import InvalidParameterError

MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-5, 100.0
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs
SAMPLING_MODES = ("coupled", "rejection")


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen. ``temperature == 0`` is greedy (argmax), its own branch.

    Attributes:
        temperature: 0 selects greedy decoding; otherwise in [1e-5, 100] (smaller values overflow
            float32 logits; use 0 for argmax).
        top_k: keep the k most likely tokens; 0 disables.
        top_p: nucleus mass in (0, 1]; 1 disables.
        repetition_penalty: in [0.01, 100]; CTRL-style (Keskar et al. 2019, §4.1) over prompt + output:
            a seen token's positive logit is divided by it, a negative one multiplied. 1 disables.
        presence_penalty, frequency_penalty: OpenAI semantics in [-2, 2] over *output* tokens:
            ``logit -= frequency_penalty * count + presence_penalty * (count > 0)``.
        max_tokens: >= 1, new tokens at most.
        stop: stop strings; output text ends before the earliest one found.
        seed: the request's key: seeds its ``torch.Generator``, whose ``initial_seed()`` keys the
            coupled noise; None draws a fresh one per request.
        sampling: how a sampled request draws, ignored when greedy. ``"coupled"`` (default):
            Gumbel-max with noise keyed by (seed, position) (:mod:`verispec.algorithms.coupling`),
            so a seed gives the same tokens under every drafter, schedule and batch; speculation
            accepts a draft token when it equals the target's coupled sample. ``"rejection"``:
            ``torch.multinomial`` with the generator and modified rejection sampling under
            speculation (its tokens depend on how many draws each step spent).
        ignore_eos: keep generating past EOS (benchmarks).
        min_tokens: the stop tokens (EOS) are masked while the output has fewer tokens; stop
            strings still end it (vLLM's semantics).
        logit_bias: ``{token_id: bias}`` added to the logits after the penalties (OpenAI's
            ``logit_bias``: bias in [-100, 100]); stored as sorted ``(token_id, bias)`` pairs.
        logprobs: None, or the number of most likely alternatives (0..20) to report with each
            output token's log-probability (:func:`token_logprobs`).
        structured_output: the grammar the output must follow
            (:class:`verispec.engine.constraints.StructuredOutput`), or None.
        prompt_logprobs: None, or alternatives per prompt token: each prompt token after the
            first gets its raw log-probability (no penalties or masks) from the prefill's rows.

    Raises:
        InvalidParameterError: on any value outside its range.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int = 128
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    structured_output: object | None = None
    prompt_logprobs: int | None = None
    sampling: str = "coupled"

    def __post_init__(self) -> None:
        if isinstance(self.logit_bias, Mapping):
            object.__setattr__(
                self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in self.logit_bias.items()))
            )
        elif not isinstance(self.logit_bias, tuple):
            object.__setattr__(self, "logit_bias", tuple(tuple(pair) for pair in self.logit_bias))
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop))
        checks = [
            (
                self.temperature == 0 or MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE,
                f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}], got {self.temperature}",
            ),
            (self.top_k >= 0, f"top_k must be >= 0 (0 disables), got {self.top_k}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (
                MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY,
                f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY}], "
                f"got {self.repetition_penalty}",
            ),
            (-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
            (all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings"),
            (
                0 <= self.min_tokens <= self.max_tokens,
                f"min_tokens must be in [0, max_tokens = {self.max_tokens}], got {self.min_tokens}",
            ),
            (
                all(t >= 0 and -100 <= b <= 100 for t, b in self.logit_bias),
                "logit_bias maps token ids (>= 0) to biases in [-100, 100]",
            ),
            (
                self.logprobs is None or 0 <= self.logprobs <= MAX_TOP_LOGPROBS,
                f"logprobs (alternatives per token) must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}",
            ),
            (
                self.sampling in SAMPLING_MODES,
                f"sampling must be one of {SAMPLING_MODES}, got {self.sampling!r}",
            ),
            (
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS,
                f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidParameterError(message)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def apply_penalties(
    logits: Tensor,  # [num_rows, vocab] float32
    params: SamplingParams,
    prompt_token_ids: Sequence[int],
    output_token_ids: Sequence[int],
    appended_token_ids: Sequence[int] = (),  # [num_rows - 1] or [num_rows]
) -> Tensor:
    """Apply repetition/presence/frequency penalties row by row.

    Row i is scored as plain decoding would score the step after
    ``prompt + output + appended[:i]``: that is what makes verification of a k-token draft equal
    to k plain steps. Returns a new float32 tensor ``[num_rows, vocab]``; ``logits`` is untouched.
    """
    if not params.has_penalties:
        return logits
    num_rows, vocab = logits.shape
    out = logits.clone()
    appended = torch.tensor(list(appended_token_ids)[: num_rows - 1], dtype=torch.long)
    # steps[i, t] = how often t occurs in appended[:i]
    steps = torch.zeros(num_rows, vocab)
    if appended.numel():
        onehot = torch.nn.functional.one_hot(appended.clamp(max=vocab - 1), vocab).float()
        steps[1:] = torch.cumsum(onehot, dim=0) * (appended < vocab).float()[:, None]
    if params.repetition_penalty != 1.0:
        seen = torch.zeros(vocab)
        history = [t for t in list(prompt_token_ids) + list(output_token_ids) if t < vocab]
        seen[torch.tensor(history, dtype=torch.long)] = 1.0
        mask = (seen[None, :] + steps) > 0
        penalized = torch.where(out > 0, out / params.repetition_penalty, out * params.repetition_penalty)
        out = torch.where(mask, penalized, out)
    if params.presence_penalty != 0.0 or params.frequency_penalty != 0.0:
        counts = torch.zeros(vocab)
        produced = torch.tensor([t for t in output_token_ids if t < vocab], dtype=torch.long)
        counts.index_add_(0, produced, torch.ones(produced.numel()))
        counts = counts[None, :] + steps
        out = out - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).float()
    return out


def logits_to_probs(logits: Tensor, params: SamplingParams) -> Tensor:
    """Temperature, then top-k, then top-p (the order of HF and vLLM), then softmax.

    Args:
        logits: ``[num_rows, vocab]`` float32, penalties already applied.
    Returns:
        ``[num_rows, vocab]`` float32 probabilities; each row sums to 1.
    Raises:
        InvalidParameterError: if called for greedy params (greedy never builds probabilities).
    """
    return torch.softmax(logits_to_scores(logits, params), dim=-1)


def logits_to_scores(logits: Tensor, params: SamplingParams) -> Tensor:
    """:func:`logits_to_probs` before its softmax: ``[num_rows, vocab]`` float32 ``logits /
    temperature`` with -inf where top-k or top-p drop a token (log-probabilities up to a
    constant per row: what the coupled sample takes). Raises as :func:`logits_to_probs`."""
    if params.is_greedy:
        raise InvalidParameterError("greedy decoding takes the argmax; it has no sampling distribution")
    scores = logits / params.temperature
    vocab = scores.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_scores, dim=-1)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p
        drop_sorted[..., 0] = False  # the most likely token stays, even if top_p rounds to 0
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores


def sample_from(probs: Tensor, generator: torch.Generator) -> int:
    """Draw one token id from ``probs`` (``[vocab]`` float32) with the request's generator."""
    return int(torch.multinomial(probs, 1, generator=generator).item())


@dataclass
class ProcessedRows:
    """Target or draft rows after processing: ``token_ids`` for greedy, ``probs`` for sampling.

    ``logits``: ``[num_rows, vocab]`` float32 after penalties, ``logit_bias`` and masks, before
    temperature, top-k and top-p (what :func:`token_logprobs` reports). ``scores``: coupled
    sampling only (``params.sampling == "coupled"``), ``[num_rows, vocab]`` float32
    :func:`logits_to_scores`, what :func:`verispec.algorithms.coupling.coupled_sample` takes.
    """

    greedy_token_ids: Tensor | None  # [num_rows] int64, greedy only
    probs: Tensor | None  # [num_rows, vocab] float32, sampling only
    logits: Tensor | None = None
    scores: Tensor | None = None  # [num_rows, vocab] float32, coupled sampling only


def apply_logit_bias(logits: Tensor, params: SamplingParams) -> Tensor:
    """``logits`` (``[num_rows, vocab]`` float32) plus ``params.logit_bias`` in every row; ids past
    the vocabulary are ignored (OpenAI refuses them; the server checks). Returns a new tensor."""
    if not params.logit_bias:
        return logits
    vocab = logits.shape[-1]
    pairs = [(t, b) for t, b in params.logit_bias if t < vocab]
    if not pairs:
        return logits
    bias = torch.zeros(vocab)
    bias[torch.tensor([t for t, _ in pairs])] = torch.tensor([b for _, b in pairs])
    return logits + bias


def process_logits(
    logits: Tensor,  # [num_rows, vocab]
    params: SamplingParams,
    prompt_token_ids: Sequence[int],
    output_token_ids: Sequence[int],
    appended_token_ids: Sequence[int] = (),
    allowed: Tensor | None = None,  # [num_rows, vocab] bool, or None: every token allowed
) -> ProcessedRows:
    """The one path from raw logits to what a decoder needs (argmax ids or probabilities).

    Order: penalties (:func:`apply_penalties`), ``logit_bias``, the ``allowed`` mask (min_tokens
    and grammar: :class:`verispec.engine.constraints.TokenConstraints`) as ``-inf``, then greedy argmax
    or temperature / top-k / top-p (:func:`logits_to_probs`; also the scores, when coupled). Row i is the step after
    ``output + appended[:i]``; the caller's ``allowed[i]`` must be that step's mask too.
    """
    logits = apply_penalties(logits.float(), params, prompt_token_ids, output_token_ids, appended_token_ids)
    logits = apply_logit_bias(logits, params)
    if allowed is not None:
        if allowed.shape != logits.shape:
            raise ValueError(f"allowed mask {tuple(allowed.shape)} does not match the logits {tuple(logits.shape)}")
        logits = logits.masked_fill(~allowed, float("-inf"))
    if params.is_greedy:
        return ProcessedRows(greedy_token_ids=torch.argmax(logits, dim=-1), probs=None, logits=logits)
    scores = logits_to_scores(logits, params)
    coupled = scores if params.sampling == "coupled" else None
    return ProcessedRows(greedy_token_ids=None, probs=torch.softmax(scores, dim=-1), logits=logits, scores=coupled)


@dataclass(frozen=True)
class TokenLogprob:
    """One output token's log-probability and its most likely alternatives.

    ``logprob``: natural log of the token's probability under the processed row
    (:attr:`ProcessedRows.logits`: penalties, ``logit_bias`` and masks applied; temperature,
    top-k and top-p not). ``top``: ``[(token_id, logprob)]``, most likely first, masked tokens
    left out.
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(row_logits: Tensor, token_id: int, num_top: int) -> TokenLogprob:
    """:class:`TokenLogprob` of ``token_id`` from one processed row (``[vocab]`` float32).

    One row at a time, so a verify row gives bit for bit what plain decoding's single row gives.
    """
    logprobs = torch.log_softmax(row_logits.reshape(1, -1), dim=-1)[0]
    top: tuple[tuple[int, float], ...] = ()
    if num_top > 0:
        values, ids = torch.topk(logprobs, min(num_top, logprobs.numel()))
        top = tuple((int(i), float(v)) for i, v in zip(ids.tolist(), values.tolist()) if v != float("-inf"))
    return TokenLogprob(int(token_id), float(logprobs[token_id]), top)
