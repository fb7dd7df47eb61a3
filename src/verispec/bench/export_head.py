"""``verispec export-head`` and ``advise --export`` with a head: a verispec EAGLE head file turned
into the Hugging Face EAGLE-3 checkpoint vLLM and SGLang serve
(:mod:`verispec.runners.eagle.hf`), with the target's trained context and where it came from.
Owns finding the target's facts; the layout belongs to ``eagle_hf``.
"""

from __future__ import annotations

import json
from pathlib import Path


def default_export_folder(head_path: str | Path) -> Path:
    """Where a head's checkpoint goes when no folder is given: beside it, ``<name>-eagle3``."""
    head_path = Path(head_path)
    return head_path.with_name(f"{head_path.stem}-eagle3")


def trained_context(target: str, fallback: int) -> int:
    """The target's trained context in tokens: a GGUF's ``{arch}.context_length``, a checkpoint
    folder's ``max_position_embeddings``; ``fallback`` (e.g. the runner's capacity) otherwise."""
    from verispec.models.gguf_file import read_gguf_header
    from verispec.models.store import ModelStore

    source = ModelStore().resolve(target)
    if source.kind == "gguf" and source.path is not None:
        return int(read_gguf_header(source.path).arch_value("context_length", fallback))
    if source.kind == "directory" and source.path is not None:
        try:
            return int(json.loads((source.path / "config.json").read_text()).get("max_position_embeddings", fallback))
        except (OSError, ValueError):
            return fallback
    return fallback


def export_head(
    head_path: str | Path, target_runner, target: str, folder: str | Path | None = None, *, dtype: str = "bfloat16"
) -> Path:
    """Write the EAGLE-3 checkpoint of the head file ``head_path`` for ``target`` (a verispec model
    reference) to ``folder`` (default :func:`default_export_folder`); ``target_runner`` lends what
    the head borrows (its embedding; its LM-head rows for a head that shares them), as when it
    drafts. Returns the folder.

    Raises:
        ModelNotFoundError / ModelIntegrityError: no head file, or a damaged one.
        InvalidParameterError: a head for another target, a folder that holds files, or what
            :func:`verispec.runners.eagle.hf.hf_config` refuses.
    """
    from verispec.runners.eagle.head import EagleHead
    from verispec.runners.eagle.hf import write_hf_checkpoint

    folder = Path(folder) if folder is not None else default_export_folder(head_path)
    head = EagleHead.load(head_path, target_runner)  # a busy folder is refused by write_hf_checkpoint
    context = trained_context(target, int(getattr(target_runner, "max_context_length", 4096)))
    training = head.training_record or {}
    extra = {
        "verispec": {
            "head_file": Path(head_path).name,
            "target": target,
            "trained_with": training.get("command"),
            "target_norm_sha256": head.shape.target_norm_sha256,
        }
    }
    return write_hf_checkpoint(head, folder, max_position_embeddings=context, dtype=dtype, extra=extra)
