"""N-gram (prompt lookup) proposals: the longest suffix of a request's tokens, n in [min, max], that occurred
before proposes the tokens that followed its latest earlier occurrence. Pure Python.

Each request keeps an index n-gram -> position after its latest occurrence, extended by the tokens added
since the last step, so a step costs O(new tokens x n range) per request instead of a scan of the context
(vLLM rescans with KMP in numba).

A match close to the end runs into the suffix itself: the text is then periodic with period L - j, and the
proposal continues that period (for "a b a b" it proposes "a b a b ..." rather than stopping at the end).
"""

from __future__ import annotations


class NgramIndex:
    def __init__(self, n_min: int, n_max: int):
        self.n_range = range(n_max, n_min - 1, -1)  # longest first
        self.maps: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.n_range}
        self.num_indexed = 0  # continuation positions j < num_indexed are in the maps

    def _update(self, tokens: list[int]) -> None:
        # Position j continues the n-gram tokens[j-n:j] for j < len. The suffix itself (j = len) is not
        # indexed, so a lookup of the suffix finds an earlier occurrence only.
        for j in range(self.num_indexed, len(tokens)):
            for n, table in self.maps.items():
                if j >= n:
                    table[tuple(tokens[j - n : j])] = j
        self.num_indexed = len(tokens)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k proposed tokens after `tokens` (the request's prompt + output so far); [] without a match."""
        self._update(tokens)
        length = len(tokens)
        if k <= 0:
            return []
        for n in self.n_range:
            if n >= length:
                continue
            j = self.maps[n].get(tuple(tokens[length - n :]))
            if j is not None:
                out: list[int] = []
                for i in range(k):  # past the end, the match's period repeats
                    pos = j + i
                    out.append(tokens[pos] if pos < length else out[pos - length])
                return out
        return []
