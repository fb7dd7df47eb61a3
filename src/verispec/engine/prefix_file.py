"""The prefix cache on disk, for a server's cold start: its blocks saved at shutdown and read back
at start (``--prefix-cache-file``).

Owns the file's payload (a checked cache file, :mod:`verispec.models.cache_files`: a header with
the payload's size and sha256, written atomically): the blocks in parent-first order with their
parts, and the *identity* of what computed them (the model files, the runner, the kernel build,
the block size). A file whose identity differs (weights or kernels changed) is not used, and a
stale, truncated or corrupt one is said once on stderr and ignored: a cached entry is only kept
where it is the bits a recomputation would write. Knows nothing about requests or passes.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import torch

from verispec.engine.prefix_cache import PrefixCache
from verispec.errors import CacheFileError
from verispec.models.cache_files import read_checked, report_damaged, write_checked

KIND = "verispec-prefix-cache-1"


def save_prefix_cache(cache: PrefixCache, path: Path | str, identity: dict) -> int:
    """Write every block of ``cache`` (parts and all) to ``path`` atomically; returns the blocks
    written. Raises OSError where the file cannot be written."""
    # each part cloned: a part is a row of a slab, which torch.save would write whole
    blocks = [(b.name.hex(), b.parent.hex(), {p: t.clone() for p, t in b.parts.items()}) for b in cache.blocks()]
    buffer = io.BytesIO()
    torch.save({"identity": _canonical(identity), "block_size": cache.block_size, "blocks": blocks}, buffer)
    write_checked(path, KIND, buffer.getvalue())
    return len(blocks)


def load_prefix_cache(cache: PrefixCache, path: Path | str, identity: dict) -> int:
    """Read the blocks of ``path`` into ``cache`` (as many as its budget holds, parents first);
    returns the blocks kept. No file: 0. A damaged file, or one written for other weights, another
    kernel build or another block size: said once on stderr, nothing read, 0."""
    try:
        payload = read_checked(path, KIND)
    except FileNotFoundError:
        return 0
    except (CacheFileError, OSError) as exc:
        report_damaged(path, str(exc), "the prefix cache starts empty")
        return 0
    try:
        data = torch.load(io.BytesIO(payload), weights_only=True)
        saved_identity, block_size, blocks = json.loads(data["identity"]), int(data["block_size"]), data["blocks"]
        blocks = [(bytes.fromhex(name), bytes.fromhex(parent), parts) for name, parent, parts in blocks]
    except Exception as exc:  # a checked payload that is not ours: say so, never a traceback
        report_damaged(path, f"holds no prefix cache ({type(exc).__name__})", "the prefix cache starts empty")
        return 0
    identity = json.loads(_canonical(identity))
    if saved_identity != identity or block_size != cache.block_size:
        changed = sorted(k for k in set(identity) | set(saved_identity) if identity.get(k) != saved_identity.get(k))
        what = ", ".join(changed) or "block size"
        report_damaged(path, f"was written for other models or kernels ({what} changed)", "not used")
        return 0
    return sum(cache.restore_block(name, parent, parts) for name, parent, parts in blocks)


def _canonical(identity: dict) -> str:
    """``identity`` as sorted JSON (tuples become lists), the form compared after reading."""
    return json.dumps(identity, sort_keys=True, default=str)
