"""The drafters' declarations (verispec.proposers.declared) and what is derived from them: the
methods, auto's order, the missing-drafter hints, the factory's trees over their chains."""

import pytest

from verispec.engine import methods
from verispec.errors import InvalidParameterError
from verispec.proposers import AutoRole, Declaration, Kind, Needs, Proposer, declared_drafters
from verispec.proposers.declared import register
from verispec.proposers.factory import chain_wrappers, for_new_sequence, with_lookup_drafters
from verispec.proposers.ngram import NgramProposer, NgramTreeProposer
from verispec.proposers.suffix import SuffixProposer, SuffixTreeProposer

DRAFTERS = declared_drafters()
# the package's own drafters; a drafter added in its own module comes in its priority's place
BUILT_IN = ["suffix", "suffix-tree", "ngram", "ngram-tree", "eagle", "eagle-tree", "draft", "tree", "layer-skip"]


def built_in(names):
    return tuple(name for name in names if name in BUILT_IN or name in ("none", "auto"))


def test_every_drafter_of_the_package_declares_itself_once():
    assert [
        name for name in DRAFTERS if name in BUILT_IN
    ] == BUILT_IN  # priority order: lookups first (suffix beats n-gram), then heads, draft models, layer skip
    for name, cls in DRAFTERS.items():
        assert cls.declaration.name == name and issubclass(cls, Proposer)


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_scores_own_drafts_is_declared_where_draft_confidences_is_implemented(name):
    cls = DRAFTERS[name]
    implements = cls.draft_confidences is not Proposer.draft_confidences
    assert cls.declaration.scores_own_drafts == implements


@pytest.mark.parametrize("name", [n for n, c in DRAFTERS.items() if c.declaration.kind is Kind.TREE])
def test_a_tree_names_a_declared_chain_and_a_wrapper_can_move_to_another_chain(name):
    declaration = DRAFTERS[name].declaration
    assert declaration.chain in DRAFTERS and DRAFTERS[declaration.chain].declaration.kind is not Kind.TREE
    if declaration.wraps_chain:
        assert callable(getattr(DRAFTERS[name], "over", None))


def test_the_methods_are_none_auto_and_each_selectable_drafter():
    assert built_in(methods.METHODS) == (
        "none",
        "auto",
        "suffix",
        "ngram",
        "eagle",
        "eagle-tree",
        "draft",
        "tree",
        "layer-skip",
    )
    assert built_in(methods.LOOKUP_DRAFTERS) == ("suffix", "ngram")
    assert built_in(methods.MODEL_DRAFTERS) == ("eagle", "draft")
    assert built_in(methods.ALTERNATIVE_DRAFTERS) == ("eagle", "eagle-tree", "draft", "tree")
    assert built_in(methods.TREE_DRAFTERS) == ("ngram-tree", "tree")
    assert set(built_in(methods.TREE_SCHEDULED)) == {"suffix-tree", "ngram-tree", "eagle-tree", "tree"}
    assert built_in(methods.HEAD_DRAFTERS) == ("eagle", "eagle-tree")
    assert built_in(methods.DRAFT_MODEL_DRAFTERS) == ("draft", "tree")
    assert set(built_in(methods.MISSING_DRAFTER_HINTS)) == {"eagle", "eagle-tree", "draft", "tree", "layer-skip"}
    assert "--eagle-head" in methods.MISSING_DRAFTER_HINTS["eagle"]
    assert "--draft" in methods.MISSING_DRAFTER_HINTS["draft"]


ALL = ["suffix", "suffix-tree", "ngram", "ngram-tree", "eagle", "eagle-tree", "draft", "tree", "layer-skip"]


