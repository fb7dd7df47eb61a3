"""Tests of the draft/target compatibility check, on tiny tokenizers built in code."""

from __future__ import annotations

import time

import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

from verispec.errors import IncompatibleDraftError
from verispec.models.compat import check_draft_compatibility

BASE_TOKENS = ["<unk>", "<eos>", "<eot>", "def", "return", "abc", "(", ")", ":", "x"]
EOS = 1


def make_tokenizer(tokens: list[str]) -> PreTrainedTokenizerFast:
    vocab = {token: token_id for token_id, token in enumerate(tokens)}
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>")


def replaced(tokens: list[str], token_id: int, token: str) -> list[str]:
    return tokens[:token_id] + [token] + tokens[token_id + 1 :]


N = len(BASE_TOKENS)

# (why, draft tokens, target logits width, draft logits width, target eos, draft eos)
COMPATIBLE = [
    ("same tokenizer, same widths", BASE_TOKENS, N, N, (EOS,), (EOS,)),
    ("padding rows only: widths differ but both cover the tokenizer", BASE_TOKENS, N + 6, N + 2, (EOS,), (EOS,)),
    ("same EOS set in another order", BASE_TOKENS, N, N, (EOS, 2), (2, EOS)),
]

INCOMPATIBLE = [
    (
        "token 5 spelled differently",
        replaced(BASE_TOKENS, 5, "xyz"),
        N,
        N,
        (EOS,),
        (EOS,),
        "id 5 is 'abc' in the target and 'xyz' in the draft",
    ),
    (
        "draft has an extra token",
        BASE_TOKENS + ["extra"],
        N,
        N + 1,
        (EOS,),
        (EOS,),
        r"id 10 is absent in the target and 'extra' in the draft \(it has 11 tokens, the target 10\)",
    ),
    (
        "different tokenizer and size",
        ["<s>"] + BASE_TOKENS,
        N,
        N + 1,
        (EOS,),
        (EOS,),
        r"id 0 is '<unk>' in the target and '<s>' in the draft \(it has 11 tokens",
    ),
    (
        "draft lacks the target's last token",
        BASE_TOKENS[:-1],
        N,
        N - 1,
        (EOS,),
        (EOS,),
        r"id 9 is 'x' in the target and absent in the draft \(it has 9 tokens, the target 10\)",
    ),
    (
        "same size, one token renamed: the size alone would pass",
        replaced(BASE_TOKENS, 9, "y"),
        N,
        N,
        (EOS,),
        (EOS,),
        "id 9 is 'x' in the target and 'y' in the draft; the draft must use the target's tokenizer",
    ),
    (
        "different EOS ids",
        BASE_TOKENS,
        N,
        N,
        (EOS,),
        (2,),
        r"draft EOS token ids \[2 '<eot>'\] differ from the target's \[1 '<eos>'\]",
    ),
    ("draft stops on one more id", BASE_TOKENS, N, N, (EOS,), (EOS, 2), "draft EOS token ids"),
    (
        "draft logits narrower than the tokenizer",
        BASE_TOKENS,
        N,
        N - 1,
        (EOS,),
        (EOS,),
        "draft logits width 9 is smaller than its tokenizer",
    ),
    (
        "target logits narrower than the tokenizer",
        BASE_TOKENS,
        N - 3,
        N,
        (EOS,),
        (EOS,),
        "target logits width 7 is smaller than its tokenizer",
    ),
]


def check(draft_tokens, target_width, draft_width, target_eos, draft_eos, target_tokens=None):
    check_draft_compatibility(
        make_tokenizer(target_tokens or BASE_TOKENS),
        make_tokenizer(draft_tokens),
        target_vocab_size=target_width,
        draft_vocab_size=draft_width,
        target_eos_token_ids=target_eos,
        draft_eos_token_ids=draft_eos,
    )


@pytest.mark.parametrize(
    "why, draft_tokens, target_width, draft_width, target_eos, draft_eos",
    COMPATIBLE,
    ids=[case[0] for case in COMPATIBLE],
)
def test_compatible(why, draft_tokens, target_width, draft_width, target_eos, draft_eos):
    assert check(draft_tokens, target_width, draft_width, target_eos, draft_eos) is None


@pytest.mark.parametrize(
    "why, draft_tokens, target_width, draft_width, target_eos, draft_eos, message",
    INCOMPATIBLE,
    ids=[case[0] for case in INCOMPATIBLE],
)
def test_incompatible(why, draft_tokens, target_width, draft_width, target_eos, draft_eos, message):
    with pytest.raises(IncompatibleDraftError, match=message):
        check(draft_tokens, target_width, draft_width, target_eos, draft_eos)


def test_qwen_sized_vocabulary_is_checked_quickly():
    # 151936-token tokenizers with 152064-row logits (Qwen's padding), the last token differing
    tokens = ["<unk>", "<eos>"] + [f"t{i}" for i in range(2, 151_936)]
    target, draft = make_tokenizer(tokens), make_tokenizer(replaced(tokens, 151_935, "other"))
    start = time.perf_counter()
    check_draft_compatibility(
        target,
        target,
        target_vocab_size=152_064,
        draft_vocab_size=151_936,
        target_eos_token_ids=(1,),
        draft_eos_token_ids=(1,),
    )
    with pytest.raises(IncompatibleDraftError, match="id 151935 is 't151935' in the target"):
        check_draft_compatibility(
            target,
            draft,
            target_vocab_size=152_064,
            draft_vocab_size=152_064,
            target_eos_token_ids=(1,),
            draft_eos_token_ids=(1,),
        )
    assert time.perf_counter() - start < 2.0  # ~0.3 s here for both checks
