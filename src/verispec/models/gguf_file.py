"""A GGUF file's header without the weights: metadata scalars, tensor table, tokenizer digest.

Owns parsing the GGUF header (spec: ggml-org/ggml ``docs/gguf.md``) fast enough for a cold start:
scalars are decoded, arrays are skipped (the tokenizer's 150k strings included) and only their
byte ranges kept, which also gives a digest of the tokenizer so two files sharing one tokenizer
are known to without building either (the tokenizer itself: ``gguf_tokenizer.py``).
Knows nothing about running models.
"""

from __future__ import annotations

import hashlib
import os
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from verispec.errors import ModelIntegrityError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# GGUF value types -> struct format of the scalar (8 = string, 9 = array)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_MAX_COUNT = 1 << 24


@dataclass(frozen=True)
class TensorInfo:
    """One tensor: ``qtype`` (ggml type id), ``shape`` in ggml order (ne0 = row length first),
    ``offset`` (absolute, bytes) and ``n_bytes``."""

    name: str
    qtype: int
    shape: tuple[int, ...]
    offset: int
    n_bytes: int

    @property
    def type_name(self) -> str:
        from gguf import GGMLQuantizationType

        try:
            return GGMLQuantizationType(self.qtype).name
        except ValueError:
            return f"type {self.qtype}"


