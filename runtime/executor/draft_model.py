"""Draft-model speculative decoding (`{"method": "draft_model", "model": DIR, "num_speculative_tokens": k}`):
a smaller model with the target's vocabulary proposes k tokens per step for each running request.

Same interface as proposer.Proposer (`propose(running)` sets `spec_token_ids` before the scheduler runs), plus
`attach_draft_probs(scheduler_output)`: sampled requests draw their drafts from the draft's own distribution q
(the request's temperature / top-k / top-p / min-p), and the verifier needs q(.) at each drafted position to
accept with min(1, p/q) and resample from max(p - q, 0) (spec_decode/verify.py). Greedy requests draft the
draft's argmax and send no q.

The draft runs here, in the engine core process, unsharded (vLLM's draft_tensor_parallel_size=1) whatever
the target's TP: a ModelRunner (the repo's loader, attention backend, CPU weight packing, KV sizing) whose
model and paged KV cache this class drives directly, with its own KVCacheManager (prefix caching off) and
block tables. Per step:

1. catch up: each eligible request's draft KV is cut back to the longest prefix of the tokens it was fed that
   still matches the request's tokens (rejected drafts roll back exactly like the target's num_computed), and
   the request's tokens since then are fed -- a new request prefills its prompt, chunked by the target's
   max_num_batched_tokens per step (requests still prefilling in the target start early);
2. the catch-up forward gives the first draft; k - 1 more one-token forwards, batched across requests, give
   the rest.

A request whose draft blocks cannot be allocated (the draft pool is full) or whose catch-up does not fit
this step's budget just gets no drafts this step. Requests that leave the running list (finished,
preempted) free their draft blocks.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np
import torch

from kvserve.runtime.config import EngineConfig, ParallelConfig, load_model_config
from kvserve.runtime.core.kv_cache_manager import KVCacheManager
from kvserve.runtime.core.outputs import SchedulerOutput
from kvserve.runtime.errors import InvalidParameter
from kvserve.runtime.request import Request
from kvserve.runtime.sampling import sampling_probs
from kvserve.runtime.speculative_config import check_draft_vocab

logger = logging.getLogger("kvserve.spec_decode")


class _DraftSeq:
    """One request's place in the draft's KV cache; duck-types what KVCacheManager reads of a Request (with
    prefix caching off: the id and num_computed_tokens)."""

    lora_identity = None

    def __init__(self, request: Request, generator: torch.Generator | None):
        self.request = request
        self.request_id = request.request_id
        self.tokens: list[int] = []  # the tokens whose KV the draft cache holds, at positions 0..len-1
        self.num_real = 0  # leading tokens of `tokens` copied from the request (the rest are fed drafts)
        self.num_computed_tokens = 0
        self.generator = generator  # a seeded request's own; None: the proposer's shared one

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def all_token_ids(self) -> list[int]:
        return self.tokens


def draft_engine_config(config: EngineConfig, target_num_blocks: int) -> EngineConfig:
    """The draft's EngineConfig: its model at the target's activation dtype and max_model_len, TP=1, no
    prefix caching / swap / LoRA / CUDA graphs; `draft_kv_cache_bytes` blocks, or the target's block count."""
    spec = config.speculative
    try:
        model = load_model_config(spec.model, config.model.dtype, config.model.max_model_len)
    except InvalidParameter as exc:
        raise InvalidParameter("speculative_config", f"speculative_config.model {spec.model!r}: {exc}") from None
    layout = model.kv_layout(config.cache.kv_cache_dtype, config.cache.block_size, 1)
    if len(layout.group_windows) > 1:
        raise InvalidParameter(
            "speculative_config",
            f"speculative_config.model {spec.model!r} has sliding-window layers (several KV cache groups), "
            "which a draft model does not support",
        )
    num_blocks = target_num_blocks
    if spec.draft_kv_cache_bytes is not None:
        num_blocks = layout.blocks_for_budget(spec.draft_kv_cache_bytes)
    cache = replace(
        config.cache,
        num_kv_blocks=max(num_blocks, 2),
        kv_cache_bytes=None,
        swap_space_bytes=0,
        kv_offloading_bytes=0,  # the draft's KV is never offloaded: no host or disk tier of its own
        kv_offloading_disk_dir=None,
        kv_offloading_disk_bytes=0,
        enable_prefix_caching=False,
        num_blocks=0,
    )
    return replace(
        config,
        model=model,
        cache=cache,
        tensor_parallel_size=1,
        parallel=ParallelConfig(),
        cuda_graph_sizes=(),
        lora=None,
        speculative=None,
        kv_transfer=None,  # P/D pulls the target's KV only: the draft recomputes its own
    )


