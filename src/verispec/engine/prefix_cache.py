"""Automatic prefix caching across requests: cache entries kept by the token prefix they follow.

Owns the store of cached blocks: a sequence's tokens cut into blocks of :data:`BLOCK_SIZE`, each
block named by a hash chain (the hash of its parent's name and its own tokens, so a name stands
for the whole prefix up to the block's end, as vLLM v1's ``KVCacheManager`` names blocks), and
for each block the *parts* models keep of it: the target's K and V entries (``"target"``), a draft
model's (named by its drafter), the target features an EAGLE head reads (``"features"``). A block
is kept while memory is under the budget; least recently used blocks that no running request
holds are evicted first, a chain's tail before its head (a block without its parent is never
matched, so evicting a block drops its descendants with it).

Why a hash chain and not a radix tree (SGLang's ``RadixCache``): our runners keep one contiguous
static cache per sequence, read in place by the attention kernels, so cached entries are *copied*
into a sequence's cache (a 1,000-token prompt of the 1.5B target is 57 MB, a few ms) rather than
shared by pointer; block-granular matching (at most ``BLOCK_SIZE - 1`` tokens computed again) is
then as good as token-granular, and a flat dictionary of hashes is simpler to bound, evict and
save to a file than a tree that splits its edges.

Exact by construction on batch-invariant runners (:attr:`verispec.runners.Runner.exports_kv`):
every op of a pass is row-local, so the entries of a token do not depend on how its prompt was
cut into passes or batched with other sequences, and a copied entry is the entry a recomputation
writes, bit for bit. Knows nothing about models, requests or passes: it stores tensors by name.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from verispec.errors import InvalidParameterError

BLOCK_SIZE = 16  # tokens a block (vLLM's default block size)
DEFAULT_PREFIX_CACHE_GIB = 2.0  # the budget when none is given (--prefix-cache-gib)
TARGET_PART = "target"  # the target's K and V entries of a block
FEATURES_PART = "features"  # the target features an EAGLE head reads, one row a token
ROOT = b""  # the parent name of a sequence's first block
SLAB_BLOCKS = 64  # block parts of one shape allocated together (the default target's: 57 MiB, mmapped)


def block_hashes(token_ids: Sequence[int], block_size: int = BLOCK_SIZE, known: Sequence[bytes] = ()) -> list[bytes]:
    """The chain of names of the full blocks of ``token_ids``: name i = blake2b(name i-1 + the
    block's tokens as int32), name -1 = :data:`ROOT`; ``len(token_ids) // block_size`` names.

    ``known``: the names of a prefix of the same tokens computed earlier (they are kept; only the
    rest is hashed). 16-byte digests: a collision (two prefixes, one name) has probability ~2^-64
    over 2^32 cached blocks.
    """
    names = list(known[: len(token_ids) // block_size])
    parent = names[-1] if names else ROOT
    for start in range(len(names) * block_size, len(token_ids) - block_size + 1, block_size):
        tokens = array("i", (int(t) for t in token_ids[start : start + block_size])).tobytes()
        parent = hashlib.blake2b(parent + tokens, digest_size=16).digest()
        names.append(parent)
    return names


@dataclass
class CachedBlock:
    """One block: its name, its parent's, the parts kept (name -> tensor, the block's tokens along
    the part's token dimension: a row of a :class:`Slabs`), the running requests holding it, and
    its children's names."""

    name: bytes
    parent: bytes
    parts: dict[str, Tensor] = field(default_factory=dict)
    refs: int = 0
    children: set[bytes] = field(default_factory=set)

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts.values())


