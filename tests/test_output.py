"""Stops (EOS, stop strings, max_tokens), streaming hold-back and incremental UTF-8 decoding."""

import pytest

from helpers import CharTokenizer
from verispec.output import OutputBuilder, find_earliest_stop, stop_prefix_holdback

PIECES = ["<eos>", "a", "b", "c", "END", "x", "E", "ND", "y"]
EOS = 0


def build(stop=(), max_tokens=100, ignore_eos=False):
    return OutputBuilder(
        CharTokenizer(PIECES), eos_token_ids=[EOS], stop=stop, max_tokens=max_tokens, ignore_eos=ignore_eos
    )


def feed(out, tokens):
    for t in tokens:
        if out.append(t):
            break
    return out


@pytest.mark.parametrize(
    "tokens, stop, max_tokens, text, ids, reason",
    [
        ([1, 2, 0, 3], (), 100, "ab", [1, 2], "stop"),  # EOS inside a block: nothing after it
        ([1, 6, 7, 3], ("END",), 100, "a", [1, 6, 7], "stop"),  # stop string spans two tokens
        ([1, 5, 2, 4, 3], ("END", "x"), 100, "a", [1, 5], "stop"),  # later-listed stop occurs first
        ([1, 2, 3, 1, 2], (), 3, "abc", [1, 2, 3], "length"),  # max_tokens inside a block
        ([1, 2, 3], ("bc", "c"), 100, "a", [1, 2, 3], "stop"),  # token 3 completes both: earliest wins
    ],
)
def test_stop_table(tokens, stop, max_tokens, text, ids, reason):
    out = feed(build(stop, max_tokens), tokens)
    assert (out.text, out.token_ids, out.finish_reason) == (text, ids, reason)


def test_ignore_eos_keeps_going():
    out = feed(build(ignore_eos=True, max_tokens=3), [1, 0, 2])
    assert out.token_ids == [1, 0, 2] and out.finish_reason == "length"


def test_find_earliest_stop_and_holdback():
    assert find_earliest_stop("xab", ["b", "a"], 0) == 1
    assert find_earliest_stop("xab", ["q"], 0) is None
    assert stop_prefix_holdback("abcEN", ["END"]) == 2
    assert stop_prefix_holdback("abcE", ["END", "Ex"]) == 1
    assert stop_prefix_holdback("abc", ["END"]) == 0


def test_stream_holds_back_possible_stop_then_releases():
    out = build(stop=("END",))
    deltas = []
    for t in [1, 6]:  # "a", "E": "E" might start "END"
        out.append(t)
        deltas.append(out.take_delta())
    assert deltas == ["a", ""]
    out.append(2)  # "Eb" can no longer become "END"
    deltas.append(out.take_delta())
    assert deltas == ["a", "", "Eb"]
    assert "".join(deltas) == out.text


class ByteTokenizer:
    """Each token is one UTF-8 byte; decode replaces incomplete sequences like HF does."""

    def decode(self, token_ids, skip_special_tokens=True):
        return bytes(token_ids).decode("utf-8", errors="replace")


def test_multibyte_characters_split_across_tokens_stream_whole():
    text = "héllo 世界 🙂"
    ids = list(text.encode("utf-8"))
    out = OutputBuilder(ByteTokenizer(), eos_token_ids=[], max_tokens=len(ids))
    deltas = []
    for t in ids:
        out.append(t)
        deltas.append(out.take_delta())
    assert "".join(deltas) == text == out.text
    assert all("\ufffd" not in d for d in deltas)
    assert "界" in deltas  # emitted whole once its three bytes arrived


def test_incomplete_utf8_at_length_limit_is_flushed():
    ids = list("世".encode())[:2]
    out = feed(OutputBuilder(ByteTokenizer(), eos_token_ids=[], max_tokens=2), ids)
    assert out.finish_reason == "length" and out.text == "\ufffd"
