"""Draft tokens for the running requests, set on each Request as `spec_token_ids` before the scheduler runs.
Pure Python: the engine core calls it, the scheduler schedules the drafts as extra tokens of a decode, and
the model runner verifies them (spec_decode/verify.py).

Every request may draft: plain ones are verified in one batched pass, requests with penalties, min_tokens,
a grammar (structured outputs) or logprobs one position at a time through the sampler (spec_decode/verify.py),
so their output distribution and extras are unchanged.
"""

from __future__ import annotations

from typing import Protocol

from kvserve.runtime.core.outputs import SchedulerOutput
from kvserve.runtime.request import Request
from kvserve.runtime.spec_decode.ngram import NgramIndex
from kvserve.runtime.spec_decode.suffix import Corpus, SharedOutputs, propose_from
from kvserve.runtime.speculative_config import SpeculativeConfig


class _SuffixState:
    def __init__(self) -> None:
        self.corpus = Corpus()


class DraftProposer(Protocol):
    """What the engine core calls around each schedule when --speculative-config is set: this module's
    n-gram / suffix Proposer, or the draft model (executor/draft_model.py)."""

    def propose(self, running: list[Request]) -> None:
        """Set spec_token_ids on the running requests (before the schedule)."""

    def attach_draft_probs(self, sched: SchedulerOutput) -> None:
        """Hand the verifier the draft distribution q of the scheduled requests' sampled drafts."""


class Proposer:
    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        self.config = config
        self.max_model_len = max_model_len
        self.shared = SharedOutputs(config.suffix_decoding_max_cached_requests) if config.method == "suffix" else None
        self._tracked: dict[str, tuple[Request, object]] = {}  # request id -> (request, its index)
        self.enabled = True  # False while the batch is above disable_by_batch_size (last call)

    def propose(self, running: list[Request]) -> None:
        """Set spec_token_ids on every running request about to decode ([] for the rest)."""
        self._forget_finished()
        cfg = self.config
        self.enabled = len(running) <= cfg.disable_by_batch_size
        for request in running:
            request.spec_token_ids = []
            if not self.enabled or request.num_tokens - request.num_computed_tokens != 1:
                continue
            # Room for k drafts plus the token after them, within the context and the request's max_tokens.
            k = min(cfg.num_speculative_tokens, self.max_model_len - request.num_tokens - 1)
            if request.max_tokens is not None:
                k = min(k, request.max_tokens - request.num_output_tokens - 1)
            if k <= 0:
                continue
            request.spec_token_ids = self._propose_one(request, k)

    def attach_draft_probs(self, sched: SchedulerOutput) -> None:
        """Nothing: n-gram and suffix drafts are one-hot (q = 1 at the draft), the verifier's default."""

    def _propose_one(self, request: Request, k: int) -> list[int]:
        cfg, rid = self.config, request.request_id
        tracked = self._tracked.get(rid)
        if tracked is None or tracked[0] is not request:
            state = (
                NgramIndex(cfg.prompt_lookup_min, cfg.prompt_lookup_max) if cfg.method == "ngram" else _SuffixState()
            )
            self._tracked[rid] = (request, state)
        else:
            state = tracked[1]
        tokens = request.all_token_ids
        if isinstance(state, NgramIndex):
            return state.propose(tokens, k)
        local = state.corpus
        local.extend(tokens[len(local.tokens) :])
        args = (
            k,
            cfg.suffix_decoding_max_tree_depth,
            cfg.suffix_decoding_max_spec_factor,
            cfg.suffix_decoding_min_token_prob,
        )
        best, best_score = propose_from(local, tokens, len(tokens), *args)
        if self.shared is not None:
            shared, score = propose_from(self.shared.corpus, tokens, -1, *args)
            if score > best_score:
                best = shared
        return best

    def _forget_finished(self) -> None:
        done = [rid for rid, (request, _) in self._tracked.items() if request.status.is_finished]
        for rid in done:
            request, _ = self._tracked.pop(rid)
            if self.shared is not None and request.status.finish_reason != "abort":
                self.shared.add(request.output_token_ids)
