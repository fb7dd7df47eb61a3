"""The OpenAI features under speculation, with the official ``openai`` client against a live server:
logprobs / top_logprobs, echo, n and prompt lists, logit_bias, min_tokens, text offsets. Every
speculative method must give exactly what plain decoding (``"speculative": {"method": "none"}``)
gives: the same tokens and the same logprobs. Structured outputs and tools are
tests/server/test_server_structured.py's; the client and request helpers are tests/openai_client.py's.
"""

from __future__ import annotations

import pytest

from openai_client import (
    EOS,
    LOGPROB_TOLERANCE,
    METHODS,
    assert_same,
    chat,
    chat_view,
    client,
    completion,
    completion_view,
    difference,
)

# ----- logprobs -----


@pytest.mark.parametrize(
    "got, expected, same",
    [
        # either side of the 4th decimal's rounding boundary, 2e-11 apart: rounding called them different
        ([("He", -0.123449999999)], [("He", -0.12345000001)], True),
        ([("He", -0.1234)], [("He", -0.1234 - LOGPROB_TOLERANCE / 2)], True),  # inside the stated tolerance
        ([("He", -0.1234)], [("He", -0.1234 - 3 * LOGPROB_TOLERANCE)], False),  # outside it
        ([("He", -0.5)], [("Hi", -0.5)], False),  # another token: never within a tolerance
        ([{"a": -0.1, "b": -2.0}], [{"a": -0.1, "c": -2.0}], False),  # another top-logprob token
        ([None, -0.1], [-0.1, -0.1], False),  # a missing logprob is not a number near one
        ([("He", -0.1)], [("He", -0.1), ("llo", -0.2)], False),  # one entry fewer
    ],
)
def test_logprobs_compare_within_the_stated_tolerance(got, expected, same):
    # issue 54, item 10: views rounded to 4 decimals failed, in some test orders, on float values whose
    # last bits differ between a k-row verify pass and a 1-row step
    assert (difference(got, expected) is None) == same


@pytest.mark.parametrize("method", METHODS)
def test_completion_logprobs_equal_plain_decoding(client, method):
    plain = completion(client, "none", logprobs=3)
    got = completion(client, method, logprobs=3)
    assert_same(completion_view(got), completion_view(plain))
    lp = plain.choices[0].logprobs
    assert len(lp.tokens) == plain.usage.completion_tokens == 24  # one entry per emitted token
    assert "He" in lp.tokens and any(t.startswith("bytes:\\x") for t in lp.tokens)  # part of a character
    assert all(v <= 0 for v in lp.token_logprobs) and all(len(top) == 3 for top in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])


@pytest.mark.parametrize("method", METHODS)
def test_chat_logprobs_equal_plain_decoding(client, method):
    plain = chat(client, "none", logprobs=True, top_logprobs=2)
    assert_same(chat_view(chat(client, method, logprobs=True, top_logprobs=2)), chat_view(plain))
    entries = plain.choices[0].logprobs.content
    assert len(entries) == plain.usage.completion_tokens
    # greedy: the emitted token is the most likely one, and its bytes rebuild the text
    assert all(e.top_logprobs[0].logprob == e.logprob for e in entries)
    assert bytes(b for e in entries for b in e.bytes).decode(errors="replace") == plain.choices[0].message.content


@pytest.mark.parametrize("method", ["none", "draft"])
def test_streamed_logprobs_equal_the_whole_response(client, method):
    whole = chat(client, method, logprobs=True, top_logprobs=1)
    streamed = []
    for chunk in chat(client, method, logprobs=True, top_logprobs=1, stream=True):
        for choice in chunk.choices:
            if choice.logprobs is not None:
                streamed += [(e.token, e.logprob) for e in choice.logprobs.content]
    assert_same(streamed, [(e.token, e.logprob) for e in whole.choices[0].logprobs.content])


def test_echo_with_logprobs_scores_the_prompt(client):
    response = completion(client, "draft", prompt="Hello 你", echo=True, logprobs=1, max_tokens=4)
    choice = response.choices[0]
    assert choice.text.startswith("Hello 你")
    prompt_tokens = response.usage.prompt_tokens
    assert choice.logprobs.token_logprobs[0] is None  # the first prompt token has no context
    assert all(v is not None and v <= 0 for v in choice.logprobs.token_logprobs[1:])
    assert len(choice.logprobs.tokens) == prompt_tokens + 4
    plain = completion(client, "none", prompt="Hello 你", echo=True, logprobs=1, max_tokens=4)
    assert_same(completion_view(response), completion_view(plain))


