"""The engine core's hook for `--kv-events-config`: turn the block pool's event recording on, publish what
each step recorded as one batch. Imports pyzmq only when events are enabled (the offline runtime may lack it).
"""

from __future__ import annotations

from kvserve.runtime.core.block_pool import BlockPool
from kvserve.runtime.core.kv_cache_events import KVEventCollector
from kvserve.runtime.kv_events.config import KVEventsConfig


class StepEventPublisher:
    def __init__(self, config: KVEventsConfig, block_pool: BlockPool) -> None:
        try:
            from kvserve.runtime.kv_events.publisher import ZmqEventPublisher
        except ImportError as exc:  # pyzmq comes with the server extra
            raise RuntimeError(f"--kv-events-config needs pyzmq (pip install 'kvserve[server]'): {exc}") from exc
        self.publisher = ZmqEventPublisher(config)
        self.collector = block_pool.events = KVEventCollector()

    def publish_step(self) -> None:
        """One batch with this step's records; nothing when the step recorded nothing (as vLLM)."""
        if len(self.collector):
            self.publisher.publish(self.collector.take())

    def stats(self) -> dict[str, int]:
        """EngineStats' kv_events_* fields (cumulative)."""
        return {
            "kv_events_published_batches": self.publisher.sent_batches,
            "kv_events_dropped_batches": self.publisher.dropped_batches,
        }

    def shutdown(self) -> None:
        self.publisher.shutdown()


def make_step_publisher(config: KVEventsConfig | None, block_pool: BlockPool) -> StepEventPublisher | None:
    """None unless events are enabled with a real publisher ("null" records nothing at all)."""
    if config is None or not config.active:
        return None
    return StepEventPublisher(config, block_pool)