class DraftModelProposer:
    def __init__(self, config: EngineConfig, target_num_blocks: int):
        from kvserve.runtime.executor.model_runner import ModelRunner

        spec = config.speculative
        check_draft_vocab(spec, config.model.vocab_size)
        self.config = spec
        self.max_model_len = config.model.max_model_len
        # The draft's tokens per step across requests (catch-up forward): the target's own step budget.
        self.max_num_batched_tokens = config.scheduler.max_num_batched_tokens
        draft_config = draft_engine_config(config, target_num_blocks)
        try:
            self.runner = ModelRunner(draft_config)
        except InvalidParameter as exc:  # e.g. one max_model_len sequence does not fit the draft's KV budget
            raise InvalidParameter(
                "speculative_config", f"speculative_config (draft model {spec.model!r}, draft_kv_cache_bytes): {exc}"
            ) from None
        self.block_size = draft_config.cache.block_size
        self.kv = KVCacheManager(self.runner.num_blocks, self.block_size, enable_caching=False)
        self.device = self.runner.device
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(config.seed + 1)  # not the target's stream: q's draws are independent of p's
        self._seqs: dict[str, _DraftSeq] = {}
        self._probs: dict[str, np.ndarray] = {}  # request id -> q [k, vocab] of this step's sampled drafts
        self.enabled = True  # False while the batch is above disable_by_batch_size (last call)
        # Cumulative, for benchmarks and tests: draft forwards run and tokens they computed.
        self.num_forwards = 0
        self.num_tokens_computed = 0
        logger.info(
            "draft model %s: %d KV blocks of %d tokens (%s)",
            spec.model,
            self.runner.num_blocks,
            self.block_size,
            "draft_kv_cache_bytes" if spec.draft_kv_cache_bytes is not None else "the target's block count",
        )

    # -- the Proposer interface -------------------------------------------------------------------------
    def propose(self, running: list[Request]) -> None:
        """Set spec_token_ids on every running request about to decode ([] for the rest)."""
        self._forget_gone(running)
        self._probs = {}
        cfg = self.config
        self.enabled = len(running) <= cfg.disable_by_batch_size
        decoding: list[tuple[Request, int]] = []
        prefilling: list[Request] = []
        for request in running:
            request.spec_token_ids = []
            if not self.enabled:
                continue
            if request.num_tokens - request.num_computed_tokens != 1:
                prefilling.append(request)  # the draft may prefill its prompt meanwhile
                continue
            # Room for k drafts plus the token after them, within the context and the request's max_tokens.
            k = min(cfg.num_speculative_tokens, self.max_model_len - request.num_tokens - 1)
            if request.max_tokens is not None:
                k = min(k, request.max_tokens - request.num_output_tokens - 1)
            if k > 0:
                decoding.append((request, k))
        if decoding or prefilling:
            with torch.inference_mode():
                self._draft(decoding, prefilling)

    def attach_draft_probs(self, sched: SchedulerOutput) -> None:
        """Give each scheduled sampled draft its q rows (the scheduler may have trimmed the drafts)."""
        if not self._probs:
            return
        for s in sched.scheduled:
            q = self._probs.get(s.req_id)
            if q is not None and s.num_spec_tokens:
                s.spec_draft_probs = q[: s.num_spec_tokens]

    # -- drafting ---------------------------------------------------------------------------------------
    def _draft(self, decoding: list[tuple[Request, int]], prefilling: list[Request]) -> None:
        budget = self.max_num_batched_tokens
        feeds: list[tuple[_DraftSeq, list[int]]] = []
        drafting: list[tuple[_DraftSeq, int]] = []  # (seq, k) whose catch-up completes in this forward
        for request, k in decoding:
            if budget <= 0:
                break
            seq = self._seq(request)
            pending = request.all_token_ids[self._rewind(seq, request.num_tokens - 1) :]
            take = min(len(pending), budget)
            done = take == len(pending)
            # Blocks for the catch-up and, if it completes, the k - 1 drafts fed after it.
            if self.kv.allocate_slots(seq, take + (k - 1 if done else 0)) is None:
                continue  # the draft pool is full: no drafts for it this step
            feeds.append((seq, pending[:take]))
            budget -= take
            if done:
                drafting.append((seq, k))
        for request in prefilling:  # prompt tokens the draft can take ahead of the target's first decode
            if budget <= 0:
                break
            seq = self._seq(request)
            pending = request.all_token_ids[self._rewind(seq, request.num_tokens - 1) : request.num_tokens - 1]
            take = min(len(pending), budget)
            if take and self.kv.allocate_slots(seq, take) is not None:
                feeds.append((seq, pending[:take]))
                budget -= take
        if not feeds:
            return
        rows = {id(seq): i for i, (seq, _) in enumerate(feeds)}
        logits = self._forward(feeds, [rows[id(seq)] for seq, _ in drafting])
        for seq, _ in feeds:
            seq.num_real = len(seq.tokens)
        drafts: dict[str, list[int]] = {seq.request_id: [] for seq, _ in drafting}
        qs: dict[str, list[torch.Tensor]] = {}
        active = drafting
        step = 0
        while True:
            for (seq, _), token in zip(active, self._pick(active, logits, qs)):
                drafts[seq.request_id].append(token)
            step += 1
            active = [(seq, k) for seq, k in active if k > step]
            if not active:
                break
            feeds = [(seq, [drafts[seq.request_id][-1]]) for seq, _ in active]
            logits = self._forward(feeds, list(range(len(feeds))))
        for seq, _ in drafting:
            seq.request.spec_token_ids = drafts[seq.request_id]
            if seq.request_id in qs:
                self._probs[seq.request_id] = torch.stack(qs[seq.request_id]).float().cpu().numpy()

    def _pick(
        self, active: list[tuple[_DraftSeq, int]], logits: torch.Tensor, qs: dict[str, list[torch.Tensor]]
    ) -> list[int]:
        """One draft token per active request: the argmax for greedy requests, else a sample from q."""
        greedy = logits.argmax(dim=-1).tolist()
        tokens = []
        for i, (seq, _) in enumerate(active):
            params = seq.request.sampling_params
            if params.greedy:
                tokens.append(greedy[i])
                continue
            q = sampling_probs(logits[i].float(), params)
            q = q / q.sum()
            qs.setdefault(seq.request_id, []).append(q)
            tokens.append(int(torch.multinomial(q, 1, generator=seq.generator or self.generator).item()))
        return tokens

    def _forward(self, feeds: list[tuple[_DraftSeq, list[int]]], logit_rows: list[int]) -> torch.Tensor:
        """Append each feed's tokens to its sequence in the draft's KV (one varlen forward) and return the
        logits of the last token of the feeds listed in logit_rows ([len(logit_rows), vocab] float32)."""
        bs, dev = self.block_size, self.device
        ids: list[int] = []
        positions, slots, query_lens, seq_lens, tables = [], [], [], [], []
        for seq, tokens in feeds:
            start = len(seq.tokens)
            pos = np.arange(start, start + len(tokens))
            blocks = np.asarray(self.kv.get_block_ids(seq.request_id), dtype=np.int64)
            ids += tokens
            positions.append(pos)
            slots.append(blocks[pos // bs] * bs + pos % bs)
            query_lens.append(len(tokens))
            seq_lens.append(start + len(tokens))
            tables.append(blocks)
            seq.tokens.extend(tokens)
            seq.num_computed_tokens = len(seq.tokens)
        width = -(-max(seq_lens) // bs)
        table = np.zeros((len(feeds), width), dtype=np.int32)  # padded with the null block 0
        for i, blocks in enumerate(tables):
            n = min(len(blocks), width)
            table[i, :n] = blocks[:n]
        runner = self.runner
        meta = runner._metadata(
            np.array(query_lens), np.array(seq_lens), table, torch.from_numpy(np.concatenate(slots)).to(dev)
        )
        hidden = runner.model(
            torch.tensor(ids, dtype=torch.long, device=dev),
            torch.from_numpy(np.concatenate(positions)).to(dev),
            runner.kv_caches,
            meta,
        )
        self.num_forwards += 1
        self.num_tokens_computed += len(ids)
        if not logit_rows:
            return hidden[:0]
        last = np.cumsum(query_lens) - 1
        return runner.model.compute_logits(hidden[torch.from_numpy(last[logit_rows]).to(dev)]).float()

    # -- per-request state ------------------------------------------------------------------------------
    def _seq(self, request: Request) -> _DraftSeq:
        seq = self._seqs.get(request.request_id)
        if seq is None or seq.request is not request:  # (an id reused after its request finished)
            if seq is not None:
                self._free(seq)
            generator = None
            seed = request.sampling_params.seed
            if seed is not None and not request.sampling_params.greedy:
                # A seeded request's drafts repeat run to run, whatever else is in the batch.
                generator = torch.Generator(device=self.device)
                generator.manual_seed((seed + 0x5EED) % 2**63)
            seq = self._seqs[request.request_id] = _DraftSeq(request, generator)
        return seq

    def _rewind(self, seq: _DraftSeq, limit: int) -> int:
        """Cut seq's KV back to the longest prefix of its fed tokens the request still has (drafts the
        target rejected go), at most `limit` tokens; returns the new length. Only the drafts fed after the
        request's own tokens can differ: a request's tokens are append-only."""
        tokens, target, real = seq.tokens, seq.request.all_token_ids, seq.num_real
        n = real + _common_prefix(tokens[real:], target[real:])
        n = min(n, limit)
        del tokens[n:]
        seq.num_computed_tokens = seq.num_real = n
        return n

    def _forget_gone(self, running: list[Request]) -> None:
        live = {id(r) for r in running}
        for rid, seq in list(self._seqs.items()):
            if id(seq.request) not in live:  # finished or preempted: its draft blocks go back to the pool
                self._free(seq)
                del self._seqs[rid]

    def _free(self, seq: _DraftSeq) -> None:
        seq.num_computed_tokens = 0
        self.kv.free(seq)

    @property
    def num_free_blocks(self) -> int:
        return self.kv.num_free_blocks


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
