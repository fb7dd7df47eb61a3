"""The misconfiguration bug class of issue 29 on the engine (``test_bug_classes.py`` has the
others): a drafter asked for but not loaded, an impossible draft length or method, a draft of
another vocabulary or EOS, a draft with padding rows past the target's, and drafts whose context
window is shorter than the request. Each is a clear verispec error before anything runs, or the
run still drafts; never a silent plain run."""

from __future__ import annotations

import pytest

from bug_classes_support import PLAIN, PROMPTS, VOCAB, make_engine, spec
from helpers import CharTokenizer, default_pieces, single_thread
from server_support import bigram_qwen2, build_tokenizer, successor_table
from verispec.algorithms.sampling import SamplingParams
from verispec.engine import SpeculativeConfig, SpeculativeEngine
from verispec.engine.loader import SpeculativePipeline
from verispec.engine.scheduler import Scheduler
from verispec.errors import IncompatibleDraftError, InvalidParameterError
from verispec.models.loading import LoadedModel
from verispec.proposers import DraftRequest
from verispec.proposers.base import window_start
from verispec.runners.torch_runner import TransformersRunner


def test_a_drafter_that_is_asked_for_but_not_loaded_is_refused_before_anything_runs(target):
    engine = SpeculativeEngine(TransformersRunner(target), CharTokenizer(default_pieces(VOCAB)), eos_token_ids=())
    scheduler = Scheduler(engine, max_num_seqs=2)
    for method in ("draft", "layer-skip", "eagle"):
        with pytest.raises(InvalidParameterError, match=f"method '{method}' needs its drafter loaded"):
            engine.generate(PROMPTS[0], SamplingParams(max_tokens=4), spec(method))
        with pytest.raises(InvalidParameterError, match="needs its drafter loaded"):
            scheduler.add(PROMPTS[0], SamplingParams(max_tokens=4), spec(method))
    assert not scheduler.waiting and not scheduler.running  # nothing queued
    with pytest.raises(InvalidParameterError, match="subclass verispec.proposers.Proposer"):
        SpeculativeEngine(
            TransformersRunner(target),
            CharTokenizer(default_pieces(VOCAB)),
            eos_token_ids=(),
            proposers={"draft": TransformersRunner(target)},
        )  # a runner where a drafter belongs


@pytest.mark.parametrize(
    "options", [{"num_speculative_tokens": 0}, {"num_speculative_tokens": 65}, {"method": "medusa"}]
)
def test_a_draft_length_or_method_that_cannot_be_is_refused(options):
    with pytest.raises(InvalidParameterError):
        SpeculativeConfig(**options)


def loaded_model(model, tokenizer, *, eos: int | None = None, vocab_size: int | None = None):
    """``model`` as loaded with ``tokenizer`` (the pipeline checks the pair's compatibility)."""
    return LoadedModel(
        name="m",
        model=model,
        tokenizer=tokenizer,
        path=None,
        load_time_s=0.0,
        param_bytes=0,
        eos_token_ids=(tokenizer.eos_token_id if eos is None else eos,),
        context_length=64,
        vocab_size=vocab_size or len(tokenizer),
    )


def test_a_draft_with_another_vocabulary_or_eos_is_refused_at_load():

    model = bigram_qwen2(build_tokenizer(), successor_table(build_tokenizer()), seed=0)
    other = build_tokenizer()
    other.add_tokens(["<extra>"])  # one more token: the ids no longer mean the same texts
    cases = [
        (loaded_model(model, other), "tokenizer"),  # another vocabulary
        (loaded_model(model, build_tokenizer(), eos=5), "EOS"),  # stops elsewhere
        (loaded_model(model, build_tokenizer(), vocab_size=200), "logits width"),  # rows for part of the tokenizer only
    ]
    for draft_model, message in cases:
        with pytest.raises(IncompatibleDraftError, match=message):
            SpeculativePipeline(loaded_model(model, build_tokenizer()), draft_model)


def test_a_draft_with_padding_rows_past_the_targets_never_drafts_them():
    # allowed at load (logits widths may differ by padding rows), but an id past the target's
    # rows, drafted, would crash the very pass that was to reject it

    tokenizer = build_tokenizer()
    size = len(tokenizer)

    class WiderHead:  # what bigram_qwen2 reads of a tokenizer: a draft with 8 padding rows
        eos_token_id = tokenizer.eos_token_id

        def __len__(self) -> int:
            return size + 8

    successors = successor_table(tokenizer)
    hello = tokenizer.encode("Hello", add_special_tokens=False)
    draft = bigram_qwen2(
        WiderHead(), {**successors, hello[1]: size + 3}, seed=1
    )  # its favourite after "ll": a padding row
    pipe = SpeculativePipeline(
        loaded_model(bigram_qwen2(tokenizer, successors, seed=0), tokenizer),
        loaded_model(draft, tokenizer, vocab_size=size + 8),
    )
    proposer = pipe.engine.proposers["draft"]
    request = DraftRequest(hello[:2], [], SamplingParams(), None)
    assert proposer.propose(request, 1).draft_token_ids == [size + 3]  # what it drafts unbounded
    request.target_vocab_size = size
    assert proposer.propose(request, 1).draft_token_ids[0] < size
    for temperature in (0.0, 0.8):
        params = SamplingParams(max_tokens=30, temperature=temperature, seed=1)
        got = pipe.generate("Hello", params, spec("draft"))
        assert got.metrics.spec.num_draft_tokens > 0 and max(got.token_ids) < size
        assert temperature > 0 or got.token_ids == pipe.generate("Hello", params, PLAIN).token_ids


@pytest.mark.parametrize(
    "num_tokens, capacity, start",
    [
        (15, 16, 0),  # one draft token still fits: all of it
        (16, 16, 8),  # full: from the middle on
        (23, 16, 8),  # the start stays while tokens come (the cached prefix is reused)
        (24, 16, 16),  # then moves on by half a window
        (1, 1, 0),  # a one-token cache still reads the last token (and cannot draft)
    ],
)
def test_a_draft_reads_the_latest_part_of_a_context_longer_than_its_window(num_tokens, capacity, start):
    assert window_start(num_tokens, capacity) == start


def test_a_draft_whose_context_is_shorter_than_the_request_keeps_drafting(target):
    # a 16-token draft cache under a 256-token target: a 20-token prompt is beyond it from the start;
    # the draft reads the latest part of the context instead of sitting out every step
    engine = make_engine(target, target, draft_context_length=16)
    prompt = [(7 * i + 3) % VOCAB for i in range(20)]
    params = SamplingParams(max_tokens=40)
    got = engine.generate(prompt, params, spec("draft"))
    assert got.token_ids == engine.generate(prompt, params, PLAIN).token_ids
    assert got.metrics.spec.per_drafter["draft"].num_draft_tokens >= 20


def test_a_missing_drafter_error_says_what_loads_it():
    from verispec.engine.policy import drafter_order

    loaded = ["ngram", "ngram-tree", "suffix", "suffix-tree"]  # what the gguf runner has without a draft
    with pytest.raises(
        InvalidParameterError, match=r"loaded: ngram, ngram-tree, suffix, suffix-tree\): layer skip .*--runner torch"
    ):
        drafter_order("layer-skip", loaded)
    with pytest.raises(
        InvalidParameterError,
        match=r"--eagle-head \(a file verispec train-head writes, or a published EAGLE-3 folder\)$",
    ):
        drafter_order("eagle", loaded)
    with pytest.raises(InvalidParameterError, match="with --draft$"):
        drafter_order("draft", loaded)
