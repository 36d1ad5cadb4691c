"""Iteration-level scheduler under a token budget. Pure Python (no torch).

There are no prefill or decode phases: every request catches `num_computed_tokens` up to its token count,
and each step spends at most `max_num_batched_tokens` across requests, running ones first (a decode costs
one token) and then waiting ones, whose prompts are chunked to fit what is left (chunked prefill). When the
KV pool runs dry the most recently admitted running request is preempted: its blocks are freed (full ones
keep their hashes, so its recompute is mostly prefix-cache hits) and it goes back to the head of the queue.

A request is one sequence. n > 1 samples of a prompt arrive as n requests (engine/parent_request.py), queued
back to back: the first computes the prompt and caches its full blocks as it allocates them, and a sibling
admitted in the same step or later takes them as prefix-cache hits (nothing here knows they are siblings).

Micro-batches (pipeline parallelism, `micro_batches` > 1): the engine launches a batch and schedules the next
one before the first's tokens are back (EngineCore._step_pipelined), so that every stage has work. A request in a
batch still in flight is skipped by schedule() -- its num_computed_tokens only moves when that batch's output
is applied -- and cannot be preempted meanwhile (the blocks the in-flight batch writes stay its own). Each
batch takes at most ceil(active requests / micro_batches) sequences, so that the active requests are spread
over as many batches as there are stages instead of all landing in the first one. Block-table diffs stay
consistent: every rank applies the batches' diffs in launch order, the order they were computed in here.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from kvserve.runtime import engine_args
from kvserve.runtime.core import pd_connector
from kvserve.runtime.core.block_table_diff import SentBlockTables
from kvserve.runtime.core.kv_cache_manager import KVCacheManager
from kvserve.runtime.core.outputs import (
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    ScheduledRequest,
    SchedulerOutput,
)
from kvserve.runtime.core.pd_connector import PDConnector
from kvserve.runtime.request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    # The engine always passes every field (runtime/config.py); the defaults serve standalone use (tests, the
    # planner's simulator) and are EngineArgs' own, defined there once. max_model_len has none there (it is the
    # model's): 2048 here is the one standalone default (the planner's EngineShape takes it from here).
    max_num_seqs: int = engine_args.default("max_num_seqs")
    max_num_batched_tokens: int = engine_args.CHUNKED_PREFILL_BATCHED_TOKENS
    max_model_len: int = 2048
    enable_chunked_prefill: bool = engine_args.default("enable_chunked_prefill")
    long_prefill_token_threshold: int = engine_args.default("long_prefill_token_threshold")  # > 0: per-request cap
    preemption_mode: str = engine_args.default("preemption_mode")  # "swap": copy the victim's KV to host RAM
    max_loras: int = 0  # > 0 (--enable-lora): at most this many distinct adapters among running requests

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        error = engine_args.preemption_mode_error(self.preemption_mode)
        if error:
            raise ValueError(error)
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        error = engine_args.chunked_prefill_budget_error(
            self.enable_chunked_prefill, self.max_num_batched_tokens, self.max_model_len
        )
        if error:
            raise ValueError(error)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        micro_batches: int = 1,
        pd: PDConnector | None = None,
    ):
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
        self.config = config
        self.micro_batches = micro_batches  # batches the engine keeps in flight (the pipeline's stage count)
        self._in_flight: set[str] = set()  # ids of requests in batches launched but not yet applied
        # Set for one schedule() call while batches are in flight (micro-batches): running requests hidden
        # from it (they still count towards max_num_seqs) and the batch's sequence cap.
        self._held: list[Request] = []
        self._batch_seq_limit = config.max_num_seqs
        self.kv = kv_cache_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()  # oldest first
        self.requests: dict[str, Request] = {}
        self._seen_by_runner: set[str] = set()
        self._sent_tables = SentBlockTables()  # block tables as the runner holds them (it keeps them)
        self._sent_group_tables: list[SentBlockTables] = []  # the same for KV cache groups 1..
        self._finished_since_last_step: list[str] = []
        self.num_preemptions = 0
        self.num_swap_outs = 0  # requests
        self.num_swap_ins = 0
        # Speculative decoding (cumulative; vllm:spec_decode_* metrics): requests-steps that carried drafts,
        # drafted tokens, accepted ones, and acceptances per draft position.
        self.spec_num_drafts = 0
        self.spec_num_draft_tokens = 0
        self.spec_num_accepted_tokens = 0
        self.spec_accepted_per_pos: list[int] = []
        self.num_offload_loaded_tokens = 0  # prompt tokens loaded from the host KV tier instead of computed
        # --kv-transfer-config (P/D disaggregation, core/pd_connector.py): the connector, and the requests
        # whose prompt KV is being pulled from a prefill engine (status WAITING_FOR_REMOTE_KVS).
        self.pd = pd
        self.receiving: dict[str, Request] = {}

    # -- admission / removal ---------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish (abort, or stop on a stop string) requests, freeing their blocks now."""
        finished = []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None or request.status.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request.status == RequestStatus.SWAPPED:
                self.swapped.remove(request)
            elif request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:  # its pull may still write its blocks
                del self.receiving[rid]
                self.pd.orphan(rid, self.kv.take_blocks(request))
            elif request in self.waiting:
                self.waiting.remove(request)
            self._finish(request, status)
            finished.append(request)
        return finished

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        if (
            self.pd is not None
            and self.pd.can_lease
            and status == RequestStatus.FINISHED_LENGTH
            and pd_connector.wants_remote_decode(request)
            and self.kv.num_groups == 1
        ):  # a prefill for a remote decode: its blocks stay, under a lease
            request.kv_transfer_params_out = self.pd.lease(request, self.kv.take_blocks(request))
        self.kv.free(request)
        del self.requests[request.request_id]
        self._forget_tables(request.request_id)
        if request.request_id in self._seen_by_runner:
            self._seen_by_runner.discard(request.request_id)
            self._finished_since_last_step.append(request.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.swapped or self.receiving)

    @property
    def has_kv_transfers(self) -> bool:
        """P/D: leases or pulls that only further steps (the runner's polling) can end."""
        return self.pd is not None and (self.pd.busy or bool(self.receiving))

    @property
    def num_waiting(self) -> int:
        """Queue depth: requests not running, including ones swapped out to host memory or waiting for their
        prompt's KV from a prefill engine."""
        return len(self.waiting) + len(self.swapped) + len(self.receiving)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def lora_adapters(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(running, waiting) adapter names, each sorted and distinct (vllm:lora_requests_info's labels)."""
        running = sorted({r.lora_name for r in self.running if r.lora_name is not None})
        queued = [*self.waiting, *self.swapped]
        return tuple(running), tuple(sorted({r.lora_name for r in queued if r.lora_name is not None}))

    # -- one step --------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        if self.micro_batches > 1:
            return self._schedule_micro_batch()
        return self._schedule()

    def _schedule_micro_batch(self) -> SchedulerOutput:
        """One micro-batch: schedule() over the running requests not in flight, at most
        ceil(active / micro_batches) sequences; its requests are then in flight until update_from_output."""
        everyone, in_flight = self.running, self._in_flight
        num_active = min(len(everyone) + len(self.waiting) + len(self.swapped), self.config.max_num_seqs)
        self._batch_seq_limit = max(1, -(-num_active // self.micro_batches))
        if in_flight:
            self._held = [r for r in everyone if r.request_id in in_flight]
            self.running = [r for r in everyone if r.request_id not in in_flight]
        visible = set(map(id, self.running))
        try:
            out = self._schedule()
        finally:
            if self._held:
                # Back in admission order: the held ones where they were, what this batch admitted at the end.
                kept = set(map(id, self.running))
                admitted = [r for r in self.running if id(r) not in visible]
                self.running = [r for r in everyone if id(r) in kept or r.request_id in in_flight] + admitted
                self._held = []
            self._batch_seq_limit = self.config.max_num_seqs
        in_flight.update(s.req_id for s in out.scheduled)
        return out

    def release_in_flight(self, scheduler_output: SchedulerOutput) -> None:
        """The batch's output is in (or the batch failed): its requests may be scheduled again."""
        self._in_flight.difference_update(s.req_id for s in scheduler_output.scheduled)

    @property
    def num_in_flight(self) -> int:
        """Requests in batches launched but not yet applied (0 without micro-batches)."""
        return len(self._in_flight)

    def requeue_finished(self, request_ids: list[str]) -> None:
        """An output that scheduled nothing was not launched: its finished ids go with the next batch."""
        self._finished_since_last_step[:0] = request_ids

    def _schedule(self) -> SchedulerOutput:
        cfg = self.config
        if self.micro_batches == 1:  # every earlier step's output was applied, or that step failed
            self.kv.abort_connector_steps()
        num_held, limit = len(self._held), self._batch_seq_limit
        budget = cfg.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        scheduled_reqs: list[Request] = []
        num_preempted = 0

        i = 0
        if budget >= len(self.running):
            i = self._schedule_decodes(scheduled, scheduled_reqs)
            budget -= i
        while i < len(self.running) and budget > 0 and len(scheduled) < limit:
            request = self.running[i]
            num_new = self._num_tokens_to_schedule(request, budget)
            if num_new == 0:
                i += 1
                continue
            while self.kv.allocate_slots(request, num_new) is None:
                # Victims come from the tail, which this loop has not scheduled yet.
                victim = self.running.pop()
                self._preempt(victim)
                num_preempted += 1
                if victim is request:
                    break
            if request.status != RequestStatus.RUNNING:
                break
            scheduled_reqs.append(request)
            scheduled.append(self._scheduled(request, num_new))
            budget -= num_new
            i += 1

        # Swapped-out requests come back before anything new is admitted.
        while not num_preempted and self.swapped and budget > 0:
            request = self.swapped[0]
            if len(self.running) + num_held >= cfg.max_num_seqs or len(scheduled) >= limit:
                break
            num_new = self._num_tokens_to_schedule(request, budget)
            if not self.kv.can_swap_in(request, num_new):
                break
            self.kv.swap_in(request)
            blocks = self.kv.allocate_slots(request, num_new)
            assert blocks is not None  # can_swap_in counted these
            self.swapped.popleft()
            request.status = RequestStatus.RUNNING
            self.num_swap_ins += 1
            self.running.append(request)
            scheduled_reqs.append(request)
            scheduled.append(self._scheduled(request, num_new))
            budget -= num_new

        # Admit waiting requests only if nobody was preempted (they would just evict each other) and
        # nothing is still swapped out.
        idx = 0
        lora_blocked = False  # an earlier adapter request waits for a slot: later ones queue behind it
        active_loras = {r.lora_name for r in (*self.running, *self._held) if r.lora_name} if cfg.max_loras else set()
        while not num_preempted and not self.swapped and idx < len(self.waiting) and budget > 0:
            request = self.waiting[idx]
            if len(self.running) + num_held >= cfg.max_num_seqs or len(scheduled) >= limit:
                break
            if cfg.max_loras and request.lora_name is not None:
                # At most max_loras distinct adapters run at once. A request for a non-resident adapter
                # waits, and so do adapter requests behind it (FCFS among adapters: a busy resident adapter
                # cannot starve it, the running set drains); base-model requests pass.
                full = request.lora_name not in active_loras and len(active_loras) >= cfg.max_loras
                if full or lora_blocked:
                    lora_blocked = True
                    idx += 1
                    continue
            # A request back from a P/D pull has blocks and computed tokens already; any other waiting one
            # starts from 0.
            hit_blocks, num_hit_tokens, num_loaded = ([], request.num_computed_tokens, 0)
            if request.num_computed_tokens == 0:
                hit_blocks, num_hit_tokens = self.kv.get_computed_blocks(request)
                # (One KV cache group only: pulls of sliding-window tables are not implemented; such a
                # request computes its prompt here.)
                if self.pd is not None and self.kv.num_groups == 1 and pd_connector.wants_remote_prefill(request):
                    if not self._admit_for_pull(request, hit_blocks, num_hit_tokens):
                        break
                    del self.waiting[idx]
                    continue
                # The host KV tier: blocks past the device hit load before the forward, costing no budget.
                num_matched = self.kv.match_offloaded(request, len(hit_blocks))
                if num_matched is None:  # the disk tier brings more of its prefix up first: next step
                    idx += 1
                    continue
                num_loaded = num_matched * self.kv.block_size
            num_remaining = request.num_tokens - num_hit_tokens - num_loaded
            num_new = self._cap(num_remaining, budget)
            if (not cfg.enable_chunked_prefill and num_remaining > budget) or self.kv.allocate_slots(
                request, num_loaded + num_new, hit_blocks
            ) is None:
                self.kv.unmatch_offloaded(request)
                break
            if num_loaded:
                self.kv.load_offloaded(request, len(hit_blocks))
                num_hit_tokens += num_loaded
                self.num_offload_loaded_tokens += num_loaded
            del self.waiting[idx]
            if request.lora_name is not None:
                active_loras.add(request.lora_name)
            if request.status == RequestStatus.WAITING and not request.num_computed_tokens:
                request.num_prefix_cache_hit_tokens = num_hit_tokens
            request.num_computed_tokens = num_hit_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled_reqs.append(request)
            scheduled.append(self._scheduled(request, num_new))
            budget -= num_new

        new_requests = []
        for request in scheduled_reqs:
            if request.request_id not in self._seen_by_runner:
                self._seen_by_runner.add(request.request_id)
                new_requests.append(
                    NewRequestData(
                        request.request_id, request.sampling_params, request.prompt_token_ids, request.lora_name
                    )
                )
        finished, self._finished_since_last_step = self._finished_since_last_step, []
        swap_out, swap_in = self.kv.take_swaps()
        connector_step = self.kv.take_connector_step()
        if self.pd is not None:
            self.pd.expire()
            connector_step.pull = self.pd.take_pulls()
            connector_step.leased = self.pd.leased_ids()
        return SchedulerOutput(
            scheduled=scheduled,
            new_requests=new_requests,
            finished_req_ids=finished,
            num_preempted=num_preempted,
            swap_out=swap_out,
            swap_in=swap_in,
            kv_connector=connector_step,
        )

    def _admit_for_pull(self, request: Request, hit_blocks: list, num_hit_tokens: int) -> bool:
        """A decode engine's request with a remote prefill: blocks for its whole prompt (its own prefix hit
        kept), the rest pulled from the prefill engine; it waits for the pull outside the running set. False:
        the pool cannot hold the prompt now (it stays queued)."""
        if self.kv.allocate_slots(request, request.num_tokens - num_hit_tokens, hit_blocks, defer_caching=True) is None:
            return False
        request.num_computed_tokens = num_hit_tokens
        request.num_prefix_cache_hit_tokens = num_hit_tokens
        self.pd.record_pull(request, self.kv.req_to_blocks[request.request_id], len(hit_blocks))
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.receiving[request.request_id] = request
        return True

    def _pulls_ended(self, runner_output: ModelRunnerOutput) -> None:
        """P/D: leases the decode engines released, pulls that ended. A pulled request counts every prompt
        token but the last as computed (the last is computed here, for its logits); a failed pull recomputes
        from its own prefix hit. Either way it goes to the front of the queue: its blocks are held already."""
        self.pd.release(runner_output.finished_sending)
        ended = runner_output.finished_receiving | set(runner_output.failed_receiving)
        for rid in ended:
            if self.pd.pull_ended(rid):
                continue
            request = self.receiving.pop(rid, None)
            if request is None:
                continue
            if rid in runner_output.failed_receiving:
                self.pd.num_failed_pulls += 1
            else:
                self.pd.num_pulled_tokens += request.num_prompt_tokens - 1 - request.num_computed_tokens
                request.num_computed_tokens = request.num_prompt_tokens - 1
            request.status = RequestStatus.WAITING
            self.waiting.appendleft(request)

    def _schedule_decodes(self, scheduled: list[ScheduledRequest], scheduled_reqs: list[Request]) -> int:
        """Fast path of the running loop for its leading requests that decode one token (all of them in a
        pure-decode step): it produces exactly what the general loop would for them, minus its per-request
        generality (budget capping, preemption retries). Returns how many requests it scheduled; the
        general loop goes on from there. Callers guarantee the budget covers one token per running request."""
        kv, tables = self.kv, self._sent_tables
        req_to_blocks = kv.req_to_blocks
        group_diffs = self._group_diffs if kv.num_groups > 1 else None
        running = self.running
        if self._batch_seq_limit < len(running):  # a micro-batch's cap (never without micro-batches)
            running = running[: self._batch_seq_limit]
        for i, request in enumerate(running):
            start = request.num_computed_tokens
            if request.num_tokens - start != 1 or request.spec_token_ids:  # drafts: the general loop
                return i
            # None leaves the KV manager unchanged, so the general loop's retry (which preempts) sees the
            # same state this call did.
            if kv.allocate_slots(request, 1) is None:
                return i
            rid = request.request_id
            scheduled_reqs.append(request)
            scheduled.append(
                ScheduledRequest(
                    rid,
                    [request.all_token_ids[start]],
                    start,
                    tables.diff(rid, req_to_blocks[rid]),
                    True,
                    group_diffs(rid) if group_diffs else (),
                )
            )
        return len(running)

    def _cap(self, num_tokens: int, budget: int) -> int:
        threshold = self.config.long_prefill_token_threshold
        if threshold > 0:
            num_tokens = min(num_tokens, threshold)
        return min(num_tokens, budget)

    def _num_tokens_to_schedule(self, request: Request, budget: int) -> int:
        # A decode with drafts (spec_decode/) computes its last token and the drafts: 1 + k tokens.
        return self._cap(request.num_tokens - request.num_computed_tokens + len(request.spec_token_ids), budget)

    def _scheduled(self, request: Request, num_new: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
        rid = request.request_id
        num_real = min(num_new, request.num_tokens - start)
        token_ids = request.all_token_ids[start : start + num_real]
        num_spec = num_new - num_real  # drafts that fit the budget (the rest are dropped this step)
        if num_spec:
            token_ids += request.spec_token_ids[:num_spec]
        return ScheduledRequest(
            rid,
            token_ids,
            start,
            self._sent_tables.diff(rid, self.kv.req_to_blocks.get(rid, ())),
            start + num_real == request.num_tokens,
            group_block_tables=self._group_diffs(rid),
            num_spec_tokens=num_spec,
        )

    def _group_diffs(self, rid: str) -> tuple:
        """Block-table diffs of KV cache groups 1.. (sliding-window models; () for one group)."""
        group_tables = self.kv.get_group_block_ids(rid)
        if not group_tables:
            return ()
        sent = self._sent_group_tables
        while len(sent) < len(group_tables):
            sent.append(SentBlockTables(ids=True))
        return tuple(tables.diff(rid, ids) for tables, ids in zip(sent, group_tables))

    def _forget_tables(self, rid: str) -> None:
        self._sent_tables.forget(rid)
        for tables in self._sent_group_tables:
            tables.forget(rid)

    def _preempt(self, request: Request) -> None:
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._forget_tables(request.request_id)  # it comes back with other blocks: send them whole
        if self.config.preemption_mode == "swap" and request.num_computed_tokens > 0 and self.kv.can_swap_out(request):
            self.kv.swap_out(request)
            request.status = RequestStatus.SWAPPED
            self.num_swap_outs += 1
            self.swapped.appendleft(request)  # victims leave newest first, so the oldest ends up in front
            return
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        self.waiting.appendleft(request)

    # -- results ---------------------------------------------------------------------------------------
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        if self._in_flight:
            self.release_in_flight(scheduler_output)
        if not scheduler_output.kv_connector.is_empty:
            self.kv.connector_step_done(
                scheduler_output.kv_connector,
                runner_output.finished_sending,
                runner_output.finished_receiving,
                runner_output.failed_receiving,
            )
        if self.pd is not None:
            self._pulls_ended(runner_output)
        # Hoisted lookups: this loop runs once per scheduled request per step (a hot path at 256+ decodes).
        requests, running = self.requests, RequestStatus.RUNNING
        sampled, all_logprobs = runner_output.sampled_token_ids, runner_output.logprobs
        check_stop = self._check_stop
        for sched in scheduler_output.scheduled:
            request = requests.get(sched.req_id)
            if request is None or request.status != running:
                continue  # finished or preempted meanwhile
            if sched.num_spec_tokens:
                out = self._update_speculative(request, sched, runner_output)
                if out is not None:
                    outputs.append(out)
                continue
            request.num_computed_tokens += len(sched.token_ids)
            if not sched.sample:
                continue
            rid = request.request_id
            token_id = sampled.get(rid)
            if token_id is None:  # its sampling failed (runner_output.failed): the engine finishes it
                continue
            request.append_token(token_id)
            logprobs = all_logprobs.get(rid) if all_logprobs else None
            status = check_stop(request, token_id)
            out = EngineCoreOutput(rid, [token_id], [logprobs] if logprobs else None)
            if status is not None:
                self.running.remove(request)
                self._finish(request, status)
                out.finish_reason, out.stop_reason = status.finish_reason, request.stop_reason
                out.kv_transfer_params = request.kv_transfer_params_out
            outputs.append(out)
        return outputs

    def _update_speculative(
        self, request: Request, sched: ScheduledRequest, runner_output: ModelRunnerOutput
    ) -> EngineCoreOutput | None:
        """A decode that carried drafts: keep the accepted ones and the token after them. The rejected drafts'
        KV slots are simply recomputed over later (num_computed_tokens stops before them); their blocks stay
        allocated to the request, and no block holding a draft was cached (drafts are not in all_token_ids)."""
        num_spec = sched.num_spec_tokens
        request.spec_token_ids = []
        tokens = runner_output.spec_token_ids.get(request.request_id)
        if not tokens:  # its verification failed (runner_output.failed): the engine finishes it
            request.num_computed_tokens += len(sched.token_ids) - num_spec
            return None
        num_accepted = len(tokens) - 1
        request.num_computed_tokens += len(sched.token_ids) - num_spec + num_accepted
        self.spec_num_drafts += 1
        self.spec_num_draft_tokens += num_spec
        self.spec_num_accepted_tokens += num_accepted
        per_pos = self.spec_accepted_per_pos
        if len(per_pos) < num_spec:
            per_pos.extend([0] * (num_spec - len(per_pos)))
        for i in range(num_accepted):
            per_pos[i] += 1
        new_tokens, status = [], None
        for token_id in tokens:
            request.append_token(token_id)
            new_tokens.append(token_id)
            status = self._check_stop(request, token_id)
            if status is not None:
                break
        logprobs = runner_output.spec_logprobs.get(request.request_id)
        out = EngineCoreOutput(request.request_id, new_tokens, logprobs[: len(new_tokens)] if logprobs else None)
        if status is not None:
            self.running.remove(request)
            self._finish(request, status)
            out.finish_reason, out.stop_reason = status.finish_reason, request.stop_reason
            out.kv_transfer_params = request.kv_transfer_params_out
        return out

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        num_tokens = len(request.all_token_ids)
        num_output_tokens = num_tokens - len(request.prompt_token_ids)
        # Below min_tokens the sampler masks EOS and stop ids, so they cannot appear here.
        if num_output_tokens > params.min_tokens:
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
            if not params.ignore_eos and token_id in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if (
            request.max_tokens is not None and num_output_tokens >= request.max_tokens
        ) or num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
