"""The target's view of a sequence for training an EAGLE head: its features, final normed hidden
state and greedy tokens, read by float32 transformers (:func:`teacher`) or by the served runner on
its own kernels (:func:`runner_teacher`). Knows nothing about the head or the loss
(:mod:`verispec.training.loop`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from verispec.errors import InvalidParameterError


@dataclass
class Teacher:
    """The target's view of one sequence (float32 tensors).

    Attributes:
        token_ids: int64 ``[L]``.
        features: ``[L, layers * hidden]`` hidden states of the head's feature layers.
        final_hidden: ``[L, hidden]`` the target's last, normed hidden state (its ``lm_head``
            input), so the draft-vocabulary logits are recomputed per batch, not stored.
        target_argmax: int64 ``[L]`` the target's greedy next token at each position.
    """

    token_ids: Tensor
    features: Tensor
    final_hidden: Tensor
    target_argmax: Tensor


@torch.inference_mode()
def teacher(target: torch.nn.Module, token_ids: Sequence[int], feature_layers: Sequence[int]) -> Teacher:
    """Run ``target`` teacher-forced over ``token_ids`` (one pass, ``output_hidden_states``).

    ``feature_layers`` index transformers' hidden-state tuple (0: embeddings).
    Raises:
        InvalidParameterError: the target's last hidden state is not its ``lm_head`` input.
    """
    ids = torch.as_tensor(list(token_ids), dtype=torch.long)
    device = next(target.parameters()).device  # the target's device (--device); the results come back to the CPU
    out = target(input_ids=ids[None].to(device), output_hidden_states=True, use_cache=False)
    states = out.hidden_states
    final = states[-1][0].float()
    logits = out.logits[0].float()
    head = target.get_output_embeddings()
    if not torch.allclose(head(states[-1][0, -1:]).float(), logits[-1:], rtol=1e-3, atol=1e-3):
        raise InvalidParameterError("the target's last hidden state is not its lm_head input; cannot distil from it")
    features = torch.cat([states[i][0] for i in feature_layers], dim=-1).float()
    return Teacher(ids, features.cpu(), final.cpu(), logits.argmax(-1).cpu())


@torch.inference_mode()
def runner_teacher(runner, token_ids: Sequence[int], feature_layers: Sequence[int], *, chunk: int = 256) -> Teacher:
    """:func:`teacher` from a verispec runner (``Int8Runner``, ``GGUFRunner``): the model that is
    served reads the sequence on its own kernels, in prefill passes of ``chunk`` rows, and its
    features, final normed hidden state and greedy token come out of those passes (captured,
    no extra pass). Over the gguf runner this is the quantized target a head drafts for at
    inference (its features, its argmax), at the runner's prefill speed instead of a float32
    transformers forward.

    Args:
        runner: a runner with ``capture_features``, ``capture_final_hidden`` and ``new_sequence``
            (a fresh sequence is used; ``runner``'s own cache is left alone).
        token_ids: the sequence; only its first ``runner.max_context_length`` tokens are read.
        feature_layers: hidden-state indices (:mod:`verispec.runners.features`).
    Returns:
        :class:`Teacher` (float32 features ``[L, layers * hidden]``, final hidden ``[L, hidden]``,
        int64 argmax ``[L]``), ``L = min(len(token_ids), max_context_length)``.
    Raises:
        InvalidParameterError: the runner cannot capture final hidden states (llama.cpp, torch:
            use :func:`teacher`), or ``chunk < 1``.
    """
    if not runner.supports_final_hidden:
        raise InvalidParameterError(
            f"the {type(runner).__name__} cannot hand out its final hidden states; "
            "train with the gguf or int8 runner, or the torch teacher"
        )
    if chunk < 1:
        raise InvalidParameterError(f"chunk must be >= 1, not {chunk}")
    ids = [int(t) for t in token_ids][: runner.max_context_length]
    sequence = runner.new_sequence()
    sequence.capture_features(feature_layers)
    sequence.capture_final_hidden(True)
    features, finals, argmax = [], [], []
    for start in range(0, len(ids), chunk):
        logits = sequence.forward(ids[start : start + chunk])
        features.append(sequence.last_features)
        finals.append(sequence.last_final_hidden)
        argmax.append(logits.argmax(-1))
    return Teacher(torch.tensor(ids, dtype=torch.long), torch.cat(features), torch.cat(finals), torch.cat(argmax))