@dataclass
class GGUFHeader:
    """Parsed header: ``metadata`` holds scalars and strings; arrays appear as their element count.

    ``tokenizer_digest``: sha256 over the raw bytes of every ``tokenizer.*`` entry (equal digests:
    the same tokenizer). ``tokens_digest``: sha256 over the raw bytes of ``tokenizer.ggml.tokens``
    alone (equal digests: the same token string for every id; "" when the file has no token list).
    """

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    tokenizer_digest: str
    file_size: int
    parse_time_s: float = 0.0
    arrays: dict[str, tuple[int, int, int]] = field(default_factory=dict)  # name -> (type, count, offset)
    tokens_digest: str = ""

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def arch_value(self, key: str, default: Any = None) -> Any:
        """``{architecture}.{key}`` from the metadata, or ``default``."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def read_array(self, name: str) -> list:
        """Decode one array entry (e.g. ``tokenizer.ggml.token_type``); strings as str."""
        value_type, count, offset = self.arrays[name]
        with open(self.path, "rb") as source:
            source.seek(offset)
            reader = _Reader(source, self.path)
            return [reader.value(value_type) for _ in range(count)]


class _Reader:
    def __init__(self, source, path: Path) -> None:
        self.source, self.path = source, path

    def take(self, size: int) -> bytes:
        data = self.source.read(size)
        if len(data) != size:
            size_now = os.fstat(self.source.fileno()).st_size
            raise ModelIntegrityError(
                f"{self.path} is truncated: its GGUF header ends early, at byte {size_now} (the file's size); "
                + refetch_hint(self.path)
            )
        return data

    def unpack(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        length = self.unpack("<Q")
        if length > 1 << 30:
            raise ModelIntegrityError(f"{self.path} is not a valid GGUF file: a {length}-byte string")
        return self.take(length).decode("utf-8", errors="replace")

    def value(self, value_type: int):
        if value_type in _SCALARS:
            return self.unpack(_SCALARS[value_type])
        if value_type == 8:
            return self.string()
        raise ModelIntegrityError(f"{self.path} is not a valid GGUF file: value type {value_type}")

    def skip_array(self, value_type: int, count: int) -> None:
        if value_type in _SCALARS:
            self.source.seek(struct.calcsize(_SCALARS[value_type]) * count, os.SEEK_CUR)
        elif value_type == 8:  # length-prefixed strings: walk the lengths in chunks
            for _ in range(count):
                (length,) = struct.unpack("<Q", self.take(8))
                self.source.seek(length, os.SEEK_CUR)
        else:
            raise ModelIntegrityError(f"{self.path} is not a valid GGUF file: nested array of type {value_type}")


def read_gguf_header(path: Path) -> GGUFHeader:
    """Parse ``path``'s GGUF header (no tensor data is read).

    Raises:
        ModelIntegrityError: not a GGUF file, a truncated header, implausible counts, or a tensor
            table that points past the end of the file (the message gives the file's size, the
            size its tensor table needs and how to fetch it again).
    """
    from gguf import GGML_QUANT_SIZES

    start = time.perf_counter()
    path = Path(path)
    file_size = path.stat().st_size
    metadata: dict[str, Any] = {}
    arrays: dict[str, tuple[int, int, int]] = {}
    digest = hashlib.sha256()
    tokens_digest = ""
    with open(path, "rb", buffering=1 << 20) as source:
        reader = _Reader(source, path)
        if reader.take(4) != GGUF_MAGIC:
            raise ModelIntegrityError(f"{path} is not a valid GGUF file: it does not start with the GGUF magic bytes")
        version = reader.unpack("<I")
        if version not in (2, 3):
            raise ModelIntegrityError(f"{path} is not a valid GGUF file: version {version} is not 2 or 3")
        tensor_count, kv_count = reader.unpack("<Q"), reader.unpack("<Q")
        if tensor_count > _MAX_COUNT or kv_count > _MAX_COUNT:
            raise ModelIntegrityError(f"{path} is not a valid GGUF file: implausible header")
        for _ in range(kv_count):
            key = reader.string()
            value_type = reader.unpack("<I")
            begin = source.tell()
            if value_type == 9:
                item_type, count = reader.unpack("<I"), reader.unpack("<Q")
                if count > 1 << 28:
                    raise ModelIntegrityError(f"{path} is not a valid GGUF file: array {key} of {count} items")
                arrays[key] = (item_type, count, source.tell())
                reader.skip_array(item_type, count)
                metadata[key] = count
            else:
                metadata[key] = reader.value(value_type)
            if key.startswith("tokenizer."):
                end = source.tell()
                source.seek(begin)
                raw = reader.take(end - begin)
                digest.update(key.encode())
                digest.update(raw)
                if key == "tokenizer.ggml.tokens":
                    tokens_digest = hashlib.sha256(raw).hexdigest()
        raw_tensors = []
        for _ in range(tensor_count):
            name = reader.string()
            n_dims = reader.unpack("<I")
            if n_dims > 8:
                raise ModelIntegrityError(f"{path} is not a valid GGUF file: tensor {name} has {n_dims} dimensions")
            shape = tuple(reader.unpack("<Q") for _ in range(n_dims))
            qtype, offset = reader.unpack("<I"), reader.unpack("<Q")
            raw_tensors.append((name, qtype, shape, offset))
        alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = -(-source.tell() // alignment) * alignment
    tensors = {}
    needed = data_start if raw_tensors else 0  # a vocabulary-only file ends at its header, unpadded
    for name, qtype, shape, offset in raw_tensors:
        if qtype not in GGML_QUANT_SIZES:
            raise ModelIntegrityError(f"{path}: tensor {name} has unknown type {qtype}")
        block, type_size = GGML_QUANT_SIZES[qtype]
        elements = 1
        for dim in shape:
            elements *= dim
        n_bytes = elements // block * type_size
        needed = max(needed, data_start + offset + n_bytes)
        tensors[name] = TensorInfo(name, qtype, shape, data_start + offset, n_bytes)
    if needed > file_size:
        raise ModelIntegrityError(
            f"{path} is truncated: it has {file_size} bytes and its tensor table needs {needed}; " + refetch_hint(path)
        )
    return GGUFHeader(
        path, metadata, tensors, digest.hexdigest(), file_size, time.perf_counter() - start, arrays, tokens_digest
    )


def refetch_hint(path: Path) -> str:
    """How to get a whole copy of ``path`` again: ``verispec models fetch NAME --force`` when its
    file name is a built-in model's, else a download or copy."""
    from verispec.models.registry import BUILTIN_MODELS

    names = [entry.name for entry in BUILTIN_MODELS.values() if entry.file_name == Path(path).name]
    if names:
        command = f"verispec models fetch {names[0]}"
        return f"fetch it again with `{command} --force` (or delete it and run `{command}`)"
    return "download or copy it again (an interrupted download leaves a file like this)"
