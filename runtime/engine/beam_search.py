"""Beam search in front of the engine (vLLM V1's design): each step runs one 1-token request per live beam
with the top-2k logprobs of its next token; the beams' shared prompt and common prefixes are prefix-cache
hits, so the core never forks a sequence. Pure Python: the offline LLM and the OpenAI server drive the same
`BeamSearch` (pending() -> the engine -> advance()).

Selection and scoring follow HF transformers' `generate(num_beams=k, do_sample=False)` (its `_beam_search`,
v4.5x/5.x), so the top beams match it on the same logits:
- per step, every live beam's top candidates are scored by cumulative logprob and the best
  max(2, 1 + #eos) x k kept; a candidate ends the beam when its token is an EOS or the step reaches
  max_tokens; only candidates among the first k may become finished hypotheses, scored
  cum_logprob / generated_len ** length_penalty (the EOS counted in the length, as HF does);
- the k best unfinished candidates are the next live beams; at most k finished hypotheses are kept;
- early_stopping: True stops once k hypotheses are finished; False stops when the best live beam, at its
  current length, cannot beat the worst finished one; "never" does the same check at max length when
  length_penalty > 0 (HF's heuristics, including their documented approximations).
vLLM instead keeps every completed hypothesis and divides by prompt + output length; we follow HF because
the done-criterion is parity with it (docs/serving.md, Beam search).
"""

from __future__ import annotations

from dataclasses import dataclass, field

_DEAD = -1.0e9  # HF's score for a candidate that ended (it never continues)


