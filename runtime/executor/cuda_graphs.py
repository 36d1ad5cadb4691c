"""CUDA graphs for pure-decode steps, captured at start-up at a ladder of batch sizes (vLLM's capture sizes).

Why: a decode step of a large batch launches a few hundred kernels (per layer: norms, the fused QKV and MLP
matmuls, RoPE, the KV store, attention, the all-reduce-free residuals); on a GPU each launch costs a few
microseconds of host time, so at small batches the step is launch-bound. Replaying one captured graph costs
one launch.

How: the runner keeps static device buffers (input ids, positions, slot mapping, context lengths, query
offsets, block tables) sized for the largest capture size. For each size B (largest first, all sharing one
memory pool) it runs the forward twice (Triton JIT, cached scale tensors) and captures a third run reading
those buffers. A decode step of n <= max(sizes) sequences pads to the smallest captured B >= n: rows n..B-1
get slot -1 (the KV store skips them), context length 1 and position 0; their outputs are dropped.

Fixed at capture, hence the rules runtime/cuda_graph_settings.py enforces at config time:
- the attention metadata's host ints: `max_seqlen_q = 1` and `max_seqlen_k = max_model_len`, so the Triton
  decode picks its split count from the longest possible context (the kernels read each row's real length
  from `seq_lens` at run time and skip empty segments). The torch backend reads host lists per step, so
  graphs need `attention_backend="triton"`;
- one KV cache group (sliding-window models build per-group metadata each step: not captured);
- no data-dependent host work in the forward (MoE routing counts experts on the host: not capturable);
- tensor_parallel_size 1 (NCCL all-reduce under capture is not verified here).
Prefill and mixed steps, and decode steps above the largest size, run eagerly as before.

Memory: the KV cache is sized (profiled) before capture, so the graphs' pool comes out of the headroom that
gpu_memory_utilization leaves; decode graphs hold activations for at most max(sizes) tokens, far fewer than
the profiled prefill step's max_num_batched_tokens. The capture logs what it added (`memory_bytes`).

Logits are computed eagerly from the graph's hidden states (only the rows that sample), so sampling,
logprobs, structured outputs and penalties are unchanged.

Tests on CPU: with `cuda_graph_settings.EMULATE_ON_CPU = True` (tests only) "capture" records the forward and "replay"
re-runs
it on the same static buffers with the metadata frozen at capture, which checks everything above but the
CUDA graph object itself (padding, static buffers, fixed split counts, dropped rows) under the Triton
interpreter. The CUDA path is exercised by runtime/bench/gpu_serving.py on a GPU.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from kvserve.runtime.models.attention import AttentionMetadata

logger = logging.getLogger("kvserve.cuda_graphs")


class _EmulatedGraph:
    """CPU stand-in for torch.cuda.CUDAGraph: replay re-runs the recorded forward on the same buffers and
    copies the result into the captured output tensor (as a graph replay writes into its output)."""

    def __init__(self, fn):
        self.fn = fn
        self.output = fn()

    def replay(self) -> None:
        self.output.copy_(self.fn())


class DecodeGraphs:
    def __init__(
        self,
        model,
        kv_caches,
        device: torch.device,
        capture_sizes: tuple[int, ...],
        max_model_len: int,
        max_blocks_per_seq: int,
    ):
        self.model, self.kv_caches, self.device = model, kv_caches, device
        self.capture_sizes = tuple(sorted(set(capture_sizes)))
        self.max_size = self.capture_sizes[-1]
        self.max_model_len = max_model_len
        # size_for[n]: the smallest captured size >= n, for every n up to the largest size.
        self._size_for = np.zeros(self.max_size + 1, dtype=np.int64)
        for size in reversed(self.capture_sizes):
            self._size_for[1 : size + 1] = size
        cuda = device.type == "cuda"
        n, w = self.max_size, max_blocks_per_seq

        def static(shape, dtype, fill):
            return torch.full(shape, fill, dtype=dtype, device=device)

        def staging(shape, dtype, fill):  # host side, pinned on CUDA so the step's copies are asynchronous
            return torch.full(shape, fill, dtype=dtype, pin_memory=cuda)

        # Device buffers the graphs read, and host staging buffers of the same shape (padding values preset).
        self.input_ids, self.host_ids = static((n,), torch.long, 0), staging((n,), torch.long, 0)
        self.positions, self.host_positions = static((n,), torch.long, 0), staging((n,), torch.long, 0)
        self.slot_mapping, self.host_slots = static((n,), torch.long, -1), staging((n,), torch.long, -1)
        self.seq_lens, self.host_seq_lens = static((n,), torch.int32, 1), staging((n,), torch.int32, 1)
        self.block_tables, self.host_tables = static((n, w), torch.int32, 0), staging((n, w), torch.int32, 0)
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=device)  # one query per row, always
        # numpy views of the staging buffers: row writes there cost ~nothing next to torch indexing
        self._np = {
            name: getattr(self, name).numpy()
            for name in ("host_ids", "host_positions", "host_slots", "host_seq_lens", "host_tables")
        }
        self.graphs: dict[int, tuple[object, torch.Tensor]] = {}  # size -> (graph, its output buffer)
        self.capture_s = 0.0
        self.memory_bytes = 0  # device memory the capture added (its pool and static outputs); 0 on CPU
        self.num_replays = 0
        self._staged = torch.cuda.Event() if cuda else None  # recorded after each step's host-to-device copies

    def metadata(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            cu_seqlens_q=self.cu_seqlens_q[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            max_seqlen_q=1,
            max_seqlen_k=self.max_model_len,
            query_lens_list=[1] * size,
            seq_lens_list=[self.max_model_len] * size,
            has_padding_slots=True,
        )

    def _forward(self, size: int, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, meta)

    @torch.inference_mode()
    def capture(self) -> None:
        """Every size, largest first (smaller graphs reuse the largest one's pool). The buffers hold padding
        values (slot -1, context length 1), so warm-up and capture runs write no KV."""
        start = time.perf_counter()
        cuda = self.device.type == "cuda"
        pool = torch.cuda.graph_pool_handle() if cuda else None
        if cuda:  # the profile's cached activations go back first, so the growth below is the graphs' own
            torch.cuda.empty_cache()
            reserved_before = torch.cuda.memory_reserved(self.device)
        for size in reversed(self.capture_sizes):
            meta = self.metadata(size)
            for _ in range(2):  # warm-up outside the graph: Triton compiles, lazily cached tensors appear
                self._forward(size, meta)
            if cuda:
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    output = self._forward(size, meta)
            else:
                graph = _EmulatedGraph(lambda size=size, meta=meta: self._forward(size, meta))
                output = graph.output
            self.graphs[size] = (graph, output)
        if cuda:
            torch.cuda.synchronize(self.device)
            self.memory_bytes = torch.cuda.memory_reserved(self.device) - reserved_before
        self.capture_s = time.perf_counter() - start
        logger.info(
            "captured %d decode CUDA graphs (batch sizes %s..%s) in %.1f s, %.0f MiB of graph memory",
            len(self.graphs),
            self.capture_sizes[0],
            self.max_size,
            self.capture_s,
            self.memory_bytes / 2**20,
        )

    def can_run(self, num_seqs: int) -> bool:
        return 0 < num_seqs <= self.max_size

    def run(
        self,
        input_ids: list[int],
        positions: np.ndarray,
        slots: np.ndarray,
        seq_lens: np.ndarray,
        table_rows: np.ndarray,
    ) -> torch.Tensor:
        """One pure-decode step of n = len(input_ids) sequences; returns hidden states [n, hidden] (a view
        of the graph's output, valid until the next replay). table_rows: [n, width] block-table rows."""
        n = len(input_ids)
        size = int(self._size_for[n])
        if self._staged is not None:  # the last step's copies read the staging buffers: done before rewriting
            self._staged.synchronize()  # (the step's sampling already synchronised: this costs ~nothing)
        h = self._np
        h["host_ids"][:n] = input_ids
        h["host_positions"][:n] = positions
        h["host_slots"][:n] = slots
        h["host_seq_lens"][:n] = seq_lens
        h["host_tables"][:n, : table_rows.shape[1]] = table_rows
        if size > n:  # rows left by a larger earlier step: back to padding
            h["host_slots"][n:size] = -1
            h["host_seq_lens"][n:size] = 1
            h["host_positions"][n:size] = 0
        self.input_ids[:size].copy_(self.host_ids[:size], non_blocking=True)
        self.positions[:size].copy_(self.host_positions[:size], non_blocking=True)
        self.slot_mapping[:size].copy_(self.host_slots[:size], non_blocking=True)
        self.seq_lens[:size].copy_(self.host_seq_lens[:size], non_blocking=True)
        # Whole rows (contiguous); entries past a row's length are never read (its seq_len bounds the reads).
        self.block_tables[:n].copy_(self.host_tables[:n], non_blocking=True)
        if self._staged is not None:
            self._staged.record()
        graph, output = self.graphs[size]
        graph.replay()
        self.num_replays += 1
        return output[:n]
