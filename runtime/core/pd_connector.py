"""Prefill/decode disaggregation, the scheduler's half (vLLM's NixlConnector scheduler side; the runner's
half is executor/kv_pull.py). Pure Python: block ids, leases and timers, no transport.

Prefill engine (a request whose kv_transfer_params say do_remote_decode): it runs as usual (the proxy sends
max_tokens=1). When it finishes by length, its blocks are not freed: they go under a lease and the request's
output carries kv_transfer_params {do_remote_prefill: true, remote_engine_id, remote_block_ids, remote_host,
remote_port, remote_request_id, tp_size} -- vLLM's form -- for the decode engine. The lease ends when the
decode engine's notification arrives (ModelRunnerOutput.finished_sending names the request) or after
abort_request_timeout_s (vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT); any other finish frees them at once.

Decode engine (do_remote_prefill): on admission the request's own prefix-cache hit is kept, blocks for the
rest of the prompt are allocated (not registered in the prefix cache: their KV is not there yet), and the
remote blocks after the hit are listed for a pull (KVConnectorStep.pull). The request waits
(WAITING_FOR_REMOTE_KVS) until the runner reports the pull done (finished_receiving) -- then every prompt
token but the last counts as computed (the last is computed here, for its logits) -- or failed
(failed_receiving): then it recomputes from its own hit, so a dead prefill engine costs time, never a token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from kvserve.runtime.core.block_pool import BlockPool, KVCacheBlock
from kvserve.runtime.core.outputs import KVTransfer
from kvserve.runtime.request import Request

# The request fields (vLLM's nixl_connector.py names).
REMOTE_FIELDS = ("remote_engine_id", "remote_block_ids", "remote_host", "remote_port", "remote_request_id")


@dataclass(frozen=True)
class PDEndpoint:
    """What a prefill engine tells decode engines about itself (from --kv-transfer-config)."""

    engine_id: str
    host: str  # the NIXL side channel (kv_transfer/side_channel.py)
    port: int
    tp_size: int = 1


def wants_remote_decode(request: Request) -> bool:
    params = request.sampling_params.kv_transfer_params
    return bool(params and params.get("do_remote_decode"))


def wants_remote_prefill(request: Request) -> bool:
    params = request.sampling_params.kv_transfer_params
    return bool(params and params.get("do_remote_prefill")) and not request.remote_prefill_done


class PDConnector:
    def __init__(
        self, endpoint: PDEndpoint | None, pool: BlockPool, block_size: int, lease_s: float, clock=time.monotonic
    ):
        """endpoint: None on a pure decode engine (kv_consumer: it leases nothing, it has no side channel)."""
        self.endpoint = endpoint
        self.pool = pool
        self.block_size = block_size
        self.lease_s = lease_s
        self.clock = clock
        self._leases: dict[str, tuple[list[KVCacheBlock], float]] = {}  # prefill: req id -> (blocks, deadline)
        self._pulls: dict[str, KVTransfer] = {}  # decode: pulls to start with the next step
        # Decode: blocks of requests finished (aborted) while their pull was in flight; the transfer may still
        # write into them, so they are freed only when it reports done or failed.
        self._orphans: dict[str, list[KVCacheBlock]] = {}
        self.num_leases_expired = 0
        self.num_pulled_tokens = 0
        self.num_failed_pulls = 0

    # -- prefill side ----------------------------------------------------------------------------------
    @property
    def can_lease(self) -> bool:
        return self.endpoint is not None

    def lease(self, request: Request, blocks: list[KVCacheBlock]) -> dict:
        """Hold a finished prefill's blocks for a remote decode; returns the response's kv_transfer_params."""
        rid = request.request_id
        self._leases[rid] = (blocks, self.clock() + self.lease_s)
        ep = self.endpoint
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [b.block_id for b in blocks],
            "remote_engine_id": ep.engine_id,
            "remote_request_id": rid,
            "remote_host": ep.host,
            "remote_port": ep.port,
            "tp_size": ep.tp_size,
        }

    def release(self, request_ids) -> None:
        """The decode engines pulled these (their notification arrived)."""
        for rid in request_ids:
            held = self._leases.pop(rid, None)
            if held is not None:
                self.pool.free_blocks(reversed(held[0]))

    def expire(self) -> None:
        now = self.clock()
        for rid in [rid for rid, (_, deadline) in self._leases.items() if deadline <= now]:
            self.num_leases_expired += 1
            self.pool.free_blocks(reversed(self._leases.pop(rid)[0]))

    def leased_ids(self) -> list[str]:
        return list(self._leases)

    @property
    def num_leased_blocks(self) -> int:
        return sum(len(blocks) for blocks, _ in self._leases.values())

    # -- decode side -----------------------------------------------------------------------------------
    def record_pull(self, request: Request, blocks: list[KVCacheBlock], num_hit_blocks: int) -> int:
        """The request's blocks are allocated for its whole prompt, blocks[:num_hit_blocks] being its own
        prefix-cache hit: pull the remote ones after them that hold prompt KV before its last token. Returns
        the tokens pulled. With nothing to pull (a full local hit) the transfer is still recorded: the runner
        then only notifies the prefill engine, which frees its lease."""
        params = request.sampling_params.kv_transfer_params
        remote_ids = list(params["remote_block_ids"])
        num_needed = -(-(request.num_prompt_tokens - 1) // self.block_size)  # blocks holding tokens 0..n-2
        end = min(num_needed, len(remote_ids))
        first = min(num_hit_blocks, end)
        num_tokens = max(0, min(end * self.block_size, request.num_prompt_tokens - 1) - first * self.block_size)
        self._pulls[request.request_id] = KVTransfer(
            [b.block_id for b in blocks[first:end]],
            num_tokens,
            remote={**{k: params[k] for k in REMOTE_FIELDS}, "remote_block_ids": remote_ids[first:end]},
        )
        request.remote_prefill_done = True  # one pull per request, even if it is preempted later
        return num_tokens

    def take_pulls(self) -> dict[str, KVTransfer]:
        pulls, self._pulls = self._pulls, {}
        return pulls

    def orphan(self, request_id: str, blocks: list[KVCacheBlock]) -> None:
        if self._pulls.pop(request_id, None) is not None:  # not handed to the runner yet: nothing writes them
            self.pool.free_blocks(reversed(blocks))
        else:
            self._orphans[request_id] = blocks

    def pull_ended(self, request_id: str) -> bool:
        """A pull reported done or failed; True if its request was finished meanwhile (its blocks now freed)."""
        blocks = self._orphans.pop(request_id, None)
        if blocks is None:
            return False
        self.pool.free_blocks(reversed(blocks))
        return True

    def stats(self) -> dict[str, int]:
        """EngineStats' pd_* fields (runtime/metrics.py exports them): leases held now and their blocks, then
        cumulative -- leases expired without a notification, prompt tokens pulled, pulls that failed."""
        return dict(
            pd_enabled=1,
            pd_leases_held=len(self._leases),
            pd_leased_blocks=self.num_leased_blocks,
            pd_leases_expired=self.num_leases_expired,
            pd_pulled_tokens=self.num_pulled_tokens,
            pd_failed_pulls=self.num_failed_pulls,
        )

    @property
    def busy(self) -> bool:
        """Work only the runner's polling can finish: leases, pulls in flight or not yet started."""
        return bool(self._leases or self._pulls or self._orphans)
