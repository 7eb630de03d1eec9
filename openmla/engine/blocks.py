"""Paged KV-cache bookkeeping: a free list of physical blocks and per-request block tables."""

from __future__ import annotations

from collections import deque

__all__ = ["BlockAllocator", "BlockManager"]


class BlockAllocator:
    r"""A free list of ``num_blocks`` physical cache blocks.

    Args:
        num_blocks (int): blocks in the cache.

    Raises:
        ValueError: ``num_blocks`` < 1.
    """

    def __init__(self, num_blocks: int) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive int; got {num_blocks!r}")
        self.num_blocks = num_blocks
        self._free = deque(range(num_blocks))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """Take ``n`` blocks, or return None (taking nothing) when fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            return None
        blocks = [self._free.popleft() for _ in range(n)]
        self._used.update(blocks)
        return blocks

    def free(self, blocks: list[int]) -> None:
        """Return blocks to the free list.

        Raises:
            ValueError: a block that is not allocated (double free).
        """
        for b in blocks:
            if b not in self._used:
                raise ValueError(f"block {b} is not allocated")
            self._used.remove(b)
            self._free.append(b)


class BlockManager:
    r"""Per-request block tables on top of a :class:`BlockAllocator`.

    Args:
        num_blocks (int): blocks in the cache.
        block_size (int): tokens per block.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int; got {block_size!r}")
        self.allocator = BlockAllocator(num_blocks)
        self.block_size = block_size
        self.tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def ensure(self, req_id: str, num_tokens: int) -> bool:
        """Grow ``req_id``'s table to hold ``num_tokens`` tokens; False (and no change) if out of blocks."""
        table = self.tables.setdefault(req_id, [])
        extra = self.blocks_needed(num_tokens) - len(table)
        if extra <= 0:
            return True
        got = self.allocator.allocate(extra)
        if got is None:
            if not table:
                del self.tables[req_id]
            return False
        table.extend(got)
        return True

    def free(self, req_id: str) -> None:
        """Release every block of ``req_id`` (no-op for an unknown request)."""
        table = self.tables.pop(req_id, None)
        if table:
            self.allocator.free(table)

    def table(self, req_id: str) -> list[int]:
        return self.tables.get(req_id, [])

    def slot(self, req_id: str, position: int) -> int:
        """Cache slot of ``req_id``'s token at ``position`` (``block * block_size + offset``)."""
        table = self.tables[req_id]
        return table[position // self.block_size] * self.block_size + position % self.block_size
