"""An EAGLE head's file as GGUF (architecture ``eagle3``): its shape, fused layers and draft
vocabulary map as metadata, how it was trained as a JSON string, every weight as an F32 tensor,
and a sha256 of the tensor bytes so a damaged file is refused, never read.

Owns the file layout only; knows nothing about what the weights compute (``eagle_head.py``).
Keys (``eagle3.`` prefix): every :class:`~verispec.runners.eagle_head.HeadShape` field (ints,
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

from verispec.errors import ModelIntegrityError

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


def write_head_gguf(path: str | Path, config: dict, state: dict[str, Tensor], training: dict) -> None:
    """Write a head as GGUF, atomically (a temporary file beside ``path``, then a rename).

    Args:
        config: the head's shape (``EagleHead.config``: ints, floats, strings, ``feature_layers``).
        state: the state dict (float tensors written as F32, ``d2t`` as I64).
        training: how it was trained (any JSON-serialisable dict).
    """
    from gguf import GGUFWriter

    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    arrays = [(name, value.detach().cpu().numpy().astype(np.int64 if name == "d2t" else np.float32)) for name, value in state.items()]
    writer = GGUFWriter(partial, ARCHITECTURE)
    for key, value in config.items():
        if key == "architecture":
            continue
        if isinstance(value, (list, tuple)):
            writer.add_array(f"{ARCHITECTURE}.{key}", [int(v) for v in value])
        elif isinstance(value, bool) or isinstance(value, int):
            writer.add_int64(f"{ARCHITECTURE}.{key}", int(value))
        elif isinstance(value, float):
            writer.add_float64(f"{ARCHITECTURE}.{key}", value)
        else:
            writer.add_string(f"{ARCHITECTURE}.{key}", str(value))
    writer.add_string(f"{ARCHITECTURE}.training", json.dumps(training, sort_keys=True))
    writer.add_string(f"{ARCHITECTURE}.tensors_sha256", _tensors_sha256(arrays))
    for name, array in arrays:
        writer.add_tensor(name, array)
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
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
        fields = {name: field.contents() for name, field in reader.fields.items()}
    except Exception as exc:  # gguf raises ValueError, IndexError, ... for a damaged file
        raise ModelIntegrityError(f"{path} is not a readable GGUF file ({type(exc).__name__}: {exc})") from exc
    if fields.get("general.architecture") != ARCHITECTURE:
        raise ModelIntegrityError(f"{path} is a GGUF file of architecture {fields.get('general.architecture')!r}, not an EAGLE head ({ARCHITECTURE})")
    try:
        arrays = [(t.name, np.array(t.data).reshape(tuple(reversed([int(n) for n in t.shape])))) for t in reader.tensors]
    except Exception as exc:
        raise ModelIntegrityError(f"{path}: its tensors cannot be read ({type(exc).__name__}: {exc})") from exc
    prefix = f"{ARCHITECTURE}."
    if _tensors_sha256(arrays) != fields.get(prefix + "tensors_sha256"):
        raise ModelIntegrityError(f"{path}: its weights do not match the sha256 it recorded (a damaged file)")
    config = {key[len(prefix):]: value for key, value in fields.items() if key.startswith(prefix)}
    training = json.loads(config.pop("training", "{}"))
    config.pop("tensors_sha256")
    state = {name: torch.from_numpy(array.copy()) for name, array in arrays}
    return config, state, training
