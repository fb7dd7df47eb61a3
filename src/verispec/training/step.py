"""One optimiser step of head training (EAGLE-3, arXiv 2503.01840, §3) in f32 or bf16, its loss
and its optimiser.

bf16 is mixed precision as in Micikevicius et al. 2018 ("Mixed Precision Training", arXiv
1710.03740, §3.1): the head keeps fp32 master weights (what the optimiser updates, what
checkpoints hold); a bf16 copy of it runs the forward and backward passes (the matrix products
in bf16, accumulated in fp32 by oneDNN); its gradients come back to the masters in fp32 for
clipping and AdamW, then the copy is refreshed from the masters. Softmax, log-softmax and the
soft cross-entropy run in fp32 in both formats. bf16 has fp32's exponent range, so no loss
scaling (§3.2) is needed.

Knows nothing about where batches come from (:mod:`verispec.training.loop`) or which format a
host should use (:mod:`verispec.training.precision`).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from verispec.errors import InvalidParameterError

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
ADAMW_IMPLEMENTATIONS = ("fused", "foreach", "loop")  # fused: one vectorised kernel per tensor (torch >= 2.4 on CPU)


def ttt_unroll(
    head: nn.Module, features: Tensor, token_ids: Tensor, positions: Tensor, segments: Tensor | None = None
) -> list[Tensor]:
    """The head's (an :class:`~verispec.runners.eagle.head.EagleHead`) logits of every unrolled
    draft step over packed anchors (EAGLE-3 §3).

    Args:
        features: ``[P, layers * hidden]`` target features of the anchors.
        token_ids: int64 ``[K, P]`` the token fed at each step (``x_{t+j+1}``).
        positions: int64 ``[P]`` anchor positions; step ``j`` sits at ``positions + j``.
        segments: int64 ``[P]`` window of each anchor (None: one window); anchors attend only
            within their window.
    Returns:
        ``K`` tensors ``[P, draft_vocab_size]`` in the head's dtype; differentiable.
    """
    rows, device = positions.numel(), positions.device
    segments = torch.zeros(rows, dtype=torch.long, device=device) if segments is None else segments
    causal = (segments[None, :] == segments[:, None]) & (positions[None, :] <= positions[:, None])
    diagonal = torch.eye(rows, dtype=torch.bool, device=device)
    hidden = head.fuse(features)
    keys = values = torch.zeros(
        head.shape.num_key_value_heads, 0, head.shape.head_dim, dtype=hidden.dtype, device=device
    )
    step_logits = []
    for step, step_tokens in enumerate(token_ids):
        mask = torch.cat([causal] + [diagonal] * step, dim=1)  # step 0's rows, then this anchor's later rows
        hidden, new_keys, new_values = head.layer(hidden, step_tokens, positions + step, keys, values, mask)
        keys, values = torch.cat([keys, new_keys], 1), torch.cat([values, new_values], 1)
        step_logits.append(head.logits(hidden, dtype=None))
    return step_logits


def target_draft_head(target: nn.Module, d2t: Tensor) -> tuple[Tensor, Tensor | None]:
    """The target's ``lm_head`` rows of the draft vocabulary: float32 weight
    ``[draft_vocab_size, hidden]`` and bias ``[draft_vocab_size]`` (None without one)."""
    lm_head = target.get_output_embeddings()
    bias = getattr(lm_head, "bias", None)
    return lm_head.weight.detach()[d2t].float(), (None if bias is None else bias.detach()[d2t].float())


CE_ROWS = 16  # rows of the soft cross-entropy at a time: its fp32 temporaries (~4 x 2 MB at 32,000 rows) stay in cache


class _SoftCrossEntropy(torch.autograd.Function):
    """``(sum_r weights[r] * CE_r, argmax of each row of draft_logits)``, the gradient made in
    the forward pass, ``CE_ROWS`` rows at a time: ``d/dz CE = softmax(z) - P`` (one ``[R, V]`` in
    the logits' dtype kept instead of autograd's fp32 copies, log-softmax and products of the
    whole ``[R, V]``; the argmax read from the fp32 rows: torch's bf16 argmax is 4x slower)."""

    @staticmethod
    def forward(ctx, draft_logits: Tensor, target_logits: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
        need_grad = ctx.needs_input_grad[0]
        per_row = torch.empty(draft_logits.shape[0], dtype=torch.float32, device=draft_logits.device)
        argmax = torch.empty(draft_logits.shape[0], dtype=torch.long, device=draft_logits.device)
        grad = torch.empty_like(draft_logits) if need_grad else None
        for start in range(0, draft_logits.shape[0], CE_ROWS):
            rows = slice(start, start + CE_ROWS)
            draft = draft_logits[rows].float()
            argmax[rows] = draft.argmax(-1)
            target_probs = F.softmax(target_logits[rows].float(), dim=-1)
            log_draft = F.log_softmax(draft, dim=-1)
            per_row[rows] = -torch.linalg.vecdot(target_probs, log_draft)
            if need_grad:
                grad[rows] = log_draft.exp_().sub_(target_probs).mul_(weights[rows, None])
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(argmax)
        return (per_row * weights).sum(), argmax

    @staticmethod
    def backward(ctx, upstream: Tensor, _argmax: Tensor):
        (grad,) = ctx.saved_tensors
        return grad * upstream.to(grad.dtype), None, None


def soft_cross_entropy(draft_logits: Tensor, target_logits: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
    """Mean over the ``valid`` rows of ``-sum_v P(v) log Q(v)``, in fp32 (nats), where ``P`` and
    ``Q`` are the softmax of ``target_logits`` and ``draft_logits`` (both ``[R, V]``, any float
    dtype; ``valid``: bool ``[R]``, at least one True), and the int64 ``[R]`` argmax of each row
    of ``draft_logits``. Softmax, log-softmax and the sums run in fp32 (:data:`CE_ROWS` rows at
    a time); the gradient reaching ``draft_logits`` is in its dtype. Invalid rows must hold
    finite logits: they are weighted 0 instead of cut out (no copy of the ``[R, V]`` rows)."""
    weights = valid.float() / valid.sum()
    return _SoftCrossEntropy.apply(draft_logits, target_logits, weights)


def distillation_loss(
    head: nn.Module, batch, target_head: tuple[Tensor, Tensor | None], step_decay: float
) -> tuple[Tensor, list[Tensor]]:
    """Weighted soft cross-entropy (nats) of the head's :func:`ttt_unroll`
    over ``batch`` (a :class:`~verispec.training.loop.Batch`) against the target's distribution
    restricted to the draft vocabulary and renormalised (its logits of those rows: ``target_head``,
    :func:`target_draft_head`, in the head's dtype).

    Returns ``(loss, agreements)``: the fp32 scalar ``sum_j step_decay**j * mean CE_j`` and per
    step a bool ``[valid rows]`` tensor, True where ``d2t[argmax]`` is the target's
    full-vocabulary argmax.
    """
    step_logits = ttt_unroll(head, batch.features, batch.token_ids, batch.positions, batch.segments)
    weight = target_head[0]
    loss, agreements = torch.zeros((), device=batch.features.device), []
    for step, logits in enumerate(step_logits):
        valid = batch.valid[step]
        if not bool(valid.any()):
            agreements.append(torch.zeros(0, dtype=torch.bool))
            continue
        target_logits = F.linear(batch.teacher_hidden[step].to(weight.dtype), weight, target_head[1])
        step_loss, argmax = soft_cross_entropy(logits, target_logits, valid)
        loss = loss + step_decay**step * step_loss
        drafted = head.draft_to_target(argmax)
        agreements.append((drafted == batch.target_argmax[step])[valid])
    return loss, agreements


def make_optimizer(
    head: nn.Module, options, state: dict | None = None, implementation: str = "fused"
) -> torch.optim.AdamW:
    """AdamW over the head's (fp32 master) parameters with ``options``' settings (a
    :class:`~verispec.training.loop.TrainOptions`), continuing ``state`` (an earlier run's
    ``optimizer.state_dict()``, of either precision: its moment estimates and step counts) when given.

    ``implementation``: ``fused`` (one vectorised kernel per tensor; falls back to ``foreach``
    where this torch has none for the device), ``foreach`` or ``loop`` (torch's per-tensor code).

    Raises:
        InvalidParameterError: ``state`` is not an AdamW state of this head's parameters, or an
            unknown ``implementation``.
    """
    if implementation not in ADAMW_IMPLEMENTATIONS:
        raise InvalidParameterError(f"AdamW implementation must be one of {ADAMW_IMPLEMENTATIONS}")
    kinds = {"fused": {"fused": True}, "foreach": {"foreach": True}, "loop": {"foreach": False}}[implementation]
    params = list(head.parameters())
    try:
        optimizer = torch.optim.AdamW(params, lr=options.lr, weight_decay=options.weight_decay, **kinds)
    except RuntimeError:  # no fused kernel for this device or dtype in this torch
        kinds = {"foreach": True}
        optimizer = torch.optim.AdamW(params, lr=options.lr, weight_decay=options.weight_decay, **kinds)
    if state is not None:
        try:
            optimizer.load_state_dict(state)
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidParameterError(f"the optimiser state is not one of this head's ({exc})") from exc
        for group in optimizer.param_groups:  # this run's settings and kernel, the earlier run's moments
            group.update(
                {"lr": options.lr, "weight_decay": options.weight_decay, "fused": None, "foreach": None, **kinds}
            )
    return optimizer


def compute_copy(head: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A copy of ``head`` whose parameters are ``dtype`` (the forward/backward weights of mixed
    precision); its buffers stay as they are (rotary frequencies in fp32), the target's
    embedding it borrows stays shared."""
    embedding = head.__dict__.get("embed_tokens")
    twin = copy.deepcopy(head, memo={} if embedding is None else {id(embedding): embedding})
    with torch.no_grad():
        for module in twin.modules():
            for name, param in list(module._parameters.items()):
                if param is not None and param.is_floating_point():
                    module._parameters[name] = nn.Parameter(param.detach().to(dtype), param.requires_grad)
    return twin


class TrainStep:
    """Runs optimiser steps of ``head`` (the fp32 masters) in ``options.precision``.

    Args:
        head: the :class:`~verispec.runners.eagle.head.EagleHead` being trained (fp32, updated in place).
        optimizer: AdamW over ``head``'s parameters (:func:`make_optimizer`).
        target_head: :func:`target_draft_head` of the target, fp32 on the head's device.
        options: a :class:`~verispec.training.loop.TrainOptions` (``precision``, ``step_decay``,
            ``max_grad_norm``).
    """

    def __init__(self, head: nn.Module, optimizer: torch.optim.Optimizer, target_head, options) -> None:
        dtype = DTYPES[options.precision]
        self.options, self.optimizer = options, optimizer
        self.mixed = dtype != torch.float32
        self.masters = [p for p in head.parameters() if p.requires_grad]
        self.head = head if dtype == torch.float32 else compute_copy(head, dtype)
        self.copies = [p for p in self.head.parameters() if p.requires_grad]
        self.target_head = tuple(None if t is None else t.to(dtype) for t in target_head)

    def __call__(self, batch) -> tuple[Tensor, list[Tensor]]:
        """One step over ``batch``: loss, backward, gradient clipping (fp32, EAGLE's norm),
        AdamW on the masters, the bf16 copy refreshed. Returns :func:`distillation_loss`'s
        ``(loss, agreements)``, the loss detached."""
        for param in self.copies:
            param.grad = None
        loss, agreements = distillation_loss(self.head, batch, self.target_head, self.options.step_decay)
        loss.backward()
        if self.mixed:  # the bf16 gradients to the masters, in fp32
            for master, param in zip(self.masters, self.copies):
                if param.grad is None:
                    master.grad = None
                elif master.grad is None:
                    master.grad = param.grad.float()
                else:
                    master.grad.copy_(param.grad)
        torch.nn.utils.clip_grad_norm_(self.masters, self.options.max_grad_norm)
        self.optimizer.step()
        if self.mixed:
            with torch.no_grad():
                for master, param in zip(self.masters, self.copies):
                    param.copy_(master)
        return loss.detach(), agreements
