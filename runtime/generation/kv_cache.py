"""Paged KV-cache bookkeeping: which fixed-size blocks of the shared pool each sequence owns.

The pool itself (the tensors) belongs to the model; this class only hands out block
numbers. A sequence's *block table* lists its blocks in order, so token position
``p`` lives in block ``table[p // block_size]`` at offset ``p % block_size``.
Allocation is all-or-nothing: a request for more blocks than are free changes nothing.
"""

from __future__ import annotations


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # pop from the end: low block numbers are handed out first
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[int, list[int]] = {}

    # -- figures --------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-max(0, num_tokens) // self.block_size)

    def blocks_missing(self, seq_id: int, num_tokens: int) -> int:
        """How many more blocks ``seq_id`` needs to hold ``num_tokens`` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(self._tables.get(seq_id, ())))

    def can_hold(self, seq_id: int, num_tokens: int) -> bool:
        return self.blocks_missing(seq_id, num_tokens) <= len(self._free)

    # -- changes --------------------------------------------------------------------
    def allocate(self, seq_id: int, num_tokens: int) -> bool:
        """Grow ``seq_id``'s table to hold ``num_tokens`` tokens; False (and no change) if short."""
        missing = self.blocks_missing(seq_id, num_tokens)
        if missing > len(self._free):
            return False
        table = self._tables.setdefault(seq_id, [])
        for _ in range(missing):
            table.append(self._free.pop())
        return True

    def free(self, seq_id: int) -> int:
        """Return all of ``seq_id``'s blocks to the pool; returns how many were freed."""
        table = self._tables.pop(seq_id, [])
        self._free.extend(reversed(table))
        return len(table)

    def truncate(self, seq_id: int, num_tokens: int) -> int:
        """Shrink ``seq_id``'s table to the blocks that hold its first ``num_tokens`` tokens
        (the positions of rejected speculative tokens go back to the pool); returns how
        many blocks were freed."""
        table = self._tables.get(seq_id)
        if not table:
            return 0
        keep = self.blocks_for(num_tokens)
        freed = table[keep:]
        del table[keep:]
        self._free.extend(reversed(freed))
        return len(freed)

    def block_table(self, seq_id: int) -> list[int]:
        return list(self._tables.get(seq_id, ()))

    def owners(self) -> list[int]:
        return list(self._tables)
