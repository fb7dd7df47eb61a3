"""EAGLE-3 heads as they are published: a folder with ``config.json`` and ``model.safetensors``
or ``pytorch_model.bin`` (or their sharded ``*.index.json``), the layout of the EAGLE authors'
heads (SafeAILab/EAGLE, ``eagle/model/cnets.py``) and SpecForge's
(``specforge/modeling/draft/llama3_eagle.py``) that vLLM (``Eagle3LlamaForCausalLM``) and SGLang
(``LlamaForCausalLMEagle3``) load. Owns reading, checking and converting such a folder, once, into
verispec's head file (:mod:`.file`), cached; the head's arithmetic is :mod:`.head`'s, the way back
:mod:`.hf`'s. Knows nothing about drafting.

What the conversion reads, as those loaders do (Li et al. 2025, "EAGLE-3", arXiv 2503.01840, §3):

- ``config.json``: ``hidden_size``, ``num_attention_heads``, ``num_key_value_heads`` (default: the
  heads), ``head_dim`` (default: hidden / heads), ``intermediate_size``, ``rms_norm_eps`` (default
  1e-6), ``rope_theta`` (default 10000, transformers' ``LlamaConfig``: the EAGLE authors' Llama 3.1
  head names none, so it rotates with 10000, not its target's 500000), ``rope_scaling`` (linear,
  llama3), ``vocab_size`` (the target's), ``draft_vocab_size`` (default: the vocabulary),
  ``norm_before_residual`` (vLLM's), the fused layers (below); one decoder layer, SiLU, no biases.
- tensors (a leading ``model.`` ignored): ``fc`` ``[hidden, 3 * hidden]`` over the low, middle and
  high features side by side; ``midlayer.*`` (attention over ``[input_layernorm(embedding),
  hidden_norm(hidden)]``, ``2 * hidden`` wide); ``norm``; ``lm_head`` ``[draft_vocab, hidden]``;
  ``d2t`` int64 offsets (target id = draft row + offset); ``t2d`` bool ``[vocab]`` (checked against
  ``d2t``, not needed). No ``lm_head`` with the full vocabulary: the target's LM head (SGLang's
  ``load_lm_head_from_target``). An ``embed_tokens.weight`` is checked for its shape and not used:
  the head embeds with its target's embedding, as SGLang (``set_embed``) and the EAGLE reference
  (``load_emb`` from the base model) do.
- fused layers: vLLM's top-level ``eagle_aux_hidden_state_layer_ids`` are hidden-state indices
  (verispec's, :mod:`verispec.runners.features`), SGLang's ``eagle_config.
  eagle_aux_hidden_state_layer_ids`` layer outputs (one lower); neither: both engines' default
  ``(2, N // 2, N - 3)`` of the target's ``N`` layers, unclamped.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path

import torch
from torch import Tensor

from verispec.errors import InvalidParameterError, ModelIntegrityError, ModelNotFoundError, one_line
from verispec.runners.eagle.file import write_head_gguf
from verispec.runners.eagle.hf import CHECKPOINT_NAMES
from verispec.runners.eagle.shape import HeadShape, rope_inv_freq
from verispec.runners.eagle.target import HeadTarget

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "LlamaForCausalLM")  # the last: EAGLE's training
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")  # each also as a sharded <name>.index.json
CONVERSION_VERSION = 1  # bump when the conversion changes: the cached heads are converted again
OURS = {checkpoint: ours for ours, checkpoint in CHECKPOINT_NAMES.items()}
OPTIONAL = {"d2t", "t2d", "embed_tokens.weight", "lm_head.weight"}


def converted_head(folder: str | Path, target: HeadTarget, cache_dir: Path | None = None) -> Path:
    """verispec's head file (GGUF, float32 weights: bf16 and f16 convert exactly) of the published
    EAGLE-3 checkpoint ``folder`` for ``target``, converted on first use and kept in ``cache_dir``
    (default ``$VERISPEC_HOME/eagle-heads``) under the sha256 of the folder's files, of the
    conversion and of the target facts it reads (layer count, model type).

    Raises:
        ModelNotFoundError: no ``config.json`` or no weight file in ``folder``.
        ModelIntegrityError: a file that cannot be read, tensors missing or of other shapes than
            ``config.json`` says, or ``d2t`` / ``t2d`` that map outside the vocabulary.
        InvalidParameterError: an unknown layout (another architecture, more decoder layers,
            biases, unknown tensors or RoPE scaling), or a head for another target (hidden size,
            vocabulary, fused layers outside the target's).
    """
    folder = Path(folder)
    config = _read_config(folder)
    files = _weight_files(folder)
    digest = hashlib.sha256(f"{CONVERSION_VERSION}:{target.num_layers}:{target.model_type}".encode())
    for path in [folder / "config.json", *files]:
        digest.update(path.name.encode())
        with open(path, "rb") as file:
            while chunk := file.read(2**24):
                digest.update(chunk)
    if cache_dir is None:
        from verispec.models.store import verispec_home

        cache_dir = verispec_home() / "eagle-heads"
    out = Path(cache_dir) / f"{folder.resolve().name}-{digest.hexdigest()[:16]}.gguf"
    if out.is_file():
        return out
    shape, state = convert_checkpoint(folder, config, _read_tensors(folder, files), target)
    out.parent.mkdir(parents=True, exist_ok=True)
    stored = {"architecture": "eagle3", **asdict(shape), "feature_layers": list(shape.feature_layers)}
    source = {"published_checkpoint": str(folder.resolve()), "sha256": digest.hexdigest()}
    write_head_gguf(out, stored, state, {"source": source, "architectures": config.get("architectures")})
    return out


def _read_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise ModelNotFoundError(
            f"{folder} holds no config.json: an EAGLE-3 head folder has config.json and model.safetensors "
            "or pytorch_model.bin"
        )
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelIntegrityError(f"{path} is not readable JSON ({one_line(exc)})") from exc
    if not isinstance(config, dict):
        raise ModelIntegrityError(f"{path} is not a JSON object")
    return config


def _weight_files(folder: Path) -> list[Path]:
    """The folder's weight files, the first of :data:`WEIGHT_FILES` present, whole or sharded."""
    for name in WEIGHT_FILES:
        if (folder / name).is_file():
            return [folder / name]
        index = folder / f"{name}.index.json"
        if index.is_file():
            try:
                shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
                raise ModelIntegrityError(f"{index} is not a readable shard index ({one_line(exc)})") from exc
            missing = [s for s in shards if not (folder / s).is_file()]
            if missing:
                raise ModelNotFoundError(
                    f"{folder}: the shards {', '.join(missing)} its {index.name} names are missing"
                )
            return [index, *(folder / s for s in shards)]
    raise ModelNotFoundError(f"{folder} holds no weights: expected {' or '.join(WEIGHT_FILES)} beside config.json")


def _read_tensors(folder: Path, files: list[Path]) -> dict[str, Tensor]:
    tensors: dict[str, Tensor] = {}
    for path in files:
        if path.name.endswith(".index.json"):
            continue
        try:
            if path.name.endswith(".safetensors"):
                from safetensors.torch import load_file

                loaded = load_file(path)
            else:
                loaded = torch.load(path, map_location="cpu", weights_only=True)
            if not isinstance(loaded, dict) or not all(isinstance(t, Tensor) for t in loaded.values()):
                raise TypeError("not a dict of tensors")
        except Exception as exc:  # safetensors and torch raise many kinds for a damaged file
            raise ModelIntegrityError(f"{path} is not a readable weight file ({one_line(exc)})") from exc
        tensors.update({name.removeprefix("model."): t for name, t in loaded.items()})
    return tensors


def _layout_error(folder: Path, what: str) -> InvalidParameterError:
    return InvalidParameterError(
        f"{folder} is not an EAGLE-3 head verispec can read: {what} (it reads one-layer Llama-style "
        f"EAGLE-3 heads: {', '.join(ARCHITECTURES[:2])})"
    )


def _shape_of(folder: Path, config: dict, target: HeadTarget) -> HeadShape:
    """The head's :class:`HeadShape` from ``config.json``, checked against the layout and ``target``."""
    architectures = config.get("architectures") or []
    if "speculators_config" in config or not set(architectures) & set(ARCHITECTURES):
        raise _layout_error(folder, f"architectures {architectures}")
    if config.get("num_hidden_layers", 1) != 1:
        raise _layout_error(folder, f"{config['num_hidden_layers']} decoder layers")
    if config.get("hidden_act", "silu") != "silu":
        raise _layout_error(folder, f"hidden_act {config['hidden_act']!r}")
    flags = [
        key for key in ("attention_bias", "mlp_bias", "bias", "qkv_bias", "tie_word_embeddings") if config.get(key)
    ]
    if (config.get("eagle_config") or {}).get("use_aux_hidden_state") is False:
        flags.append("eagle_config.use_aux_hidden_state false")
    if flags:
        raise _layout_error(folder, f"{', '.join(flags)} set")
    try:
        hidden, heads, vocab = int(config["hidden_size"]), int(config["num_attention_heads"]), int(config["vocab_size"])
        parameters = config.get("rope_parameters") or {}  # transformers 5 keeps theta and scaling here
        scaling = config.get("rope_scaling") or (
            parameters if parameters.get("rope_type") not in (None, "default") else None
        )
        shape = HeadShape(
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            intermediate_size=int(config["intermediate_size"]),
            rope_theta=float(parameters.get("rope_theta") or config.get("rope_theta") or 10000.0),
            rms_norm_eps=float(config.get("rms_norm_eps") or 1e-6),
            vocab_size=vocab,
            num_target_layers=target.num_layers,
            feature_layers=(),
            draft_vocab_size=int(config.get("draft_vocab_size") or vocab),
            target_model_type=target.model_type or str(config.get("model_type") or "llama"),  # None: not compared
            rope_scaling=json.dumps(scaling, sort_keys=True) if scaling else "",
            norm_before_residual=bool(config.get("norm_before_residual", False)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelIntegrityError(f"{folder / 'config.json'}: not an EAGLE-3 head config ({one_line(exc)})") from exc
    try:
        rope_inv_freq(shape)  # an unknown RoPE scaling refused here, not at the first draft
    except (KeyError, TypeError) as exc:
        raise ModelIntegrityError(f"{folder / 'config.json'}: its rope_scaling lacks {one_line(exc)}") from exc
    layers = feature_layers(config, target.num_layers)
    mismatched = [
        f"{name} {mine} != {theirs}"
        for name, mine, theirs in (
            ("hidden_size", hidden, target.hidden_size),
            ("target_hidden_size", int(config.get("target_hidden_size") or target.hidden_size), target.hidden_size),
            ("vocab_size", vocab, target.vocab_size),
        )
        if mine != theirs
    ]
    if any(not 0 <= i < target.num_layers for i in layers):
        mismatched.append(f"fused layers {list(layers)} outside the target's {target.num_layers} layers")
    if mismatched:
        raise InvalidParameterError(f"the EAGLE-3 head {folder} belongs to another target ({'; '.join(mismatched)})")
    return HeadShape(**{**asdict(shape), "feature_layers": layers})


def feature_layers(config: dict, num_layers: int) -> tuple[int, ...]:
    """The hidden-state indices (:mod:`verispec.runners.features`) a head of ``config`` fuses on a
    target of ``num_layers`` layers: vLLM's ids as they are, SGLang's plus one, else the engines'
    default ``(2, N // 2, N - 3)`` (unclamped: a target too shallow for it is refused)."""
    if config.get("eagle_aux_hidden_state_layer_ids"):
        return tuple(int(i) for i in config["eagle_aux_hidden_state_layer_ids"])
    sglang = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if sglang:
        return tuple(int(i) + 1 for i in sglang)
    return 2, num_layers // 2, num_layers - 3


def convert_checkpoint(
    folder: Path, config: dict, tensors: dict[str, Tensor], target: HeadTarget
) -> tuple[HeadShape, dict[str, Tensor]]:
    """``(shape, state dict in verispec's names, float32; d2t as target ids)`` of a published head.

    Raises ModelIntegrityError, InvalidParameterError as :func:`converted_head`."""
    shape = _shape_of(folder, config, target)
    if len(shape.feature_layers) != 3:
        raise _layout_error(folder, f"{len(shape.feature_layers)} fused layers, not 3")
    h, draft, vocab = shape.hidden_size, shape.draft_vocab_size, shape.vocab_size
    q_rows, kv_rows, inner = (
        shape.num_attention_heads * shape.head_dim,
        shape.num_key_value_heads * shape.head_dim,
        shape.intermediate_size,
    )
    expected = {
        "fc.weight": (h, 3 * h),
        "input_norm.weight": (h,),
        "hidden_norm.weight": (h,),
        "q_proj.weight": (q_rows, 2 * h),
        "k_proj.weight": (kv_rows, 2 * h),
        "v_proj.weight": (kv_rows, 2 * h),
        "o_proj.weight": (h, q_rows),
        "post_attention_norm.weight": (h,),
        "gate_proj.weight": (inner, h),
        "up_proj.weight": (inner, h),
        "down_proj.weight": (h, inner),
        "norm.weight": (h,),
        "lm_head.weight": (draft, h),
        "d2t": (draft,),
        "t2d": (vocab,),
        "embed_tokens.weight": (vocab, h),
    }
    unknown = sorted(name for name in tensors if name not in OURS and name not in OPTIONAL)
    if unknown:
        raise _layout_error(folder, f"unknown tensors {', '.join(unknown[:3])}{' ...' if len(unknown) > 3 else ''}")
    if not any(name.startswith("midlayer.") for name in tensors):
        raise _layout_error(folder, "no midlayer.* tensors")
    state = {OURS.get(name, name): t for name, t in tensors.items()}
    shared = "lm_head.weight" not in state and draft == vocab  # SGLang: the target's LM head
    missing = {CHECKPOINT_NAMES[n] for n in expected if n in CHECKPOINT_NAMES and n not in state}
    if missing - ({"lm_head.weight"} if shared else set()):
        missing = sorted(missing)
        raise ModelIntegrityError(f"{folder}: tensors missing: {', '.join(missing)}")
    for name, want in expected.items():  # in the layer's order: the first mismatch named
        if name in state and tuple(state[name].shape) != want:
            raise ModelIntegrityError(
                f"{folder}: {CHECKPOINT_NAMES.get(name, name)} is {list(state[name].shape)}, its config.json "
                f"makes it {list(want)}"
            )
    state["d2t"] = _target_ids(folder, state.pop("d2t", None), state.pop("t2d", None), draft, vocab)
    state.pop("embed_tokens.weight", None)  # the target's embedding is used (module docstring)
    state = {name: t if name == "d2t" else t.float() for name, t in state.items()}
    return HeadShape(**{**asdict(shape), "lm_head_from_target": shared}), state


def _target_ids(folder: Path, d2t: Tensor | None, t2d: Tensor | None, draft: int, vocab: int) -> Tensor:
    """int64 ``[draft]`` target id of each draft row from the offsets ``d2t`` (None: the identity,
    only for a draft vocabulary that is the whole vocabulary), checked against ``t2d``."""
    if d2t is None:
        if draft != vocab:
            raise ModelIntegrityError(f"{folder}: no d2t maps its {draft} draft rows into the {vocab}-token vocabulary")
        return torch.arange(vocab)
    ids = d2t.long() + torch.arange(draft)
    if int(ids.min()) < 0 or int(ids.max()) >= vocab or ids.unique().numel() != draft:
        raise ModelIntegrityError(f"{folder}: its d2t maps draft rows outside the vocabulary or two onto one token")
    if t2d is not None and (int(t2d.bool().sum()) != draft or not bool(t2d.bool()[ids].all())):
        raise ModelIntegrityError(f"{folder}: its t2d and d2t name different draft vocabularies")
    return ids
