"""Static tree shapes (Medusa-style ``choices``) for the draft tree: shape, exactness, CLI."""

import json

import pytest
import torch
from typer.testing import CliRunner

from helpers import make_engine, single_thread
from verispec.algorithms.sampling import SamplingParams
from verispec.cli import app
from verispec.engine import SpeculativeConfig
from verispec.engine.loader import DrafterOptions
from verispec.errors import InvalidParameterError
from verispec.proposers import DraftRequest
from verispec.proposers.draft_tree import DraftTreeProposer, validate_tree_choices
from verispec.runners.torch_runner import TransformersRunner

runner = CliRunner()
CHOICES = [[0], [1], [0, 0], [0, 1], [0, 0, 0]]
WIDE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0], [0, 0, 0, 0, 0]]


@pytest.mark.parametrize(
    "choices, expected",
    [
        (CHOICES, ((0,), (1,), (0, 0), (0, 1), (0, 0, 0))),
        ([[0, 0], [1], [0]], ((0,), (1,), (0, 0))),  # any order in, tree order out
    ],
)
def test_validate_tree_choices(choices, expected):
    assert validate_tree_choices(choices) == expected


@pytest.mark.parametrize(
    "choices, message",
    [
        ([], "non-empty"),
        ({"a": 1}, "non-empty list"),
        ([[0], []], "non-empty list of ranks"),
        ([[0], [-1]], "ranks >= 0"),
        ([[0], [0.5]], "ranks >= 0"),
        ([[0], [0]], "repeated"),
        ([[0], [1, 0]], "needs its prefix [1]"),
        ([[0, 0, 0], [0]], "needs its prefix [0, 0]"),
    ],
)
def test_bad_tree_choices_are_refused(choices, message):
    with pytest.raises(InvalidParameterError, match=message.replace("[", r"\[").replace("]", r"\]")):
        validate_tree_choices(choices)
    with pytest.raises(InvalidParameterError):
        DrafterOptions(tree_choices=choices)


def request(prompt, output=()):
    return DraftRequest(list(prompt), list(output), SamplingParams(), torch.Generator())


def ranked(model, context):
    """Token ids after ``context`` by the model's probability, best first."""
    with torch.no_grad():
        logits = model(torch.tensor([context])).logits[0, -1]
    return torch.argsort(logits, descending=True).tolist()


def test_static_tree_has_exactly_the_shape(target_model):
    prompt = [5, 17, 33, 2, 9]
    proposer = DraftTreeProposer(TransformersRunner(target_model), choices=CHOICES)
    tree = proposer.propose_tree(request(prompt), num_nodes=16)
    assert tree.parents == (-1, 0, 0, 1, 1, 3)  # [0], [1], [0, 0], [0, 1], [0, 0, 0]
    root = ranked(target_model, prompt)
    assert tree.token_ids[1:3] == tuple(root[:2])  # rank 0 and rank 1 after the root
    after_best = ranked(target_model, prompt + [root[0]])
    assert tree.token_ids[3:5] == tuple(after_best[:2])
    assert tree.token_ids[5] == ranked(target_model, prompt + [root[0], after_best[0]])[0]
    # a smaller budget keeps the first paths of the shape; the cache was rolled back
    assert proposer.propose_tree(request(prompt), num_nodes=3).parents == (-1, 0, 0, 1)
    assert proposer.propose_tree(request(prompt), num_nodes=16) == tree


PROMPTS = [[5, 17, 33, 2, 9], [70, 3], [5, 17, 33, 2, 9, 5, 17, 33, 2]]


@pytest.mark.parametrize("num_nodes", range(1, 17))
def test_greedy_static_tree_equals_plain(num_nodes, target_model, partial_draft_model):
    plain = make_engine(target_model)
    engines = [
        make_engine(target_model, proposers={"tree": DraftTreeProposer(TransformersRunner(draft), choices=WIDE)})
        for draft in (target_model, partial_draft_model)
    ]
    for prompt in PROMPTS:
        expected = plain.generate(prompt, SamplingParams(max_tokens=24), SpeculativeConfig(method="none")).token_ids
        for engine in engines:
            out = engine.generate(
                prompt,
                SamplingParams(max_tokens=24),
                SpeculativeConfig(method="tree", num_speculative_tokens=num_nodes),
            )
            assert out.token_ids == expected, (prompt, num_nodes)


def test_cli_tree_choices_give_plain_output(checkpoints):
    base = [
        "generate",
        "def fib(n):",
        "--target",
        str(checkpoints["target"]),
        "--draft",
        str(checkpoints["draft"]),
        "--json",
        "--max-tokens",
        "16",
    ]
    outputs = {}
    for name, extra in (
        ("none", ["--method", "none"]),
        ("tree", ["--method", "tree", "--tree-choices", "[[0],[1],[0,0],[0,1],[0,0,0]]"]),
    ):
        result = runner.invoke(app, base + extra)
        assert result.exit_code == 0, result.output
        outputs[name] = json.loads(result.stdout.strip().splitlines()[-1])["token_ids"]
    assert outputs["tree"] == outputs["none"]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--method", "tree", "--tree-choices", "[[0], [1"], "not valid JSON"),
        (["--method", "tree", "--tree-choices", "[]"], "non-empty"),
        (["--method", "tree", "--tree-choices", "[[0], [1, 0]]"], "needs its prefix"),
        (["--method", "draft", "--tree-choices", "[[0]]"], "needs --method tree"),
    ],
)
def test_cli_bad_tree_choices_exit_2(checkpoints, extra, message):
    args = ["generate", "x = 1", "--target", str(checkpoints["target"]), "--draft", str(checkpoints["draft"])]
    result = runner.invoke(app, args + extra)
    assert result.exit_code == 2, result.output
    assert "error:" in result.output and message in result.output
    assert "Traceback" not in result.output
