"""Test doubles and tiny models shared by the tests (no downloads, seeded)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from verispec.algorithms.sampling import SamplingParams, logits_to_probs
from verispec.engine import SpeculativeEngine
from verispec.proposers import DraftRequest
from verispec.proposers.draft_model import DraftModelProposer
from verispec.runners import Runner
from verispec.runners.torch_runner import TransformersRunner

TESTS = Path(__file__).resolve().parent  # the suite's root folder; its test folders mirror the package
REPO = TESTS.parent
VOCAB = 96


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    """Tiny tensors in one thread: on a busy 2-core machine every multi-threaded op waits for a
    descheduled worker (measured: tiny-model generation 50x slower with 2 threads under load).
    Import it into a test module to apply it there."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def tiny_qwen2(seed: int, vocab_size: int = VOCAB, num_layers: int = 2) -> Qwen2ForCausalLM:
    """A randomly initialised fp32 Qwen2 (hidden 32) whose argmax varies with context."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():  # larger logits than the default init so sampling is not near-uniform
        model.lm_head.weight.mul_(40.0)
    return model.eval()


def greedy_continuations(
    model: Qwen2ForCausalLM, seed: int, num: int = 48, prompt_tokens: int = 4, new_tokens: int = 28
) -> list[list[int]]:
    """``num`` sequences: random ``prompt_tokens``-token prompts and ``model``'s greedy continuation
    of ``new_tokens`` tokens (its own outputs: what an EAGLE head trains on)."""
    ids = torch.randint(0, model.config.vocab_size, (num, prompt_tokens), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        for _ in range(new_tokens):
            ids = torch.cat([ids, model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids.tolist()


def perturbed_copy(model: Qwen2ForCausalLM, noise: float, seed: int) -> Qwen2ForCausalLM:
    """The same model with Gaussian noise on every weight: a draft that agrees sometimes."""
    copy = Qwen2ForCausalLM(model.config)
    copy.load_state_dict(model.state_dict())
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in copy.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * noise * p.std())
    return copy.eval()


class CharTokenizer:
    """Decodes id i to ``pieces[i]``; enough of a tokenizer for the output builder."""

    def __init__(self, pieces: Sequence[str]) -> None:
        self.pieces = list(pieces)

    def decode(self, token_ids, skip_special_tokens: bool = True) -> str:
        return "".join(self.pieces[t] for t in token_ids)


def default_pieces(vocab_size: int = VOCAB) -> list[str]:
    return [chr(ord("!") + i) for i in range(vocab_size)]


class BigramRunner(Runner):
    """Runner test double: row i of the logits is ``table[token_i]`` (depends on one token)."""

    def __init__(self, table: torch.Tensor, max_context_length: int = 512) -> None:
        self.table = table.float()
        self.vocab_size = table.shape[1]
        self.max_context_length = max_context_length
        self.token_ids: list[int] = []
        self.num_forwards = 0

    @property
    def num_cached_tokens(self) -> int:
        return len(self.token_ids)

    def forward(self, token_ids, num_logits=None):
        assert len(self.token_ids) + len(token_ids) <= self.max_context_length
        self.token_ids.extend(token_ids)
        self.num_forwards += 1
        rows = self.table[torch.tensor(list(token_ids))]
        return rows[-num_logits:] if num_logits else rows

    def truncate(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= len(self.token_ids):
            raise ValueError("bad truncate")
        del self.token_ids[num_tokens:]


class BigramTreeRunner(BigramRunner):
    """A :class:`BigramRunner` that also verifies token trees (each node's row from its own token)."""

    def forward_tree(self, token_ids, position_ids, attention_mask):
        return self.forward(token_ids)

    def keep_tree_path(self, num_prefix, nodes):
        kept = [self.token_ids[num_prefix + i] for i in nodes]
        del self.token_ids[num_prefix:]
        self.token_ids.extend(kept)


def chain_table(next_of: dict[int, int], vocab_size: int, strength: float = 20.0) -> torch.Tensor:
    """Bigram logits where token a is followed by ``next_of[a]`` (others stay at 0)."""
    table = torch.zeros(vocab_size, vocab_size)
    for a, b in next_of.items():
        table[a, b] = strength
    return table


def make_engine(
    target_model, draft_model=None, eos_token_ids=(), pieces=None, *, max_context_length=None, proposers=None
) -> SpeculativeEngine:
    """Engine over tiny models; ``proposers`` adds drafters (e.g. layer skip) to the draft model."""
    proposers = dict(proposers or {})
    if draft_model is not None:
        proposers["draft"] = DraftModelProposer(TransformersRunner(draft_model, max_context_length=max_context_length))
    vocab = target_model.config.vocab_size
    return SpeculativeEngine(
        TransformersRunner(target_model, max_context_length=max_context_length),
        CharTokenizer(pieces or default_pieces(vocab)),
        eos_token_ids=eos_token_ids,
        proposers=proposers,
    )


class VocabTokenizer(CharTokenizer):
    """What the pipeline's compatibility check reads: length and vocabulary."""

    def __len__(self):
        return len(self.pieces)

    def get_vocab(self):
        return {piece: i for i, piece in enumerate(self.pieces)}


def cycle_engine(proposers=None, tree=False):
    """An engine over a noisy bigram target of 8 tokens that cycles 1, 2, 3, 4, 5, 1 (6 and 0 lead into
    it, 7 to 1); ``tree``: its runner verifies token trees."""
    table = torch.full((8, 8), -3.0)
    for a, b in {1: 2, 2: 3, 3: 4, 4: 5, 5: 1, 6: 2, 7: 1, 0: 3}.items():
        table[a, b] = 3.0
    runner = (BigramTreeRunner if tree else BigramRunner)(
        table + torch.randn(8, 8, generator=torch.Generator().manual_seed(0))
    )
    return SpeculativeEngine(runner, CharTokenizer("abcdefgh"), eos_token_ids=[], proposers=proposers or {})


def draft_request(prompt, output=()) -> DraftRequest:
    """A drafter's request: ``prompt``, ``output`` so far, default sampling."""
    return DraftRequest(list(prompt), list(output), SamplingParams(), torch.Generator())


def sequence_distribution(table: torch.Tensor, params: SamplingParams, first: int, length: int) -> dict:
    """Exact probability of each continuation of ``first`` under a bigram target."""
    probs = logits_to_probs(table, params)
    dist = {(): 1.0}
    for _ in range(length):
        dist = {
            seq + (t,): p * float(probs[seq[-1] if seq else first, t])
            for seq, p in dist.items()
            for t in range(table.shape[0])
        }
    return dist
