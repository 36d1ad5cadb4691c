"""Owns the model and the paged KV tensor; turns a SchedulerOutput into one flat forward and samples.

Per step it builds: input_ids / positions / slot_mapping [num_tokens], cu_seqlens_q, seq_lens and padded
block_tables [num_seqs, ...], and the indices of the rows that sample -- logits (the LM head, a large
matmul) are computed only for those rows.
"""
from __future__ import annotations

import logging

import torch

from kvserve.runtime.config import EngineConfig
from kvserve.runtime.core.outputs import ModelRunnerOutput, SchedulerOutput
from kvserve.runtime.models.attention import AttentionMetadata, get_attention_backend
from kvserve.runtime.models.loader import load_model
from kvserve.runtime.parallel.layers import SINGLE, ParallelContext
from kvserve.runtime.sampling import RequestSamplingState, sample
from kvserve.runtime.worker import kv_groups, kv_sizing

logger = logging.getLogger("kvserve.runner")

_KV_TORCH_DTYPES = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


class ModelRunner:
    def __init__(self, config: EngineConfig, parallel: ParallelContext | None = None):
        """parallel: this process's tensor-parallel rank (kvserve.runtime.parallel); the model is then this
        rank's shard and the KV cache holds only its KV heads -- kv_cache_bytes is a per-rank budget."""
        self.config = config
        self.parallel = parallel or SINGLE
        self.device = torch.device(config.device)
        self.block_size = config.cache.block_size
        torch.manual_seed(config.seed)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(config.seed)
        self.attention = get_attention_backend(config.attention_backend)
        self.model = (load_model(config.model, self.attention, config.device) if self.parallel.size == 1
                      else load_model(config.model, self.attention, config.device, self.parallel))
        self.num_kv_heads = self.model.shard.num_kv_heads  # on this rank
        self.num_blocks = self.parallel.all_reduce_min(self.determine_num_blocks())  # ranks agree
        self._check_one_sequence_fits(self.num_blocks)
        self.kv_caches = self._allocate_kv_cache(self.num_blocks)
        self.num_host_blocks = config.cache.swap_space_bytes // self.kv_bytes_per_block()
        self.host_kv = self._allocate_host_kv_cache(self.num_host_blocks) if self.num_host_blocks else None
        self.states: dict[str, RequestSamplingState] = {}

    # -- KV cache sizing --------------------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        return kv_sizing.layout(self.config).bytes_per_block

    def _check_one_sequence_fits(self, num_blocks: int) -> None:
        kv_sizing.check_one_sequence_fits(self.config, num_blocks)

    def determine_num_blocks(self) -> int:
        explicit = kv_sizing.explicit_num_blocks(self.config)
        if self.device.type != "cuda":
            return explicit
        memory = self._profile_cuda_memory()
        if explicit is None:
            return kv_sizing.profiled_num_blocks(self.config, memory)
        # A planned budget: verify the device can really hold weights + activations + that much KV.
        kv_sizing.check_budget_fits_device(self.config, memory, explicit * self.kv_bytes_per_block())
        return explicit

    def _profile_cuda_memory(self) -> kv_sizing.DeviceMemory:
        """Run a dummy forward at max_num_batched_tokens and measure the peak it needs."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        num_tokens = min(self.config.scheduler.max_num_batched_tokens, self.config.model.max_model_len)
        dummy_caches = self._allocate_kv_cache(2)
        meta = self._metadata([num_tokens], [num_tokens], [[1] * (-(-num_tokens // self.block_size))],
                              torch.full((num_tokens,), -1, dtype=torch.long), has_padding=True)
        with torch.inference_mode():
            ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
            hidden = self.model(ids, torch.arange(num_tokens, device=self.device), dummy_caches, meta)
            self.model.compute_logits(hidden[-min(num_tokens, self.config.scheduler.max_num_seqs):])
        torch.cuda.synchronize()
        del dummy_caches
        peak = torch.cuda.max_memory_allocated()
        free, total = torch.cuda.mem_get_info()
        return kv_sizing.DeviceMemory(total_bytes=total, peak_bytes=peak,
                                      non_torch_bytes=max(total - free - torch.cuda.memory_reserved(), 0))

    def _allocate_kv_cache(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        m = self.config.model
        kv_dtype = self.config.cache.kv_cache_dtype
        dtype = getattr(torch, _KV_TORCH_DTYPES.get(kv_dtype, m.dtype))
        # One tensor [2, layers, blocks, block_size, kv_heads, head_dim]; zeroed so never-written slots
        # hold finite values (masked attention weights are 0, and 0 * NaN would still be NaN).
        # Sliding-window models: one slot per layer of a KV cache group, shared by the groups (kv_groups.py).
        slots = kv_groups.layer_slots(self.model, m.num_layers)
        kv = torch.zeros(2, max(slots) + 1, max(num_blocks, 1), self.block_size, self.num_kv_heads, m.head_dim,
                         dtype=dtype, device=self.device)
        self.kv = kv
        return [(kv[0, slot], kv[1, slot]) for slot in slots]

    def _allocate_host_kv_cache(self, num_blocks: int) -> torch.Tensor:
        """Swap space in host RAM, same layout as the device cache (pinned on CUDA for async copies)."""
        shape = (2,) + tuple(self.kv.shape[1:2]) + (num_blocks,) + tuple(self.kv.shape[3:])
        return torch.zeros(shape, dtype=self.kv.dtype, pin_memory=self.device.type == "cuda")

    def _swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        if swap_out:
            dev = torch.tensor([d for d, _ in swap_out], device=self.device)
            host = torch.tensor([h for _, h in swap_out])
            self.host_kv[:, :, host] = self.kv[:, :, dev].to("cpu")
        if swap_in:
            host = torch.tensor([h for h, _ in swap_in])
            dev = torch.tensor([d for _, d in swap_in], device=self.device)
            self.kv[:, :, dev] = self.host_kv[:, :, host].to(self.device, non_blocking=True)

    # -- one step -----------------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        for rid in sched.finished_req_ids:
            self.states.pop(rid, None)
        for new in sched.new_requests:
            self.states[new.req_id] = RequestSamplingState(new.sampling_params, new.prompt_token_ids,
                                                           self.config.model.eos_token_ids, self.device,
                                                           self.generator)
        if sched.swap_out or sched.swap_in:
            self._swap(sched.swap_out, sched.swap_in)
        if sched.block_copies:
            self._copy_blocks(sched.block_copies)
        if not sched.scheduled:
            return ModelRunnerOutput({})

        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens, seq_lens, tables, logits_rows, sample_groups = [], [], [], [], []
        for s in sched.scheduled:
            n = len(s.token_ids)
            input_ids += s.token_ids
            span = range(s.start_position, s.start_position + n)
            positions += span
            table = s.block_ids
            slots += [table[p // bs] * bs + p % bs for p in span]
            query_lens.append(n)
            seq_lens.append(s.start_position + n)
            tables.append(table)
            if s.sample_req_ids:
                logits_rows.append(len(input_ids) - 1)
                sample_groups.append(s.sample_req_ids)

        dev = self.device
        meta = self._metadata(query_lens, seq_lens, tables, torch.tensor(slots, dtype=torch.long, device=dev))
        if sched.scheduled[0].group_block_ids:  # KV cache groups 1..: their own tables and slots
            meta = kv_groups.group_metadata(self, sched.scheduled, meta)
        hidden = self.model(torch.tensor(input_ids, dtype=torch.long, device=dev),
                            torch.tensor(positions, dtype=torch.long, device=dev), self.kv_caches, meta)
        if not logits_rows:
            return ModelRunnerOutput({})
        logits = self.model.compute_logits(hidden[torch.tensor(logits_rows, device=dev)])
        if logits is None:  # tensor-parallel rank > 0: rank 0 gathered the logits and samples
            return ModelRunnerOutput({})
        # A forking leader's row is sampled once per sibling, each with its own params and generator.
        row_index = [i for i, group in enumerate(sample_groups) for _ in group]
        req_ids = [rid for group in sample_groups for rid in group]
        if len(row_index) != len(logits_rows):
            logits = logits[torch.tensor(row_index, device=dev)]
        tokens, logprobs, failed = sample(logits, [self.states[rid] for rid in req_ids])
        return ModelRunnerOutput({rid: t for rid, t in zip(req_ids, tokens) if t is not None},
                                 {rid: lp for rid, lp in zip(req_ids, logprobs) if lp is not None},
                                 failed={req_ids[i]: stage for i, stage in failed.items()})

    def _metadata(self, query_lens: list[int], seq_lens: list[int], tables: list[list[int]],
                  slot_mapping: torch.Tensor, has_padding: bool = False) -> AttentionMetadata:
        dev = self.device
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        cu = [0]
        for n in query_lens:
            cu.append(cu[-1] + n)
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=dev),
            max_seqlen_q=max(query_lens), max_seqlen_k=max(seq_lens),
            query_lens_list=query_lens, seq_lens_list=seq_lens, has_padding_slots=has_padding)
        return meta

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        src = torch.tensor([c[0] for c in copies], device=self.device)
        dst = torch.tensor([c[1] for c in copies], device=self.device)
        for k_cache, v_cache in self.kv_caches:
            k_cache[dst] = k_cache[src]
            v_cache[dst] = v_cache[src]

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_blocks * self.kv_bytes_per_block()

