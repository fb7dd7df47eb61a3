"""An EAGLE head's file as GGUF (architecture ``eagle3``): its shape, fused layers and draft
vocabulary map as metadata, how it was trained as a JSON string, the weights as F32 tensors (or
F16, or Q8_0 blocks for the matrices: a head to ship or serve; read back as float32), and a sha256
of the tensor bytes so a damaged file is refused, never read.

Owns the file layout only; knows nothing about what the weights compute (:mod:`.head`).
Keys (``eagle3.`` prefix): every :class:`~verispec.runners.eagle.head.HeadShape` field (ints,
floats, strings; ``feature_layers`` an int array), ``training`` (JSON: command, seed, data
manifest, runs), ``tensors_sha256``; tensors: the state dict (``d2t`` as I64).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from verispec.errors import InvalidParameterError, ModelIntegrityError

ARCHITECTURE = "eagle3"
MAGIC = b"GGUF"


def is_gguf(path: str | Path) -> bool:
    """True when ``path`` starts with GGUF's magic bytes."""
    with open(path, "rb") as file:
        return file.read(4) == MAGIC


def _tensors_sha256(arrays: list[tuple[str, np.ndarray]]) -> str:
    digest = hashlib.sha256()
    for name, array in arrays:
        digest.update(name.encode())
        digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()


WEIGHT_TYPES = ("f32", "f16", "q8_0")


def _stored(name: str, value: Tensor, weights: str) -> tuple[np.ndarray, object]:
    """``(array, raw ggml type or None)`` of one tensor as ``weights`` stores it: ``d2t`` I64,
    vectors F32, matrices F32 / F16 / Q8_0 blocks (a width that is not a multiple of 32: F16)."""
    from gguf import GGMLQuantizationType, quants

    array = value.detach().cpu().numpy()
    if name == "d2t":
        return array.astype(np.int64), None
    array = array.astype(np.float32)
    if array.ndim < 2 or weights == "f32":
        return array, None
    if weights == "q8_0" and array.shape[-1] % 32 == 0:
        return np.ascontiguousarray(quants.quantize(array, GGMLQuantizationType.Q8_0)), GGMLQuantizationType.Q8_0
    return array.astype(np.float16), None


def write_head_gguf(
    path: str | Path, config: dict, state: dict[str, Tensor], training: dict, weights: str = "f32"
) -> None:
    """Write a head as GGUF, atomically (a temporary file beside ``path``, then a rename).

    Args:
        config: the head's shape (``EagleHead.config``: ints, floats, strings, ``feature_layers``).
        state: the state dict (``d2t`` written as I64, vectors as F32).
        training: how it was trained (any JSON-serialisable dict).
        weights: the matrices as ``"f32"`` (4 bytes a weight: what training resumes from),
            ``"f16"`` (2) or ``"q8_0"`` (1.0625: ggml's blocks of 32 int8 values and an fp16
            scale, what the gguf runner drafts with anyway).
    Raises:
        InvalidParameterError: an unknown ``weights``.
    """
    from gguf import GGUFWriter

    if weights not in WEIGHT_TYPES:
        raise InvalidParameterError(f"head weights must be one of {', '.join(WEIGHT_TYPES)}, not {weights!r}")
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    stored = [(name, *_stored(name, value, weights)) for name, value in state.items()]
    arrays = [(name, array) for name, array, _ in stored]
    writer = GGUFWriter(partial, ARCHITECTURE)
    for key, value in config.items():
        if key == "architecture":
            continue
        if isinstance(value, (list, tuple)):
            writer.add_array(f"{ARCHITECTURE}.{key}", [int(v) for v in value])
        elif isinstance(value, (bool, int)):
            writer.add_int64(f"{ARCHITECTURE}.{key}", int(value))
        elif isinstance(value, float):
            writer.add_float64(f"{ARCHITECTURE}.{key}", value)
        else:
            writer.add_string(f"{ARCHITECTURE}.{key}", str(value))
    writer.add_string(f"{ARCHITECTURE}.training", json.dumps(training, sort_keys=True))
    writer.add_string(f"{ARCHITECTURE}.tensors_sha256", _tensors_sha256(arrays))
    for name, array, raw_dtype in stored:
        writer.add_tensor(name, array, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(partial, path)


def read_head_gguf(path: str | Path) -> tuple[dict, dict[str, Tensor], dict]:
    """``(config, state, training)`` of a head written by :func:`write_head_gguf`.

    Raises:
        ModelIntegrityError: not a GGUF file of architecture ``eagle3``, truncated, or its
            tensors' sha256 differs from the one it recorded (a damaged file).
    """
    from gguf import GGMLQuantizationType, GGUFReader, quants

    try:
        reader = GGUFReader(path)
        fields = {name: field.contents() for name, field in reader.fields.items()}
    except Exception as exc:  # gguf raises ValueError, IndexError, ... for a damaged file
        raise ModelIntegrityError(f"{path} is not a readable GGUF file ({type(exc).__name__}: {exc})") from exc
    if fields.get("general.architecture") != ARCHITECTURE:
        raise ModelIntegrityError(
            f"{path} is a GGUF file of architecture {fields.get('general.architecture')!r}, "
            f"not an EAGLE head ({ARCHITECTURE})"
        )
    try:
        arrays, types = [], {}
        for t in reader.tensors:
            if t.tensor_type == GGMLQuantizationType.Q8_0:  # [rows, blocks * 34] bytes, as written
                arrays.append((t.name, np.array(t.data)))
                types[t.name] = t.tensor_type
            else:
                arrays.append((t.name, np.array(t.data).reshape(tuple(reversed([int(n) for n in t.shape])))))
    except Exception as exc:
        raise ModelIntegrityError(f"{path}: its tensors cannot be read ({type(exc).__name__}: {exc})") from exc
    prefix = f"{ARCHITECTURE}."
    if _tensors_sha256(arrays) != fields.get(prefix + "tensors_sha256"):
        raise ModelIntegrityError(f"{path}: its weights do not match the sha256 it recorded (a damaged file)")
    config = {key[len(prefix) :]: value for key, value in fields.items() if key.startswith(prefix)}
    training = json.loads(config.pop("training", "{}"))
    config.pop("tensors_sha256")
    try:
        state = {
            name: torch.from_numpy(
                np.ascontiguousarray(quants.dequantize(array, types[name]) if name in types else array).astype(
                    np.int64 if name == "d2t" else np.float32
                )
            )
            for name, array in arrays
        }
    except Exception as exc:
        raise ModelIntegrityError(f"{path}: its tensors cannot be read ({type(exc).__name__}: {exc})") from exc
    return config, state, training
