"""What a head-training run keeps beside the head: the head and its optimiser's state (written
together, the state atomically), that state read back for ``--resume``, and the loss plot.

Knows nothing about the training loop (:mod:`verispec.training.loop`) or how progress is shown.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


def load_optimizer_state(path: Path, say: Callable[[str], None]) -> dict | None:
    """The optimiser state an earlier run left at ``path``, or None where there is none or it is
    unreadable (each said through ``say``, one line: AdamW then starts afresh)."""
    import torch

    if not path.is_file():
        say(f"no optimiser state at {path}: AdamW starts afresh (its moment estimates are rebuilt within ~100 steps)")
        return None
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many kinds for a damaged file
        say(f"{path} is not readable ({type(exc).__name__}): AdamW starts afresh")
        return None


def save_checkpoint(head, out: Path, optimizer, optimizer_path: Path, weights: str = "f32") -> None:
    """The head to ``out`` (its matrices as ``weights``: f32, f16 or q8_0), then its optimiser's
    state to ``optimizer_path`` (atomically: temporary file, rename). Raises OSError."""
    import torch

    head.save(out, weights)
    partial = optimizer_path.with_name(optimizer_path.name + ".partial")
    torch.save(optimizer.state_dict(), partial)
    os.replace(partial, optimizer_path)


def plot_training(report, path: Path) -> None:
    """Training loss and first-step agreement per step of ``report`` (a
    :class:`verispec.training.loop.TrainReport`), as a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, loss_axis = plt.subplots(figsize=(7, 4))
    loss_axis.plot(range(1, len(report.losses) + 1), report.losses, color="tab:blue")
    loss_axis.set_xlabel("optimiser step")
    loss_axis.set_ylabel("loss (soft cross-entropy, nats)", color="tab:blue")
    agreement = loss_axis.twinx()
    agreement.plot(range(1, len(report.top1) + 1), report.top1, color="tab:orange", alpha=0.7)
    agreement.set_ylabel("top-1 agreement (batch, step 0)", color="tab:orange")
    fig.suptitle(f"EAGLE head training: held-out top-1 {report.held_out_top1_before:.3f} -> {report.held_out_top1:.3f}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
