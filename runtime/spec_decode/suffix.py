"""Suffix decoding proposals (Arctic Inference's method, arXiv 2411.04975, our own implementation). Pure Python.

The request's context is matched, longest suffix first (up to `max_depth` tokens), against two corpora: the
request's own tokens and the outputs of recently finished requests. From the matched occurrences the
proposal walks forward, taking at each step the continuation most occurrences share, while its estimated
probability (the product of "occurrences that continue this way / occurrences so far") stays above
`min_token_prob`, for at most `max_spec_factor x match length` tokens (a longer match earns a longer
guess). The corpus whose proposal has the larger expected number of accepted tokens (the sum of those
probabilities) wins.

Arctic keeps suffix trees; an occurrence list per token gives the same counts (the children of a tree node
are the next tokens of the node's occurrences) without building a node per (position, depth).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

_SEPARATOR = -1  # between sequences of the shared corpus: never matches, never continues


class Corpus:
    """Token sequences in one flat list, indexed token -> positions (ascending)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.positions: dict[int, list[int]] = {}

    def extend(self, tokens: Sequence[int]) -> None:
        base = len(self.tokens)
        self.tokens.extend(tokens)
        positions = self.positions
        for offset, token in enumerate(tokens):
            entry = positions.get(token)
            if entry is None:
                positions[token] = [base + offset]
            else:
                entry.append(base + offset)


def propose_from(
    corpus: Corpus,
    context: Sequence[int],
    exclude_from: int,
    k: int,
    max_depth: int,
    max_spec_factor: float,
    min_token_prob: float,
) -> tuple[list[int], float]:
    """(proposal, expected accepted tokens) for what follows `context`, from occurrences in `corpus` that end
    before position `exclude_from` (the request's own corpus is its context: its suffix must not match itself)."""
    if not context or k <= 0:
        return [], 0.0
    tokens = corpus.tokens
    ends = [p for p in corpus.positions.get(context[-1], ()) if p < exclude_from - 1 or exclude_from < 0]
    match = 1
    while ends and match < max_depth and match < len(context):
        want = context[-1 - match]
        longer = [p for p in ends if p - match >= 0 and tokens[p - match] == want]
        if not longer:
            break
        ends, match = longer, match + 1
    limit = min(k, int(max_spec_factor * match + 1e-9))
    proposal: list[int] = []
    prob, score = 1.0, 0.0
    end_of_corpus = len(tokens) if exclude_from < 0 else exclude_from
    while ends and len(proposal) < limit:
        counts: dict[int, int] = {}
        for p in ends:
            if p + 1 < end_of_corpus:
                token = tokens[p + 1]
                if token != _SEPARATOR:
                    counts[token] = counts.get(token, 0) + 1
        if not counts:
            break
        token, count = max(counts.items(), key=lambda item: item[1])
        prob *= count / len(ends)
        if prob < min_token_prob:
            break
        proposal.append(token)
        score += prob
        ends = [p + 1 for p in ends if p + 1 < end_of_corpus and tokens[p + 1] == token]
    return proposal, score


class SharedOutputs:
    """Outputs of the last `max_requests` finished requests, one corpus (rebuilt from the newer half when
    full, so adding stays amortised O(tokens))."""

    def __init__(self, max_requests: int):
        self.max_requests = max_requests
        self.sequences: deque[list[int]] = deque()
        self.corpus = Corpus()

    def add(self, output_token_ids: Sequence[int]) -> None:
        if self.max_requests <= 0 or not output_token_ids:
            return
        if len(self.sequences) >= self.max_requests:
            keep = list(self.sequences)[len(self.sequences) // 2 :]
            self.sequences = deque(keep)
            self.corpus = Corpus()
            for seq in keep:
                self.corpus.extend(seq + [_SEPARATOR])
        seq = list(output_token_ids)
        self.sequences.append(seq)
        self.corpus.extend(seq + [_SEPARATOR])
