"""Which KV sequences share a prompt's leading blocks: the admission's prefix index.

An admission asks every sequence how many of the new lane's tokens it holds
(the executor's ``_pick_slot``). Asked by scanning, that is a common-prefix
comparison per sequence: at 1,024 lanes about 2 ms an admission, so a burst of
a thousand admissions held a chat's Admit behind it for 2 s
(bench-results/81e88a5/pyspy-worker-1024x1024.txt: 45% of the worker's time).

This index keys each sequence's tokens by whole blocks of ``BLOCK`` tokens: the
node of block ``k`` is a hash chained over the salt and blocks ``1..k``, and
holds the sequences whose first ``k`` blocks are those tokens. The sequences
holding at least ``BLOCK * k`` tokens of a prompt are the members of the
prompt's own ``k``-th node, and the nodes nest (a member of node ``k`` is a
member of node ``k - 1``), so the deepest level some sequence reaches is a
binary search over the prompt's chain. Hashes can collide (token ids are the
user's input), so a member is only a candidate: the caller compares tokens
before it trusts a match.

A node with one member stores the sequence number itself, not a set: most
nodes past a shared system prompt belong to one conversation.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["BLOCK", "BlockIndex"]

BLOCK = 32   # tokens a node covers; a match is resolved within a block by comparing tokens


def chain(tokens: Sequence[int], n_blocks: int, salt: str, prev: list[int] | None = None) -> list[int]:
    """The node hashes of ``tokens``' first ``n_blocks`` blocks under ``salt``,
    continuing ``prev`` (the chain of a prefix of the same tokens) if given."""
    out = list(prev) if prev else []
    h = out[-1] if out else hash(("salt", salt))
    for k in range(len(out), n_blocks):
        h = hash((h, tuple(tokens[k * BLOCK:(k + 1) * BLOCK])))
        out.append(h)
    return out


class BlockIndex:
    """Node hash -> the sequences whose leading blocks chain to it; and each
    sequence's chain and salt. Only the executor writes it."""

    def __init__(self, n_seq: int) -> None:
        self._nodes: dict[int, int | set[int]] = {}
        self._chains: list[list[int]] = [[] for _ in range(n_seq)]
        self._salt: list[str] = [""] * n_seq
        self._by_salt: dict[str, set[int]] = {"": set(range(n_seq))}

    # -- writing ---------------------------------------------------------------

    def set(self, seq: int, tokens: Sequence[int], n: int, salt: str) -> None:
        """``seq`` now holds ``tokens[:n]`` computed under ``salt``."""
        old = self._chains[seq]
        if salt != self._salt[seq]:
            self._drop(seq, old, 0)
            self._move_salt(seq, salt)
            old = []
        # keep the old chain as far as its blocks are still the new tokens' (hash equal is
        # enough here: a collision only makes this sequence a candidate the caller checks)
        new = chain(tokens, n // BLOCK, salt)
        keep = 0
        while keep < min(len(old), len(new)) and old[keep] == new[keep]:
            keep += 1
        self._drop(seq, old, keep)
        for h in new[keep:]:
            self._add(h, seq)
        self._chains[seq] = new

    def grow(self, seq: int, tokens: Sequence[int], n: int) -> None:
        """``seq``'s tokens grew to ``tokens[:n]`` (same prefix, more of it)."""
        old = self._chains[seq]
        if n // BLOCK <= len(old):
            return
        new = chain(tokens, n // BLOCK, self._salt[seq], old)
        for h in new[len(old):]:
            self._add(h, seq)
        self._chains[seq] = new

    def truncate(self, seq: int, n: int) -> None:
        """``seq`` keeps only its first ``n`` tokens."""
        old = self._chains[seq]
        keep = n // BLOCK
        if keep < len(old):
            self._drop(seq, old, keep)
            self._chains[seq] = old[:keep]

    def copy(self, src: int, dst: int) -> None:
        """``dst`` now holds what ``src`` holds (a whole-sequence copy)."""
        self._drop(dst, self._chains[dst], 0)
        self._chains[dst] = []
        if self._salt[dst] != self._salt[src]:
            self._move_salt(dst, self._salt[src])
        for h in self._chains[src]:
            self._add(h, dst)
        self._chains[dst] = list(self._chains[src])

    def _move_salt(self, seq: int, salt: str) -> None:
        old = self._by_salt[self._salt[seq]]
        old.discard(seq)
        if not old:
            del self._by_salt[self._salt[seq]]
        self._salt[seq] = salt
        self._by_salt.setdefault(salt, set()).add(seq)

    def _add(self, h: int, seq: int) -> None:
        cur = self._nodes.get(h)
        if cur is None:
            self._nodes[h] = seq
        elif isinstance(cur, int):
            if cur != seq:
                self._nodes[h] = {cur, seq}
        else:
            cur.add(seq)

    def _drop(self, seq: int, hashes: list[int], start: int) -> None:
        for h in hashes[start:]:
            cur = self._nodes.get(h)
            if cur is None:
                continue
            if isinstance(cur, int):
                if cur == seq:
                    del self._nodes[h]
            else:
                cur.discard(seq)
                if len(cur) == 1:
                    self._nodes[h] = next(iter(cur))

    # -- reading ---------------------------------------------------------------

    def members(self, h: int) -> set[int]:
        cur = self._nodes.get(h)
        if cur is None:
            return set()
        return {cur} if isinstance(cur, int) else cur

    def salted(self, salt: str) -> set[int]:
        """Every sequence last computed under ``salt`` (the chain's level 0)."""
        return self._by_salt.get(salt, set())

    def chain_of(self, seq: int) -> list[int]:
        return self._chains[seq]

    def hits(self, h: int, within: set[int]) -> bool:
        """Some member of node ``h`` is in ``within``."""
        cur = self._nodes.get(h)
        if cur is None:
            return False
        return cur in within if isinstance(cur, int) else not cur.isdisjoint(within)

    def deepest(self, q: list[int], lo: int, within: set[int] | None = None) -> int:
        """The largest level ``k`` in ``[lo, len(q)]`` whose node ``q[k-1]`` has a
        member (in ``within`` if given), assuming level ``lo`` has one. Levels
        nest, so this is a binary search; a hash collision can only make a
        level look reached, which the caller's token comparison catches."""
        a, b = lo, len(q)
        while a < b:
            mid = (a + b + 1) // 2
            h = q[mid - 1]
            ok = self.hits(h, within) if within is not None else h in self._nodes
            if ok:
                a = mid
            else:
                b = mid - 1
        return a

    def sizes(self) -> tuple[int, int]:
        """(nodes, memberships): for a memory check."""
        return len(self._nodes), sum(1 if isinstance(v, int) else len(v) for v in self._nodes.values())

