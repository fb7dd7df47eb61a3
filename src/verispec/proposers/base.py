"""The drafter protocol: what the engine may ask of any drafter, every hook declared with its default.

The core is small (transformers ``CandidateGenerator`` shape): ``propose`` returns only new
tokens (possibly none, never None) and ``observe`` is the feedback hook after verification. The
other hooks have defaults that suit a stateless drafter: it holds one sequence, feeds nothing
before drafting, learns nothing when a request ends, drafts for each request on its own. Every
drafter subclasses :class:`Proposer`; the engine calls the hooks directly, never by ``hasattr``.
Knows nothing about verification or about the target model.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch

from verispec.algorithms.draft import DraftOutput
from verispec.algorithms.sampling import SamplingParams
from verispec.proposers.declared import Declaration, register
from verispec.runners import Runner


class TokenMasks(Protocol):
    """What a drafter reads of a request's constraints (structured output, ``min_tokens``):
    :class:`verispec.engine.constraints.TokenConstraints` implements it."""

    def path_masks(self, num_output: int, paths: Sequence[Sequence[int]]) -> torch.Tensor | None:
        """``[len(paths), vocab]`` bool: row j the tokens allowed after ``num_output`` output
        tokens and then ``paths[j]``; None when nothing is masked."""
        ...


@dataclass
class DraftRequest:
    """What a drafter sees of the request: the context, split as the penalties need it.

    ``draft_stop_threshold``: a drafter with probabilities stops after a token whose own top
    probability is below this (draft-side early stop); 0 disables. ``constraints``: the
    request's token masks (:class:`TokenMasks`; None: nothing masked), which a model
    drafter applies to its own rows (:meth:`allowed_after`) so it drafts what the target may emit.
    ``target_vocab_size``: the width of the target's rows; a draft whose rows are wider (padding
    rows of its LM head) never drafts an id at or past it, which the target could not even read.
    ``continues``: set by the policy for one step of a drafter that sizes its chain by its own
    confidence (:attr:`Proposer.sizes_chain_by_confidence`): asked after each drafted token with
    the draft's own probabilities of the tokens drafted so far, whether to draft another
    (:func:`verispec.algorithms.schedules.chain_continues`); None: the asked length.
    """

    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    params: SamplingParams
    generator: torch.Generator
    draft_stop_threshold: float = 0.0
    constraints: TokenMasks | None = None
    target_vocab_size: int | None = None
    continues: Callable[[Sequence[float]], bool] | None = None

    def allowed_after(self, appended_token_ids: Sequence[int], width: int) -> torch.Tensor | None:
        """``[1, width]`` bool: the tokens allowed after the output and ``appended_token_ids``
        (a draft row's mask: ids past the target's rows never), or None when nothing is masked."""
        mask = None
        if self.constraints is not None:
            mask = self.constraints.path_masks(len(self.output_token_ids), [list(appended_token_ids)])
        if mask is None:
            if self.target_vocab_size is None or width <= self.target_vocab_size:
                return None
            mask = torch.ones(1, self.target_vocab_size, dtype=torch.bool)
        if mask.shape[-1] >= width:
            return mask[:, :width]
        return torch.nn.functional.pad(mask, (0, width - mask.shape[-1]), value=False)

    @property
    def context(self) -> list[int]:
        return list(self.prompt_token_ids) + list(self.output_token_ids)


@dataclass(frozen=True)
class DrafterSources:
    """What the factory hands a drafter class's :meth:`Proposer.build`: the loaded pair's parts.

    Attributes:
        options: the build options (:class:`verispec.proposers.factory.DrafterOptions`).
        target: the target as loaded (:class:`verispec.models.loading.LoadedModel`).
        draft_runner: the draft model's runner (its chain); None without a draft model.
        tree_runner: the runner of the draft model's token trees (the chain's own runner where the
            two share one sequence); None without one.
        target_runner: the target's runner (an EAGLE head reads its features and embedding).
        suffix_cache: the pipeline's cache of past requests (:class:`verispec.proposers.suffix.SuffixCache`).
        built: the drafters built so far, by name (in declaration priority order).
    """

    options: Any
    target: Any
    draft_runner: Runner | None = None
    tree_runner: Runner | None = None
    target_runner: Runner | None = None
    suffix_cache: Any = None
    built: dict[str, Proposer] | None = None


class Proposer:
    """Base of every drafter. Subclasses implement :meth:`propose`; the rest have defaults.

    A drafter class declares its facts once, as ``declaration`` (:class:`~verispec.proposers.declared.Declaration`:
    name, kind, what it needs loaded, whether it scores its own drafts, its role in ``auto``), and
    builds itself from the loaded pair in :meth:`build`; the methods, the CLI's choices and the
    factory read those, so a new drafter is one module (:func:`~verispec.proposers.declared.declared_drafters`).

    Hooks (all called by the engine, none looked up by name):
        propose: the draft for one step (required).
        observe: feedback after verification (default: nothing).
        holds_sequences / new_sequence: whether the drafter can follow another sequence, and the
            drafter for it (its own caches, shared weights) -- batching needs both (default: a
            drafter holds sequences when it implements ``new_sequence``).
        catch_up_rows: context tokens the next proposal feeds before drafting (default 0: a
            lookup drafter reads the context without a pass).
        end_request: a finished request's tokens, for drafters that learn across requests
            (default: nothing).
        release: the sequence the drafter follows was emptied for good (its slot went back to
            the scheduler's pool): drop per-sequence state and hand back its memory (default:
            nothing).
        batches / propose_batch: whether steps of several requests may be drafted together, and
            how (default: each on its own through :meth:`propose`).
        feature_layers / observe_features: the target layers whose hidden states the drafter
            reads (EAGLE heads), and the features of every token the target commits, after each
            pass (default: none, nothing).
        runner: the draft model's runner, for drafters that run one (its logits width is
            checked against the target's); None for the others (default).
        kv_prefix / restore_kv_prefix: the draft runner's cache as the prefix cache keeps it (the
            token ids it holds from position 0), and a cached prefix copied back into it (default:
            no cache to keep, nothing to restore).
    """

    declaration: ClassVar[Declaration | None] = None  # None: not listed (a subclass or a user's own drafter)
    feature_layers: tuple[int, ...] = ()
    runner: Runner | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("declaration") is not None:
            register(cls)

    @classmethod
    def build(cls, sources: DrafterSources) -> Proposer | None:
        """This drafter over the loaded pair (``sources``), or None where what it needs is not
        loaded (the default: a drafter the factory does not build; a tree that wraps its chain is
        built over the chain instead, :func:`verispec.proposers.factory.with_lookup_drafters`)."""
        return None

    def draft_confidences(self, request: DraftRequest, num_tokens: int, prior: float) -> list[float]:
        """For the proposal ``propose(request, num_tokens)`` would return, the estimated probability
        that verification accepts each of its tokens (tree nodes: in tree order) and every token
        before it; ``prior``: the drafter's realised per-token acceptance. Only drafters declaring
        ``scores_own_drafts`` implement it.

        Raises:
            NotImplementedError: the drafter does not score its drafts.
        """
        raise NotImplementedError(f"{type(self).__name__} does not score its own drafts")

    @property
    def scores_own_drafts(self) -> bool:
        """Whether :meth:`draft_confidences` is implemented (declared as ``scores_own_drafts``)."""
        return self.declaration is not None and self.declaration.scores_own_drafts

    def propose(self, request: DraftRequest, num_speculative_tokens: int) -> DraftOutput:
        """Propose up to ``num_speculative_tokens`` tokens that continue ``request.context``."""
        raise NotImplementedError(f"{type(self).__name__} does not implement propose")

    def observe(self, num_accepted_tokens: int) -> None:
        """Feedback after verification of the last proposal."""

    @property
    def holds_sequences(self) -> bool:
        """This drafter can follow another sequence: by default, when it implements :meth:`new_sequence`."""
        return type(self).new_sequence is not Proposer.new_sequence

    @property
    def batches(self) -> bool:
        """Steps of several requests may be drafted together through :meth:`propose_batch`."""
        return False

    @property
    def sizes_chain_by_confidence(self) -> bool:
        """Its chain asks :attr:`DraftRequest.continues` after each token (stops where it says)."""
        return False

    def new_sequence(self) -> Proposer:
        """The same drafter for another sequence: its own caches and state.

        Raises:
            ValueError: the drafter cannot follow another sequence (:attr:`holds_sequences`).
        """
        raise ValueError(f"{type(self).__name__} cannot follow another sequence")

    def catch_up_rows(self, request: DraftRequest) -> int:
        """Context tokens the next proposal for ``request`` feeds before it drafts."""
        return 0

    def end_request(self, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int]) -> None:
        """A request finished with these tokens (drafters that learn across requests keep them)."""

    def release(self) -> None:
        """The sequence this drafter follows was emptied for good (the request left its slot):
        drop per-sequence state and give back the memory it holds. Nothing by default."""

    def shares_sequence_with(self, other: Proposer) -> bool:
        """``other`` drafts over this drafter's own model sequence (so a new request's copies
        share one too). False by default."""
        return False

    def kv_prefix(self) -> tuple[Runner, Sequence[int]] | None:
        """The runner whose cache the prefix cache may keep and restore for this drafter, and the
        token ids its cache holds from position 0 (entries ``i`` follow tokens ``0 .. i``); None
        for drafters without one (default)."""
        return None

    def restore_kv_prefix(self, token_ids: Sequence[int], kv: torch.Tensor) -> None:
        """Make the draft cache hold ``token_ids`` (a prefix of the sequence): their entries ``kv``
        (:meth:`verispec.runners.Runner.export_kv` of a runner over the same weights). Only called
        on drafters whose :meth:`kv_prefix` is not None."""

    def observe_features(self, features: torch.Tensor, position: int) -> None:
        """The target's hidden states of the tokens it just committed to the KV cache, at
        positions ``position .. position + rows - 1``: float32 ``[rows, len(feature_layers) *
        hidden_size]``, the layers concatenated (:attr:`feature_layers`). Called after every
        target pass of the drafter's sequence (prefill chunks, verify passes whatever drafted),
        only for drafters with ``feature_layers``. A position below the last one seen means the
        target rolled back there (a new request on the sequence)."""

    @staticmethod
    def propose_batch(items: Sequence[tuple[Proposer, DraftRequest, int]]) -> list[DraftOutput]:
        """Drafts for several requests, each ``(its own drafter, its request, tokens at most)``,
        in order. Drafters with ``batches`` override this to share passes; the result must equal
        each :meth:`propose` alone."""
        return [proposer.propose(request, k) for proposer, request, k in items]


class DraftCacheSequences(Proposer):
    """For drafters that own a draft runner's cache (``runner``, ``cached_token_ids``): another
    sequence is the same drafter over ``runner.new_sequence()`` with an empty cache.

    ``context_window``: prompt tokens the draft model sees, the last ones (None: all). The draft
    prefills what it sees before its first proposal, outside the target's passes; on long
    prompts (RAG, summarization) that prefill costs more than the draft then saves. A shorter
    context can only lower acceptance, never change the output (the target verifies).
    """

    runner: Runner
    context_window: int | None = None

    @property
    def cached_token_ids(self) -> list[int]:
        """The token ids in the draft runner's cache, in order (shared by every drafter over the
        same draft sequence: :meth:`on_sequence_of`)."""
        return self._held().token_ids

    @cached_token_ids.setter
    def cached_token_ids(self, token_ids: list[int]) -> None:
        self._held().token_ids = token_ids

    def _held(self) -> _CacheContents:
        """What this drafter's draft sequence holds (made on first use)."""
        return self.__dict__.setdefault("_contents", _CacheContents())

    def draft_context(self, request: DraftRequest) -> list[int]:
        """The token ids the draft continues: the prompt's last ``context_window`` and the output,
        read from :func:`window_start` on once they fill the draft runner's own context window
        (a draft with a shorter window than the target's keeps drafting, from the latest tokens)."""
        prompt = request.prompt_token_ids
        if self.context_window is not None and len(prompt) > self.context_window:
            prompt = prompt[len(prompt) - self.context_window :]
        context = list(prompt) + list(request.output_token_ids)
        return context[window_start(len(context), self.runner.max_context_length) :]

    def note_prompt(self, request: DraftRequest) -> None:
        """Tell the draft runner the whole prompt is this sequence's context, the tokens outside
        :attr:`context_window` too (a reduced head's context rows: the draft may propose any token
        of the prompt); once per request: the engine hands a request's drafters one prompt object."""
        held = self._held()
        if held.noted_prompt is not request.prompt_token_ids:
            self.runner.note_context_tokens(request.prompt_token_ids)
            held.noted_prompt = request.prompt_token_ids

    def reusable_prefix(self, context: Sequence[int]) -> int:
        """Tokens of ``context`` the draft cache keeps: the prefix it shares with it, but never the
        last token (its logits are needed, so it is always fed again)."""
        return min(common_prefix_length(self.cached_token_ids, context), len(context) - 1)

    def catch_up_rows(self, request: DraftRequest) -> int:
        """Context tokens the next proposal for ``request`` feeds before it drafts: 1-2 after its
        own chain, the whole visible prompt at a request's first proposal."""
        context = self.draft_context(request)
        return len(context) - self.reusable_prefix(context)

    def feed_long_context(self, pending: Sequence[int]) -> list[int]:
        """Feed ``pending`` (tokens after the cached ones) but its last piece to the draft runner in
        passes of its ``prefill_chunk_rows`` (a request's first proposal feeds its whole prompt);
        returns the last piece, which the first drafting pass feeds. The cache holds the same
        entries either way (batch-invariant runners); long passes are slower per row."""
        size = self.runner.prefill_chunk_rows
        pending = list(pending)
        while size is not None and len(pending) > size:
            self.runner.forward(pending[:size], num_logits=1)
            self.cached_token_ids.extend(pending[:size])
            pending = pending[size:]
        return pending

    @property
    def holds_sequences(self) -> bool:
        """The draft runner can give another sequence."""
        return self.runner.holds_sequences

    def new_sequence(self):
        """This drafter for another request: the same draft weights, its own empty cache."""
        clone = copy.copy(self)
        clone.runner = self.runner.new_sequence()
        clone._contents = _CacheContents()
        return clone

    def on_sequence_of(self, other: DraftCacheSequences) -> DraftCacheSequences:
        """This drafter over ``other``'s draft sequence: the same runner sequence, its cache and
        the token ids it holds shared, so switching between the two drafters (``auto``'s draft
        chain and draft tree) feeds only the tokens since either last drafted, never the context
        again. For runners whose rows do not depend on the pass they are in (gguf, int8): an
        entry is the same bits whichever drafter computed it."""
        clone = copy.copy(self)
        clone.runner = other.runner
        clone._contents = other._held()
        return clone

    def shares_sequence_with(self, other: Proposer) -> bool:
        """``other`` drafts over this drafter's very draft sequence (:meth:`on_sequence_of`)."""
        return isinstance(other, DraftCacheSequences) and other._held() is self._held()

    def kv_prefix(self) -> tuple[Runner, Sequence[int]] | None:
        """The draft runner and the token ids its cache holds (where it can copy entries out)."""
        return (self.runner, self.cached_token_ids) if self.runner.exports_kv else None

    def restore_kv_prefix(self, token_ids: Sequence[int], kv: torch.Tensor) -> None:
        """The draft cache holds ``token_ids`` with entries ``kv``: the next proposal feeds only
        what follows them (:meth:`reusable_prefix`)."""
        self.runner.import_kv(kv, 0)
        self.runner.note_context_tokens(token_ids)
        self.cached_token_ids = list(token_ids)

    def release(self) -> None:
        """Empty the draft cache and hand its memory back (the runner's ``release()``)."""
        self.runner.release()
        self.cached_token_ids = []
        self._held().noted_prompt = None


class _CacheContents:
    """The token ids one draft runner sequence's cache holds, in order: one object for every
    drafter over that sequence (:meth:`DraftCacheSequences.on_sequence_of`)."""

    __slots__ = ("noted_prompt", "token_ids")

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.noted_prompt: Sequence[int] | None = None  # the prompt the runner was told of (note_prompt)


def window_start(num_tokens: int, capacity: int) -> int:
    """Where a draft whose cache holds ``capacity`` tokens starts reading a context of
    ``num_tokens``: 0 while one draft token still fits after it, then a multiple of half the
    capacity, so the window leaves room to draft and its start stays put (the cached prefix
    stays reusable) for half a window of new tokens between moves. At least one token is read."""
    if num_tokens < capacity:
        return 0
    half = max(1, capacity // 2)
    return min((num_tokens - capacity) // half * half + half, num_tokens - 1)


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
