"""The training data of an EAGLE head (training/data.py): the target's answers end with the EOS token
when they ended their turn (the engine's outputs leave it out), and Magpie keeps exactly the
instructions the target finished."""

import pytest

from helpers import BigramRunner, CharTokenizer, chain_table
from verispec.algorithms.sampling import SamplingParams
from verispec.engine import SpeculativeEngine
from verispec.errors import InvalidParameterError
from verispec.training.data import generate_all, magpie_instructions, magpie_prefix

EOS = 3
PIECES = ["<s>", "U:", "\n", "<eos>", "Write ", "a ", "sort", "!"]
CHAIN = {2: 4, 4: 5, 5: 6, 6: EOS, 7: 7}  # after the prefix's "\n": "Write a sort" <eos>; "!" repeats for ever


class ChatTokenizer(CharTokenizer):
    """A chat template '<s>U:\\n{content}<eos>' over one-character pieces."""

    chat_template = "<s>U:\\n{content}<eos>"

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        return "<s>U:\n" + messages[0]["content"] + "<eos>"

    def encode(self, text, add_special_tokens=False):
        ids, rest = [], text
        while rest:
            piece = max((p for p in self.pieces if rest.startswith(p)), key=len)
            ids.append(self.pieces.index(piece))
            rest = rest[len(piece) :]
        return ids


def engine(next_of=CHAIN):
    return SpeculativeEngine(
        BigramRunner(chain_table(next_of, len(PIECES), strength=40.0)), ChatTokenizer(PIECES), eos_token_ids=[EOS]
    )


def test_answers_that_ended_their_turn_end_with_eos_and_cut_ones_do_not():
    outputs = generate_all(engine(), [[2], [7], [4]], lambda i: SamplingParams(max_tokens=6))
    assert outputs == [[4, 5, 6, EOS], [7] * 6, [5, 6, EOS]]


def test_magpie_keeps_the_instructions_the_target_finished():
    tokenizer = ChatTokenizer(PIECES)
    assert magpie_prefix(tokenizer) == [0, 1, 2]
    texts = magpie_instructions(engine(), tokenizer, 3, seed=0, max_tokens=12)
    assert texts == ["Write a sort"] * 3
    long_chain = {2: 4, 4: 5, 5: 6, 6: 7, 7: 4}  # "Write a sort!Write a ..." never ends its turn
    assert magpie_instructions(engine(long_chain), tokenizer, 2, seed=0, max_tokens=12) == []


def test_magpie_needs_a_chat_template():
    with pytest.raises(InvalidParameterError, match="need a chat template"):
        magpie_prefix(CharTokenizer(PIECES))
