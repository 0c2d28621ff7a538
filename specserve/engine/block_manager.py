"""Paged KV cache blocks: allocation, prefix caching of full blocks (hash chain), freeing."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None  # set once the block is full and registered for reuse


def chain_hash(prev: bytes | None, token_ids: list[int]) -> bytes:
    """Hash of a full block given the hash of the block before it (so equal hash = equal prefix)."""
    h = hashlib.blake2b(digest_size=16)
    if prev is not None:
        h.update(prev)
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.digest()


@dataclass
class BlockTable:
    """One request's blocks and the hashes of its full blocks (index-aligned with `blocks`)."""

    blocks: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)


class BlockManager:
    """Fixed-size KV blocks shared by all requests.

    Free blocks with a hash stay in the prefix cache (LRU) until reused for new content; a request
    whose prompt starts with cached full blocks takes them by reference instead of recomputing.
    Invariant: free + used == total at every step.
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        assert num_blocks >= 2, "need at least one usable block besides the padding block"
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        # block 0 is reserved as the padding block (padding rows write there); never handed out
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free_plain: list[int] = list(range(num_blocks - 1, 0, -1))  # stack, no hash
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # LRU of free hashed blocks
        self._hash_to_block: dict[bytes, int] = {}

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_plain) + len(self._free_cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - self.num_free_blocks

    def usage(self) -> float:
        return self.num_used_blocks / max(1, self.num_usable_blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    # -- prefix cache -------------------------------------------------------------------------
    def match_prefix(self, token_ids: list[int]) -> tuple[list[int], list[bytes]]:
        """Cached full blocks covering a prefix of token_ids (at least one token is left to
        compute, so the last prompt token always produces logits)."""
        if not self.enable_prefix_caching:
            return [], []
        bs = self.block_size
        max_full = (len(token_ids) - 1) // bs
        blocks: list[int] = []
        hashes: list[bytes] = []
        prev: bytes | None = None
        for b in range(max_full):
            h = chain_hash(prev, token_ids[b * bs : (b + 1) * bs])
            bid = self._hash_to_block.get(h)
            if bid is None:
                break
            blocks.append(bid)
            hashes.append(h)
            prev = h
        return blocks, hashes

    def take_cached(self, table: BlockTable, blocks: list[int], hashes: list[bytes]) -> None:
        for bid, h in zip(blocks, hashes):
            blk = self.blocks[bid]
            if blk.ref_count == 0:
                del self._free_cached[bid]
            blk.ref_count += 1
            table.blocks.append(bid)
            table.hashes.append(h)

    # -- allocation ---------------------------------------------------------------------------
    def can_allocate(self, table: BlockTable, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) - len(table.blocks) <= self.num_free_blocks

    def allocate(self, table: BlockTable, num_tokens: int) -> None:
        """Grow `table` to hold num_tokens tokens. Caller checked can_allocate."""
        need = self.blocks_needed(num_tokens) - len(table.blocks)
        for _ in range(need):
            table.blocks.append(self._pop_free())

    def _pop_free(self) -> int:
        if self._free_plain:
            bid = self._free_plain.pop()
        else:
            bid, _ = self._free_cached.popitem(last=False)  # evict least recently freed
            blk = self.blocks[bid]
            if blk.block_hash is not None and self._hash_to_block.get(blk.block_hash) == bid:
                del self._hash_to_block[blk.block_hash]
            blk.block_hash = None
        self.blocks[bid].ref_count = 1
        return bid

    def register_full_blocks(self, table: BlockTable, token_ids: list[int], num_valid: int) -> None:
        """Hash every block whose num_valid tokens of KV are now all computed and committed."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        full = min(num_valid, len(token_ids)) // bs
        while len(table.hashes) < min(full, len(table.blocks)):
            b = len(table.hashes)
            prev = table.hashes[-1] if table.hashes else None
            h = chain_hash(prev, token_ids[b * bs : (b + 1) * bs])
            table.hashes.append(h)
            bid = table.blocks[b]
            blk = self.blocks[bid]
            if h not in self._hash_to_block:
                blk.block_hash = h
                self._hash_to_block[h] = bid

    def truncate(self, table: BlockTable, num_tokens: int) -> None:
        """Drop blocks past num_tokens (rollback of optimistically grown KV) and hashes that
        covered tokens past it."""
        keep = self.blocks_needed(num_tokens)
        while len(table.blocks) > keep:
            self._release(table.blocks.pop())
        full = num_tokens // self.block_size
        del table.hashes[full:]

    def free(self, table: BlockTable) -> None:
        # reversed: tail blocks are the least likely to be shared, so they are evicted first
        for bid in reversed(table.blocks):
            self._release(bid)
        table.blocks.clear()
        table.hashes.clear()

    def _release(self, bid: int) -> None:
        blk = self.blocks[bid]
        blk.ref_count -= 1
        assert blk.ref_count >= 0, f"block {bid} freed twice"
        if blk.ref_count == 0:
            if blk.block_hash is not None:
                self._free_cached[bid] = None
            else:
                self._free_plain.append(bid)

    def check_invariants(self) -> None:
        used = sum(1 for b in self.blocks[1:] if b.ref_count > 0)
        assert used + self.num_free_blocks == self.num_usable_blocks, "free + used != total"
