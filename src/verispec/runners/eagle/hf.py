"""An EAGLE head as the Hugging Face EAGLE-3 checkpoint the GPU engines load (vLLM's
``Eagle3LlamaForCausalLM``, SGLang's ``LlamaForCausalLMEagle3``: the layout of the EAGLE
reference implementation, SafeAILab/EAGLE ``cnets.py``): a folder with ``config.json`` and
``model.safetensors``. Owns the names and the conversion only; knows nothing about training or
drafting.

The head's arithmetic is already EAGLE-3's (Li et al. 2025, arXiv 2503.01840, §3): ``fc`` over the
fused features, one decoder layer whose attention reads ``[input_norm(embedding),
hidden_norm(hidden)]``, the residual taken before ``hidden_norm``, a final ``norm`` and
``lm_head`` over the draft vocabulary. What changes on the way out:

- names: ``midlayer.input_layernorm`` / ``hidden_norm`` / ``self_attn.*_proj`` /
  ``post_attention_layernorm`` / ``mlp.*_proj``;
- ``d2t``: the reference stores each draft row's *offset* (target id - draft id), verispec the
  target id; ``t2d``: bool ``[vocab]``, True for the ids the head can propose;
- ``lm_head.weight``: written even when the head borrows the target's rows (the engines load
  the draft's own), de-quantized as the target file holds them;
- the fused layers: verispec's indices are hidden states (0: the embedding; ``i``: what enters
  decoder layer ``i``), which is what vLLM's ``eagle_aux_hidden_state_layer_ids`` means; SGLang's
  ``eagle_config.eagle_aux_hidden_state_layer_ids`` names layer *outputs* (it adds one). Both
  engines default to ``(2, N // 2, N - 3)``, verispec's default too (N >= 6), so such a head writes no
  ids; any other head writes vLLM's at the top level (vLLM reads those first) and SGLang's, one
  lower, in ``eagle_config``.

No embedding is written: both engines lend the target's, as verispec does.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from torch import Tensor

from verispec.errors import InvalidParameterError

HF_ARCHITECTURE = "LlamaForCausalLMEagle3"
HF_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

# verispec's state-dict name -> the reference checkpoint's
CHECKPOINT_NAMES = {
    "fc.weight": "fc.weight",
    "input_norm.weight": "midlayer.input_layernorm.weight",
    "hidden_norm.weight": "midlayer.hidden_norm.weight",
    "q_proj.weight": "midlayer.self_attn.q_proj.weight",
    "k_proj.weight": "midlayer.self_attn.k_proj.weight",
    "v_proj.weight": "midlayer.self_attn.v_proj.weight",
    "o_proj.weight": "midlayer.self_attn.o_proj.weight",
    "post_attention_norm.weight": "midlayer.post_attention_layernorm.weight",
    "gate_proj.weight": "midlayer.mlp.gate_proj.weight",
    "up_proj.weight": "midlayer.mlp.up_proj.weight",
    "down_proj.weight": "midlayer.mlp.down_proj.weight",
    "norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}


def hf_config(shape, *, max_position_embeddings: int, dtype: str = "bfloat16") -> dict:
    """``config.json`` of the checkpoint for a head of ``shape`` (a ``HeadShape``).

    ``max_position_embeddings``: the target's trained context in tokens (the engines cap the
    draft's positions with it). Raises InvalidParameterError for an unknown ``dtype`` (one of
    :data:`HF_DTYPES`), a context below 1, or feature layers SGLang cannot name (the embedding,
    index 0, when the layers are not the default)."""
    if dtype not in HF_DTYPES:
        raise InvalidParameterError(f"checkpoint dtype must be one of {', '.join(HF_DTYPES)}, not {dtype!r}")
    if max_position_embeddings < 1:
        raise InvalidParameterError(f"max_position_embeddings must be >= 1, got {max_position_embeddings}")
    config = {
        "architectures": [HF_ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "head_dim": shape.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": shape.rms_norm_eps,
        "rope_theta": shape.rope_theta,
        "max_position_embeddings": int(max_position_embeddings),
        "vocab_size": shape.vocab_size,
        "draft_vocab_size": shape.draft_vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": dtype,
    }
    layers, n = tuple(shape.feature_layers), shape.num_target_layers
    if layers != (2, n // 2, n - 3):  # the engines' default, unclamped (verispec's for 6 layers or more)
        if len(layers) != 3:
            raise InvalidParameterError(f"the engines' EAGLE-3 fuses 3 feature layers; this head fuses {len(layers)}")
        if 0 in layers:
            raise InvalidParameterError(
                "SGLang names fused layers by their output, so the embedding (layer 0) cannot be exported"
            )
        config["eagle_aux_hidden_state_layer_ids"] = list(layers)  # vLLM: hidden-state indices
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in layers]}  # SGLang: outputs
    return config


def hf_tensors(head, dtype: str = "bfloat16") -> dict[str, Tensor]:
    """The checkpoint's tensors of ``head`` (an ``EagleHead`` with float weights): the layer's
    matrices and norms in ``dtype``, ``d2t`` int64 ``[draft_vocab_size]`` offsets (target id -
    draft row), ``t2d`` bool ``[vocab_size]``.

    Raises InvalidParameterError for a head quantized for inference (its float weights are gone)
    or an unknown ``dtype``."""
    if getattr(head, "quantization", None):
        raise InvalidParameterError(
            f"this head was quantized to {head.quantization} for inference; export the loaded file"
        )
    if dtype not in HF_DTYPES:
        raise InvalidParameterError(f"checkpoint dtype must be one of {', '.join(HF_DTYPES)}, not {dtype!r}")
    state = head.state_dict()
    tensors = {
        CHECKPOINT_NAMES[name]: state[name].detach().to(HF_DTYPES[dtype]).contiguous() for name in CHECKPOINT_NAMES
    }
    d2t = head.d2t.long()
    tensors["d2t"] = (d2t - torch.arange(d2t.numel())).contiguous()
    t2d = torch.zeros(head.shape.vocab_size, dtype=torch.bool)
    t2d[d2t] = True
    tensors["t2d"] = t2d
    return tensors


def write_hf_checkpoint(
    head, folder: str | Path, *, max_position_embeddings: int, dtype: str = "bfloat16", extra: dict | None = None
) -> Path:
    """Write ``folder`` (created; it must not exist or be empty) with ``config.json`` and
    ``model.safetensors`` of ``head``, whole or not at all (written beside it, then renamed).
    ``extra``: more ``config.json`` keys (e.g. where the head came from).

    Returns the folder. Raises InvalidParameterError as :func:`hf_config` / :func:`hf_tensors`,
    or when ``folder`` holds files; OSError when it cannot be written.
    """
    from safetensors.torch import save_file

    folder = Path(folder)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise InvalidParameterError(f"{folder} exists and is not an empty folder: give another one")
    config = {**hf_config(head.shape, max_position_embeddings=max_position_embeddings, dtype=dtype), **(extra or {})}
    tensors = hf_tensors(head, dtype)
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=folder.name + ".", suffix=".partial", dir=folder.parent))
    try:
        save_file(tensors, staging / "model.safetensors", metadata={"format": "pt"})
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if folder.exists():
            folder.rmdir()
        os.replace(staging, folder)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return folder