@dataclass(frozen=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True, False or "never" (HF's meanings)
    num_return_sequences: int | None = None  # default: beam_width

    def __post_init__(self) -> None:
        from kvserve.runtime.errors import InvalidParameter
        from kvserve.runtime.sampling_params import MAX_LOGPROBS

        limit = MAX_LOGPROBS // 2  # 2 x width candidates per beam (more with several EOS ids: BeamSearch checks)
        if not isinstance(self.beam_width, int) or not 1 <= self.beam_width <= limit:
            raise InvalidParameter(
                "n", f"the beam width (n) must be an integer in [1, {limit}], got {self.beam_width!r}"
            )
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidParameter("max_tokens", f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.early_stopping not in (True, False, "never"):
            raise InvalidParameter(
                "early_stopping", f'early_stopping must be true, false or "never", got {self.early_stopping!r}'
            )
        if not isinstance(self.length_penalty, (int, float)) or isinstance(self.length_penalty, bool):
            raise InvalidParameter("length_penalty", f"length_penalty must be a number, got {self.length_penalty!r}")
        n = self.num_return_sequences
        if n is not None and (not isinstance(n, int) or not 1 <= n <= self.beam_width):
            raise InvalidParameter("n", f"num_return_sequences must be in [1, beam_width], got {n!r}")


@dataclass
class Hypothesis:
    token_ids: list[int]  # generated tokens (an ending EOS included)
    cum_logprob: float
    score: float  # cum_logprob / len(token_ids) ** length_penalty
    finish_reason: str  # "stop" (EOS) or "length"


@dataclass
class BeamSearch:
    """One prompt's search. pending(): the token sequences (generated so far) whose next-token logprobs the
    engine must give; advance(top): one list of (token, logprob), best first, per pending sequence."""

    params: BeamSearchParams
    eos_token_ids: frozenset[int]
    live: list[tuple[list[int], float]] = field(default_factory=lambda: [([], 0.0)])
    finished: list[Hypothesis] = field(default_factory=list)
    num_generated: int = 0
    done: bool = False
    _improvable: bool = True  # HF's is_early_stop_heuristic_unsatisfied

    def __post_init__(self) -> None:
        from kvserve.runtime.errors import InvalidParameter
        from kvserve.runtime.sampling_params import MAX_LOGPROBS

        if self.num_candidates > MAX_LOGPROBS:
            raise InvalidParameter(
                "n",
                f"beam width {self.params.beam_width} with {len(self.eos_token_ids)} EOS ids needs "
                f"{self.num_candidates} candidates per beam, more than the {MAX_LOGPROBS} logprobs a step returns",
            )

    @property
    def num_candidates(self) -> int:
        """Top next-token logprobs each beam needs: HF keeps max(2, 1 + #eos) x width candidates per step, and
        one beam alone may supply all of them."""
        num_eos = 0 if self.params.ignore_eos else len(self.eos_token_ids)
        return max(2, 1 + num_eos) * self.params.beam_width

    def pending(self) -> list[list[int]]:
        return [] if self.done else [tokens for tokens, _ in self.live]

    def advance(self, top: list[list[tuple[int, float]]]) -> None:
        p, k = self.params, self.params.beam_width
        eos = frozenset() if p.ignore_eos else self.eos_token_ids
        keep = self.num_candidates
        candidates = [
            (score + logprob, beam, token)
            for beam, ((_, score), tops) in enumerate(zip(self.live, top))
            for token, logprob in tops
        ]
        # HF: torch.topk over beams x vocab (beam-major); ties are not expected on real logits.
        candidates.sort(key=lambda c: -c[0])
        candidates = candidates[:keep]
        at_limit = self.num_generated + 1 >= p.max_tokens
        ends = [at_limit or token in eos for _, _, token in candidates]

        length = self.num_generated + 1
        beams_full = len(self.finished) >= k and p.early_stopping is True
        if self._improvable and not beams_full:
            for rank, ((score, beam, token), ended) in enumerate(zip(candidates, ends)):
                if rank < k and ended:
                    tokens = self.live[beam][0] + [token]
                    reason = "length" if token not in eos else "stop"
                    self.finished.append(Hypothesis(tokens, score, score / length**p.length_penalty, reason))
            self.finished.sort(key=lambda h: -h.score)
            del self.finished[k:]

        running = sorted(
            ((_DEAD if ended else score, beam, token) for (score, beam, token), ended in zip(candidates, ends)),
            key=lambda c: -c[0],
        )[:k]
        self.live = [(self.live[beam][0] + [token], score) for score, beam, token in running if score > _DEAD / 2]
        self.num_generated = length

        if self._improvable and len(self.finished) >= k:
            best_len = p.max_tokens if (p.early_stopping == "never" and p.length_penalty > 0) else length
            best_possible = running[0][0] / best_len**p.length_penalty
            self._improvable = best_possible > self.finished[-1].score
        all_ended = all(ends)
        exists_open = not (len(self.finished) >= k and p.early_stopping is True)
        self.done = not (self._improvable and exists_open and not all_ended) or not self.live

    def results(self) -> list[Hypothesis]:
        """The best hypotheses, best first (num_return_sequences of them)."""
        n = self.params.num_return_sequences or self.params.beam_width
        return self.finished[:n]


@dataclass
class BeamSearchSequence:
    """One returned beam (vLLM's BeamSearchSequence): tokens = prompt + output, as vLLM returns them."""

    tokens: list[int]
    output_token_ids: list[int]
    text: str
    cum_logprob: float
    score: float
    finish_reason: str


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]


def pending_batch(searches: list[BeamSearch], prompt_ids: list[list[int]]) -> list[tuple[BeamSearch, list[int]]]:
    """This step's engine requests: (search, prompt + beam tokens) for every live beam of every search."""
    return [(search, ids + seq) for search, ids in zip(searches, prompt_ids) for seq in search.pending()]


def advance_all(batch: list[tuple[BeamSearch, list[int]]], tops: list[list[tuple[int, float]]]) -> None:
    """Feed each search the top logprobs of its beams (tops[i] answers batch[i])."""
    grouped: dict[int, tuple[BeamSearch, list]] = {}
    for (search, _), top in zip(batch, tops):
        grouped.setdefault(id(search), (search, []))[1].append(top)
    for search, beam_tops in grouped.values():
        search.advance(beam_tops)


async def run_async(searches: list[BeamSearch], prompt_ids: list[list[int]], next_token_logprobs) -> None:
    """Drive the searches to the end; next_token_logprobs(ids, num) -> [(token, logprob)] best first, one
    1-token engine request (the OpenAI server's path: every beam of a step is in flight at once)."""
    import asyncio

    while batch := pending_batch(searches, prompt_ids):
        tops = await asyncio.gather(*(next_token_logprobs(ids, search.num_candidates) for search, ids in batch))
        advance_all(batch, list(tops))


def top_logprobs(logprobs: dict, num: int) -> list[tuple[int, float]]:
    """A 1-token request's logprobs entry ({token: Logprob}) -> [(token, logprob)], best first."""
    return sorted(((tid, lp.logprob) for tid, lp in logprobs.items()), key=lambda t: -t[1])[:num]


def to_output(prompt_token_ids: list[int], search: BeamSearch, decode) -> BeamSearchOutput:
    return BeamSearchOutput(
        [
            BeamSearchSequence(
                prompt_token_ids + h.token_ids,
                h.token_ids,
                decode(h.token_ids),
                h.cum_logprob,
                h.score,
                h.finish_reason,
            )
            for h in search.results()
        ]
    )