# ----- n and prompt lists -----


@pytest.mark.parametrize("method", ["none", "draft"])  # auto's drafter choice depends on what the engine learnt
def test_n_and_prompt_lists_give_each_choice_its_own_generator(client, method):
    kwargs = {"prompt": ["Hello", "你好"], "n": 3, "temperature": 0.8, "seed": 11, "max_tokens": 12}
    got = completion(client, method, **kwargs)
    assert [c.index for c in got.choices] == list(range(6))
    texts = [c.text for c in got.choices]
    assert len(set(texts[:3])) > 1  # seeds 11, 12, 13: different samples
    # choice i is the request with seed 11 + i alone
    for i, prompt in [(0, "Hello"), (4, "你好")]:
        alone = completion(client, method, prompt=prompt, temperature=0.8, seed=11 + i, max_tokens=12)
        assert alone.choices[0].text == texts[i]
    assert got.usage.completion_tokens == 6 * 12
    assert got.usage.prompt_tokens == sum(
        completion(client, "none", prompt=p, max_tokens=1).usage.prompt_tokens for p in kwargs["prompt"]
    )


def test_streamed_choices_carry_their_index(client):
    texts = {}
    for chunk in completion(client, "draft", prompt=["Hello", "你好"], n=2, max_tokens=8, stream=True):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    whole = completion(client, "draft", prompt=["Hello", "你好"], n=2, max_tokens=8)
    assert texts == {c.index: c.text for c in whole.choices}


# ----- logit_bias, min_tokens -----


@pytest.mark.parametrize("method", METHODS)
def test_logit_bias_applies_to_every_verify_row(client, method):
    # Ban the greedy path's next token and boost another: every step changes.
    plain = completion(client, "none", logit_bias={"72": -100, "101": 20}, logprobs=1)
    got = completion(client, method, logit_bias={"72": -100, "101": 20}, logprobs=1)
    assert_same(completion_view(got), completion_view(plain))
    assert difference(completion_view(plain), completion_view(completion(client, "none", logprobs=1))) is not None


@pytest.mark.parametrize("method", METHODS)
def test_min_tokens_masks_eos_exactly_until_the_output_is_long_enough(client, method):
    boost = {EOS: 100}  # EOS as soon as it is allowed
    assert completion(client, method, logit_bias=boost).usage.completion_tokens == 0
    for min_tokens in (1, 3, 5):
        plain = completion(client, "none", logit_bias=boost, min_tokens=min_tokens, logprobs=0)
        got = completion(client, method, logit_bias=boost, min_tokens=min_tokens, logprobs=0)
        assert_same(completion_view(got), completion_view(plain))
        assert got.usage.completion_tokens == min_tokens and got.choices[0].finish_reason == "stop"


# ----- edge cases found by trying to break it -----


def test_seeds_of_later_choices_wrap_and_the_server_keeps_serving(client):
    got = completion(client, "draft", n=3, temperature=1.0, seed=2**64 - 2, max_tokens=6)
    assert len(got.choices) == 3
    assert completion(client, "none", max_tokens=2).usage.completion_tokens == 2  # still serving


def test_text_offsets_count_characters_of_the_text(client):
    got = completion(client, "none", max_tokens=12, logprobs=0)
    lp, text = got.choices[0].logprobs, got.choices[0].text
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] <= len(text)


def test_streamed_echo_sends_the_prompts_logprobs_first(client):
    whole = completion(client, "draft", prompt="Hello 你", echo=True, logprobs=1, max_tokens=4)
    tokens, values = [], []
    for chunk in completion(client, "draft", prompt="Hello 你", echo=True, logprobs=1, max_tokens=4, stream=True):
        for choice in chunk.choices:
            if choice.logprobs is not None:
                tokens += choice.logprobs.tokens
                values += choice.logprobs.token_logprobs
    assert tokens == whole.choices[0].logprobs.tokens
    assert_same(values, whole.choices[0].logprobs.token_logprobs)
    assert values[0] is None
