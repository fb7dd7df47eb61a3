"""One request's verification of one target pass: the rows processed as plain decoding would
process them (penalties, temperature, top-k/top-p), then greedy, coupled or rejection verification of
the chain or the tree (:mod:`verispec.algorithms.verify`, :mod:`verispec.algorithms.coupling`,
:mod:`verispec.algorithms.tree`). Knows nothing about runners, caches or batching.

Positions: row i of a chain's pass chooses the token at absolute position ``len(prompt) +
len(output) + i``; a tree node's row, the token at ``len(prompt) + len(output) + depth``.
"""

from __future__ import annotations

import torch

from verispec.algorithms.coupling import coupled_sample, coupled_tree_verify, coupled_verify_chain
from verispec.algorithms.draft import DraftOutput
from verispec.algorithms.sampling import ProcessedRows, SamplingParams, process_logits, sample_from
from verispec.algorithms.tree import TokenTree, TreeVerifyResult, greedy_tree_verify, tree_rejection_sample
from verispec.algorithms.verify import VerifyResult, greedy_verify, pad_vocab, rejection_sample


def coupling_key(generator: torch.Generator) -> int:
    """The request's coupling key: its generator's seed (the request's ``seed``, or the one drawn
    for it), so one number fixes both modes' randomness."""
    return int(generator.initial_seed())


def pick_token(rows: ProcessedRows, generator: torch.Generator, position: int | None = None, row: int = 0) -> int:
    """The token plain decoding (or a drafter) takes from processed row ``row``: the argmax
    (greedy), the coupled sample at absolute ``position`` (coupled; required then), or a draw from
    the probabilities with ``generator`` (rejection mode).

    Raises:
        ValueError: coupled rows without a ``position``.
    """
    if rows.greedy_token_ids is not None:
        return int(rows.greedy_token_ids[row])
    if rows.scores is not None:
        if position is None:
            raise ValueError("coupled sampling needs the token's absolute position")
        return coupled_sample(rows.scores[row], coupling_key(generator), position)
    return sample_from(rows.probs[row], generator)


def verify_chain(
    logits: torch.Tensor,  # [num_draft + 1, vocab]
    draft: DraftOutput,
    params: SamplingParams,
    prompt: list[int],
    output_token_ids: list[int],
    generator: torch.Generator,
    allowed: torch.Tensor | None = None,  # [num_draft + 1, vocab] bool: row i's mask (TokenConstraints)
) -> tuple[VerifyResult, torch.Tensor]:
    """Verify ``draft.draft_token_ids`` against the rows that scored them (row i after draft i).

    Returns the result and the processed rows (``[num_draft + 1, vocab]`` float32,
    :attr:`ProcessedRows.logits`: row i scored the result's token i)."""
    draft_token_ids = draft.draft_token_ids
    rows = process_logits(logits, params, prompt, output_token_ids, draft_token_ids, allowed)
    if rows.probs is None:
        return greedy_verify(draft_token_ids, rows.greedy_token_ids), rows.logits
    if rows.scores is not None:
        first = len(prompt) + len(output_token_ids)
        return coupled_verify_chain(draft_token_ids, lambda i: pick_token(rows, generator, first + i, i)), rows.logits
    target_probs, draft_probs = rows.probs, draft.draft_probs
    if draft_probs is not None:
        draft_probs = draft_probs[: len(draft_token_ids)]
        width = max(target_probs.shape[-1], draft_probs.shape[-1])
        target_probs, draft_probs = pad_vocab(target_probs, width), pad_vocab(draft_probs, width)
    return rejection_sample(draft_token_ids, draft_probs, target_probs, generator), rows.logits


def verify_tree(
    tree: TokenTree,
    logits: torch.Tensor,  # [num_nodes, vocab]
    params: SamplingParams,
    prompt: list[int],
    output_token_ids: list[int],
    generator: torch.Generator,
    allowed: torch.Tensor | None = None,  # [num_nodes, vocab] bool: node i's mask along its path
) -> tuple[TreeVerifyResult, torch.Tensor]:
    """Verify every node of ``tree`` from its row; with penalties each node's row sees its own path.

    Returns the result and the processed rows (``[num_nodes, vocab]`` float32: node i's row)."""
    if params.has_penalties:  # each node's penalties see its own path, as plain decoding would
        rows = [
            process_logits(
                logits[i : i + 1],
                params,
                prompt,
                list(output_token_ids) + [tree.token_ids[j] for j in tree.path_to(i)],
                allowed=None if allowed is None else allowed[i : i + 1],
            )
            for i in range(tree.num_nodes)
        ]
        greedy = rows[0].greedy_token_ids is not None
        processed = torch.cat([r.greedy_token_ids if greedy else r.probs for r in rows])
        processed_logits = torch.cat([r.logits for r in rows])
        scores = torch.cat([r.scores for r in rows]) if rows[0].scores is not None else None
    else:
        rows1 = process_logits(logits, params, prompt, output_token_ids, allowed=allowed)
        greedy = rows1.greedy_token_ids is not None
        processed = rows1.greedy_token_ids if greedy else rows1.probs
        processed_logits, scores = rows1.logits, rows1.scores
    if greedy:
        return greedy_tree_verify(tree, processed), processed_logits
    if scores is not None:
        key, first, depths = coupling_key(generator), len(prompt) + len(output_token_ids), tree.depths()
        return coupled_tree_verify(tree, lambda i: coupled_sample(scores[i], key, first + depths[i])), processed_logits
    return tree_rejection_sample(tree, processed, generator), processed_logits