class Slabs:
    """Rows of one shape and dtype, allocated :data:`SLAB_BLOCKS` at a time and reused: an evicted
    block's row holds the next block's part. So the memory the cache touches is the most it ever
    held at once, never more (blocks cloned one by one and freed would leave the C heap
    fragmented: RSS grew to 2.4x the budget under eviction). A slab's pages are resident only once
    a row is written."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.shape, self.dtype = shape, dtype
        self._slabs: list[Tensor] = []
        self._free: list[Tensor] = []

    def take(self, source: Tensor) -> Tensor:
        """A row holding a copy of ``source`` (of this shape and dtype)."""
        if not self._free:
            slab = torch.empty((SLAB_BLOCKS, *self.shape), dtype=self.dtype)
            self._slabs.append(slab)
            self._free = list(slab.unbind(0))[::-1]
        row = self._free.pop()
        row.copy_(source)
        return row

    def give(self, row: Tensor) -> None:
        """``row`` (from :meth:`take`) is free again."""
        self._free.append(row)


@dataclass
class PrefixCacheStats:
    """What the cache did, in tokens and blocks: ``queries`` prompt tokens looked up (one lookup a
    request), ``hits`` of them found cached (vLLM's ``prefix_cache_queries`` / ``_hits``);
    ``evicted_blocks``; ``blocks`` and ``num_bytes`` held now."""

    queries: int = 0
    hits: int = 0
    evicted_blocks: int = 0
    blocks: int = 0
    num_bytes: int = 0

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.queries if self.queries else None


class PrefixCache:
    """Blocks of cache entries by prefix name, under a memory budget.

    Args:
        budget_bytes: bytes the parts of all blocks may take together (0 keeps nothing).
        block_size: tokens a block.
    Raises:
        InvalidParameterError: a negative budget or a block size below 1.
    """

    def __init__(self, budget_bytes: int, block_size: int = BLOCK_SIZE) -> None:
        if budget_bytes < 0:
            raise InvalidParameterError(f"the prefix cache budget must be >= 0 bytes, got {budget_bytes}")
        if block_size < 1:
            raise InvalidParameterError(f"the prefix cache block size must be >= 1 token, got {block_size}")
        self.budget_bytes = int(budget_bytes)
        self.block_size = int(block_size)
        self._blocks: OrderedDict[bytes, CachedBlock] = OrderedDict()  # least recently used first
        self._slabs: dict[tuple, Slabs] = {}  # (shape, dtype) -> the rows parts of that shape live in
        self._queries = self._hits = self._evicted = 0
        self.num_bytes = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, name: bytes) -> bool:
        return name in self._blocks

    @property
    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(self._queries, self._hits, self._evicted, len(self._blocks), self.num_bytes)

    def record_lookup(self, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        """Count one request's lookup: its prompt tokens and those read from the cache."""
        self._queries += num_prompt_tokens
        self._hits += num_cached_tokens

    def match(self, names: Sequence[bytes], parts: Sequence[str]) -> int:
        """How many leading blocks of the chain ``names`` are cached with every part of ``parts``."""
        count = 0
        for name in names:
            block = self._blocks.get(name)
            if block is None or any(part not in block.parts for part in parts):
                break
            count += 1
        return count

    def read(self, names: Sequence[bytes], part: str, dim: int) -> Tensor:
        """A copy of the ``part`` of blocks ``names`` (each cached with it: :meth:`match`),
        concatenated along the token dimension ``dim``; the blocks become the most recently used, the chain's head
        last (so its tail is evicted first)."""
        tensors = [self._blocks[name].parts[part] for name in names]
        self._touch(names)
        return tensors[0].clone() if len(tensors) == 1 else torch.cat(tensors, dim=dim)  # a copy: rows are reused

    def hold(self, names: Sequence[bytes]) -> None:
        """A running request reads these blocks: they are not evicted until :meth:`unhold`."""
        for name in names:
            self._blocks[name].refs += 1

    def unhold(self, names: Sequence[bytes]) -> None:
        """The request that held ``names`` (:meth:`hold`) ended; blocks evicted meanwhile are skipped."""
        for name in names:
            block = self._blocks.get(name)
            if block is not None and block.refs > 0:
                block.refs -= 1

    def refs(self, name: bytes) -> int:
        """Running requests holding block ``name`` (0 for a block not cached)."""
        block = self._blocks.get(name)
        return 0 if block is None else block.refs

    def missing(self, names: Sequence[bytes], part: str) -> range:
        """Indices ``i .. len(names) - 1`` from the first block of the chain not cached with
        ``part`` (empty when all are): what a sequence should :meth:`insert`."""
        return range(self.match(names, (part,)), len(names))

    def insert(self, names: Sequence[bytes], first: int, part: str, entries: Tensor, dim: int) -> int:
        """Keep ``part`` of blocks ``names[first:]``: ``entries`` holds their tokens, in order, along
        ``dim`` (``(len(names) - first) * block_size`` of them). A block's parent must be cached
        (``first == 0`` or ``names[first - 1]`` cached); a part already kept is left as it is (the
        same bits). Blocks past the budget are not kept (evicting unheld ones first, least recently
        used first). Returns the blocks kept; they become the most recently used.
        """
        if first > 0 and names[first - 1] not in self._blocks:
            return 0
        kept = []
        for offset, index in enumerate(range(first, len(names))):
            name = names[index]
            block = self._blocks.get(name)
            if block is not None and part in block.parts:
                kept.append(name)
                continue
            piece = entries.narrow(dim, offset * self.block_size, self.block_size)
            size = piece.numel() * piece.element_size()
            if not self._make_room(size, protect=names[: index + 1]):
                break
            if block is None:
                parent = names[index - 1] if index else ROOT
                block = self._blocks[name] = CachedBlock(name, parent)
                if parent in self._blocks:
                    self._blocks[parent].children.add(name)
            block.parts[part] = self._row(piece)
            self.num_bytes += size
            kept.append(name)
        self._touch(names[: first + len(kept)])
        return len(kept)

    def restore_block(self, name: bytes, parent: bytes, parts: dict[str, Tensor]) -> bool:
        """Keep a block read back from a file (:mod:`verispec.engine.prefix_file`): its parent must
        be cached already (or be :data:`ROOT`); parts already kept stay. False when its parent is
        missing or it does not fit the budget."""
        if parent != ROOT and parent not in self._blocks:
            return False
        block = self._blocks.get(name)
        new_parts = {part: t for part, t in parts.items() if block is None or part not in block.parts}
        size = sum(t.numel() * t.element_size() for t in new_parts.values())
        chain = [name] if parent == ROOT else [parent, name]
        if not self._make_room(size, protect=chain):
            return False
        if block is None:
            block = self._blocks[name] = CachedBlock(name, parent)
            if parent in self._blocks:
                self._blocks[parent].children.add(name)
        block.parts.update({part: self._row(t) for part, t in new_parts.items()})
        self.num_bytes += size
        self._blocks.move_to_end(name)
        return True

    def clear(self) -> None:
        """Drop every block (held ones too: a held block is only protected from eviction) and
        hand the memory back."""
        self._blocks.clear()
        self._slabs.clear()
        self.num_bytes = 0

    def _row(self, source: Tensor) -> Tensor:
        key = (tuple(source.shape), source.dtype)
        slabs = self._slabs.get(key)
        if slabs is None:
            slabs = self._slabs[key] = Slabs(key[0], key[1])
        return slabs.take(source)

    def blocks(self) -> list[CachedBlock]:
        """Every cached block, each after its parent (what :meth:`restore_block` needs), heads of
        chains in least-recently-used order."""
        ordered: list[CachedBlock] = []
        stack = [b for b in reversed(self._blocks.values()) if b.parent not in self._blocks]
        while stack:
            block = stack.pop()
            ordered.append(block)
            stack.extend(self._blocks[c] for c in block.children if c in self._blocks)
        return ordered

    def _touch(self, names: Sequence[bytes]) -> None:
        for name in reversed(names):  # the head last: most recently used, evicted after its tail
            if name in self._blocks:
                self._blocks.move_to_end(name)

    def _make_room(self, size: int, protect: Sequence[bytes]) -> bool:
        """Evict unheld blocks, least recently used first, until ``size`` more bytes fit; never
        the chain ``protect`` being inserted. False when they cannot fit."""
        if size > self.budget_bytes:
            return False
        protected = set(protect)
        while self.num_bytes + size > self.budget_bytes:
            victim = next((b for b in self._blocks.values() if b.refs == 0 and b.name not in protected), None)
            if victim is None:
                return False
            self._evict(victim)
        return True

    def _evict(self, block: CachedBlock) -> None:
        """Drop ``block`` and its descendants (unreachable without it)."""
        stack = [block]
        while stack:
            current = stack.pop()
            if self._blocks.pop(current.name, None) is None:
                continue
            self.num_bytes -= current.num_bytes
            for row in current.parts.values():
                self._slabs[(tuple(row.shape), row.dtype)].give(row)
            self._evicted += 1
            stack.extend(self._blocks[c] for c in current.children if c in self._blocks)
        parent = self._blocks.get(block.parent)
        if parent is not None:
            parent.children.discard(block.name)
