"""Which of ``auto``'s drafters are tried first in a step: its model drafters ranked by the
tokens per unit of time they have realised, and its lookup priced against them.

Owns the ranking's state for one request (the periodic re-check of the drafters that are not the
best) and the rule that lets a lookup sit a step out for a model drafter; the realised rates
themselves are the engine's (:attr:`verispec.algorithms.control.CostModel.drafter_rate`, kept
across requests). :class:`verispec.engine.policy.DraftPolicy` asks it for each step's order.
Knows nothing about drafting itself: it sees names, rates and predictions.
"""

from __future__ import annotations

from collections.abc import Sequence

from verispec.algorithms.control import ControllerConfig, CostModel
from verispec.engine.methods import ALTERNATIVE_DRAFTERS, FALLBACK_DRAFTERS, LOOKUP_DRAFTERS


class DrafterRanking:
    """The order one request's drafters are tried in, step by step.

    Args:
        names: the request's drafters, in the order of its method
            (:func:`verispec.engine.methods.drafter_order`).
        costs: the engine's measured costs (``drafter_rate`` read and recorded here).
        config: ``probe_interval`` and ``lookups_against_models``.
    """

    def __init__(self, names: Sequence[str], costs: CostModel, config: ControllerConfig) -> None:
        self.names = list(names)
        self.costs = costs
        alternatives = [name for name in ALTERNATIVE_DRAFTERS if name in self.names]
        self.alternatives = tuple(alternatives) if len(alternatives) > 1 else ()  # ranked against each other
        self.models = (*alternatives, *(name for name in FALLBACK_DRAFTERS if name in self.names))
        self._probe_interval = config.probe_interval
        self._lookups_against_models = config.lookups_against_models
        self._explore_steps = 0  # > 0: steps left trying an alternative that is not the best
        self._exploring = ""  # that alternative
        self._num_choices = 0
        self.num_outrun_lookups = 0  # steps a lookup sat out: a model drafter's realised rate beat its prediction

    def step_order(self) -> list[str]:
        """The drafters to try this step: the method's order, the alternatives (``auto``'s model
        drafters: EAGLE head, draft chain, draft tree) in their places ranked by
        :meth:`rank_alternatives`. The first that drafts wins, so an alternative whose own
        schedule sits the step out (its cost model expects no gain) hands it to the next."""
        if not self.alternatives:
            return list(self.names)
        ranked = iter(self.rank_alternatives())
        return [next(ranked) if name in self.alternatives else name for name in self.names]

    def rank_alternatives(self) -> list[str]:
        """``auto``'s model drafters, best first, for this step.

        Alternatives with no realised rate yet come first (in the method's order); then by
        realised tokens per plain-step cost (:meth:`CostModel.record_rate`, steady steps only,
        kept across requests), except that every ``probe_interval`` choices one of the others
        (in turn) goes first for two steps (the first pays for catching up on skipped tokens and
        is not recorded), so a change in the text or the machine can change the ranking. A weak
        EAGLE head thus loses the steps to the draft model once both are rated.
        """
        rates = self.costs.drafter_rate
        untried = [name for name in self.alternatives if name not in rates]
        tried = sorted((name for name in self.alternatives if name in rates), key=rates.__getitem__, reverse=True)
        self._num_choices += 1
        if self._explore_steps == 0 and not untried and self._num_choices % self._probe_interval == 0:
            self._explore_steps = 2
            others = tried[1:]
            self._exploring = others[(self._num_choices // self._probe_interval - 1) % len(others)]
        ranked = untried + tried
        if self._explore_steps > 0:
            self._explore_steps -= 1
            ranked.remove(self._exploring)
            ranked.insert(0, self._exploring)
        return ranked

    def record(self, drafter: str | None, realised: tuple[float, float]) -> None:
        """A steady step of ``drafter`` emitted ``realised[0]`` tokens at ``realised[1]`` plain
        steps of cost: a model drafter's rate moves (:meth:`CostModel.record_rate`).

        A step of the best-rated alternative moves the other alternatives' rates by the same
        factor: they were measured on earlier text, and the leader's realised rate is what says
        how hard the text is now. Without it a stretch of hard text that the leader drafts
        badly hands the steps to an alternative rated on easy text, until a probe re-measures
        the leader (measured on a Zen 4 host, ``make demo`` with ``auto``: three draft-chain
        steps of 2, 2 and 1 tokens took its rate from 2.48 to 1.29, under the tree's 1.60 from
        an earlier step; the tree, realising 1.16 to 1.89, drafted every later model step of the
        request, where the chain had realised 2.1 to 2.8). The order changes when a probed
        alternative realises more than the leader now does."""
        if drafter not in self.models:
            return
        rates = self.costs.drafter_rate
        rated = [name for name in self.alternatives if name in rates]
        leader = max(rated, key=rates.__getitem__) if rated else None
        carried = self.alternatives if drafter == leader else ()
        self.costs.record_rate(drafter, realised[0] / realised[1], carried)

    def outrun(
        self,
        name: str,
        num_tokens: int,
        predicted: tuple[float, float] | None,
        confidences: Sequence[float] | None,
        batch_size: int,
    ) -> bool:
        """True when lookup drafter ``name`` should sit the step out for the model drafters behind
        it (``auto``, a request decoding alone): its predicted speedup for ``num_tokens`` (expected
        tokens ``1 + sum(confidences[:num_tokens])`` where it scored its proposal, Leviathan et al.
        2023 Eq. 1 at its acceptance estimate otherwise: ``predicted[0]``; over ``predicted[1]``,
        the step's cost in plain steps) is below the best realised rate of a model drafter here.
        A lookup's schedule prices its draft against plain decoding, and a weak match beats that
        while losing the step to the draft model it displaces (measured: ``make demo``'s suffix
        steps accepted 0.118 of their tokens, the draft model's 0.829). In a batch the model
        drafters' costs are shared, so the rule stays out. Counts the steps in
        :attr:`num_outrun_lookups`."""
        if not self._lookups_against_models or name not in LOOKUP_DRAFTERS or not self.models:
            return False
        if predicted is None or batch_size > 1:
            return False
        rates = [self.costs.drafter_rate[model] for model in self.models if model in self.costs.drafter_rate]
        if not rates:
            return False
        tokens = 1.0 + sum(confidences[:num_tokens]) if confidences else predicted[0]
        beaten = tokens / predicted[1] < max(rates)
        self.num_outrun_lookups += beaten
        return beaten
