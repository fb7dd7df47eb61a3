"""TokenConstraints: the masks of a verify pass's rows are the masks of the plain steps at those
points (min_tokens row by row; the grammar along the draft), and a draft's valid prefix."""

from __future__ import annotations

import pytest
import torch

from server_support import build_tokenizer
from verispec.algorithms.sampling import SamplingParams, process_logits
from verispec.engine.constraints import GrammarCompiler, StructuredOutput, TokenConstraints
from verispec.errors import InvalidParameterError

EOS = 7


def test_min_tokens_masks_eos_in_exactly_the_short_rows():
    constraints = TokenConstraints(10, (EOS,), min_tokens=3)
    rows = constraints.masks(1, [4, 5, 6])  # rows for output lengths 1, 2, 3, 4
    assert rows[:, EOS].tolist() == [False, False, True, True]
    assert rows[:, :EOS].all() and rows[:, EOS + 1 :].all()
    assert constraints.masks(3, [4]) is None  # long enough: nothing to mask
    assert constraints.valid_prefix_length(1, [4, EOS, 5]) == 1  # EOS at output length 2 < 3
    assert constraints.valid_prefix_length(2, [4, EOS]) == 2


def test_masked_rows_process_like_plain_steps():
    logits = torch.zeros(3, 10)
    logits[:, EOS] = 5.0  # EOS is the argmax everywhere
    allowed = TokenConstraints(10, (EOS,), min_tokens=2).masks(0, [1, 2])
    rows = process_logits(logits, SamplingParams(), [3], [], [1, 2], allowed)
    assert rows.greedy_token_ids.tolist()[2] == EOS and rows.greedy_token_ids.tolist()[0] != EOS
    with pytest.raises(ValueError, match="does not match"):
        process_logits(logits, SamplingParams(), [3], [], [1, 2], allowed[:2])


@pytest.fixture(scope="module")
def compiler():
    tokenizer = build_tokenizer()
    return tokenizer, GrammarCompiler(tokenizer, len(tokenizer), (tokenizer.eos_token_id,))


def test_grammar_rows_follow_the_draft_and_roll_back(compiler):
    tokenizer, grammar = compiler
    matcher = grammar.matcher(StructuredOutput("regex", "ab(c|d)"))
    constraints = TokenConstraints(len(tokenizer), (tokenizer.eos_token_id,), matcher=matcher)
    a, b, c, d, x = (tokenizer.convert_tokens_to_ids(ch) for ch in "abcdx")
    rows = constraints.masks(0, [a, b, c])
    assert rows[0].nonzero().flatten().tolist() == [a]
    assert rows[1].nonzero().flatten().tolist() == [b]
    assert sorted(rows[2].nonzero().flatten().tolist()) == sorted([c, d])
    assert rows[3].nonzero().flatten().tolist() == [tokenizer.eos_token_id]  # complete: only EOS
    assert constraints.masks(0)[0].nonzero().flatten().tolist() == [a]  # rolled back
    assert constraints.valid_prefix_length(0, [a, x, c]) == 1
    rows = constraints.masks(0, [a, x, c])  # after the refused x: rows allow all (never used)
    assert rows[2].all() and rows[3].all()
    constraints.commit([a, b])
    assert sorted(constraints.masks(2)[0].nonzero().flatten().tolist()) == sorted([c, d])


def test_tree_paths_get_their_own_masks(compiler):
    tokenizer, grammar = compiler
    constraints = TokenConstraints(len(tokenizer), (), matcher=grammar.matcher(StructuredOutput("regex", "(ab|ba)")))
    a, b = tokenizer.convert_tokens_to_ids("a"), tokenizer.convert_tokens_to_ids("b")
    rows = constraints.path_masks(0, [[], [a], [b], [a, a]])
    assert sorted(rows[0].nonzero().flatten().tolist()) == sorted([a, b])
    assert rows[1].nonzero().flatten().tolist() == [b] and rows[2].nonzero().flatten().tolist() == [a]
    assert rows[3].all()  # a refused path


def test_bad_grammars_are_clear_errors(compiler):
    _, grammar = compiler
    with pytest.raises(InvalidParameterError, match="does not compile"):
        grammar.matcher(StructuredOutput("regex", "("))
    with pytest.raises(InvalidParameterError, match="not valid JSON"):
        StructuredOutput("json_schema", "{")
    with pytest.raises(InvalidParameterError, match="unknown structured output"):
        StructuredOutput("xml", "<a/>")


def test_forced_tokens_are_the_bytes_the_grammar_allows_next(compiler):
    tokenizer, grammar = compiler
    constraints = TokenConstraints(
        len(tokenizer), (), matcher=grammar.matcher(StructuredOutput("regex", "hello world (1|2)!"))
    )
    forced = constraints.forced_tokens(64)
    assert tokenizer.decode(forced) == "hello world "  # then a choice: nothing more is forced
    assert constraints.forced_tokens(1) == forced[:1]
    assert constraints.masks(0)[0].nonzero().flatten().tolist() == [forced[0]]  # nothing consumed
    constraints.commit(forced)
    assert constraints.forced_tokens(64) == []
    assert TokenConstraints(len(tokenizer), ()).forced_tokens(64) == []  # no grammar


@pytest.mark.parametrize("method", ["ngram", "draft", "auto"])
@pytest.mark.parametrize("options", [{}, {"temperature": 0.9, "seed": 5}])
def test_grammar_forced_drafts_keep_plain_output(method, options):
    """Drafts the grammar forces (free, verified as any draft) leave the output plain decoding's,
    greedy and seeded; the request's statistics name them."""
    from server_support import tiny_pipeline
    from verispec.engine import SpeculativeConfig

    pipe = tiny_pipeline()
    regex = StructuredOutput("regex", r'\{"name": "[a-z]{1,6}", "city": "(Paris|Rome)", "zip": [0-9]{4}\}')
    params = SamplingParams(max_tokens=48, structured_output=regex, logprobs=1, **options)
    prompt = pipe.tokenizer.encode("hello")
    plain = pipe.engine.generate(prompt, params, SpeculativeConfig(method="none"))
    got = pipe.engine.generate(prompt, params, SpeculativeConfig(method=method, num_speculative_tokens=4))
    assert got.token_ids == plain.token_ids
    # the tiny pipeline runs on the torch runner: a verify row's logits are not bit-identical to a
    # one-token step's there (the gguf/int8 runners' are), so logprobs agree to float rounding
    assert [lp.logprob for lp in got.logprobs] == pytest.approx([lp.logprob for lp in plain.logprobs], abs=1e-5)
    forced = got.metrics.spec.per_drafter["grammar"]
    assert forced.num_draft_tokens >= 10 and forced.num_accepted_tokens >= 1
    assert "grammar" in got.token_sources and "grammar" not in plain.metrics.spec.per_drafter