@pytest.mark.parametrize(
    ("method", "loaded", "trees", "order"),
    [
        ("none", ALL, True, []),
        ("auto", ALL, True, ["suffix", "eagle", "eagle-tree", "draft", "tree"]),  # each model drafter, then its tree
        ("auto", ALL, False, ["suffix", "eagle", "draft"]),  # no trees on a runner without them
        ("auto", ["ngram", "draft", "layer-skip"], True, ["ngram", "draft"]),  # n-gram where no suffix drafter
        ("auto", ["ngram", "layer-skip"], True, ["ngram", "layer-skip"]),  # layer skip only as the fallback
        ("suffix", ALL, True, ["suffix-tree"]),  # the suffix method drafts its scored tree where trees verify
        ("suffix", ALL, False, ["suffix"]),
        ("ngram", ALL, True, ["ngram"]),  # n-gram's tree only inside method tree
        ("tree", ALL, True, ["ngram-tree", "tree"]),  # lookup branches first
        ("tree", ["ngram", "ngram-tree"], True, ["ngram-tree"]),  # no draft model: the lookup's tree alone
        ("eagle-tree", ALL, True, ["eagle-tree"]),
    ],
)
def test_drafter_order_reads_the_declarations(method, loaded, trees, order):
    assert methods.drafter_order(method, loaded, trees) == order


@pytest.mark.parametrize(
    ("method", "hint"), [("draft", "--draft"), ("eagle", "--eagle-head"), ("layer-skip", "--runner torch")]
)
def test_a_missing_drafter_names_what_loads_it(method, hint):
    with pytest.raises(InvalidParameterError, match=hint):
        methods.drafter_order(method, ["ngram", "suffix"])


@pytest.mark.parametrize(
    ("method", "draft_model", "head", "trees"),
    [
        ("auto", True, False, False),
        ("draft", True, False, False),
        ("tree", True, False, True),
        ("eagle", False, True, False),
        ("eagle-tree", False, True, True),
        ("ngram", False, False, False),
        ("none", False, False, False),
    ],
)
def test_what_a_method_needs_loaded(method, draft_model, head, trees):
    assert methods.uses_draft_model(method) == draft_model
    assert methods.needs_head(method) == head
    assert methods.needs_trees(method) == trees


def test_lookup_drafters_and_their_trees_are_added_from_the_declarations():
    drafters = with_lookup_drafters({})
    assert set(built_in(drafters)) == {"suffix", "suffix-tree", "ngram", "ngram-tree"}
    free = {
        n for n, c in DRAFTERS.items() if c.declaration.kind is Kind.LOOKUP and c.declaration.needs is Needs.NOTHING
    }
    assert free <= set(drafters)  # every lookup needing nothing, built with no arguments
    assert isinstance(drafters["ngram-tree"], NgramTreeProposer) and drafters["ngram-tree"].ngram is drafters["ngram"]
    assert isinstance(drafters["suffix-tree"], SuffixTreeProposer)
    assert drafters["suffix-tree"].suffix is drafters["suffix"]
    assert set(built_in(chain_wrappers(DRAFTERS))) == {
        "ngram-tree",
        "suffix-tree",
        "eagle-tree",
    }  # the draft tree has its own runner
    fresh = for_new_sequence(drafters)
    assert fresh["ngram-tree"].ngram is fresh["ngram"] is not drafters["ngram"]  # the tree follows the new chain
    assert isinstance(fresh["suffix"], SuffixProposer) and fresh["suffix-tree"].suffix is fresh["suffix"]


def test_the_policy_asks_a_drafter_whether_it_scores_its_drafts():
    assert SuffixProposer().scores_own_drafts and not NgramProposer().scores_own_drafts
    with pytest.raises(NotImplementedError, match="does not score"):
        NgramProposer().draft_confidences(None, 3, 0.5)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"name": "t", "kind": Kind.TREE}, "names its chain"),  # a tree without its chain
        ({"name": "c", "kind": Kind.LOOKUP, "chain": "ngram"}, "names its chain"),  # a chain naming one
    ],
)
def test_an_inconsistent_declaration_is_refused(fields, message):
    with pytest.raises(InvalidParameterError, match=message):
        Declaration(**fields)


def test_two_classes_declaring_one_name_are_refused():
    class Twin(Proposer):
        pass

    Twin.declaration = Declaration("ngram", Kind.LOOKUP, Needs.NOTHING, auto=AutoRole.NONE)
    with pytest.raises(InvalidParameterError, match="declared by both"):
        register(Twin)
    assert declared_drafters()["ngram"] is NgramProposer  # the table is unchanged
