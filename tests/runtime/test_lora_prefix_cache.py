"""Prefix caching keyed by the loaded LoRA adapter's identity (issue 24): the same prompt under two adapters
never shares KV blocks, under one adapter it does, and a reload under the same name (new identity) never
reuses the old adapter's blocks."""

from __future__ import annotations

from kvserve.runtime.core.block_hash import NONE_HASH, block_hashes, root_hash
from kvserve.runtime.core.kv_cache_manager import KVCacheManager
from kvserve.runtime.request import Request
from kvserve.runtime.sampling_params import SamplingParams

BS = 4
PROMPT = list(range(13))  # 3 full blocks


def _req(rid, name=None, identity=None):
    return Request(rid, PROMPT, SamplingParams(max_tokens=8), lora_name=name, lora_identity=identity)


def _run_and_free(kv, req):
    hits, num_hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - num_hit, hits) is not None
    req.num_computed_tokens = req.num_tokens
    kv.free(req)


def _hit_tokens(kv, req):
    return kv.get_computed_blocks(req)[1]


def test_same_adapter_shares_other_adapter_and_base_do_not():
    kv = KVCacheManager(num_blocks=32, block_size=BS)
    _run_and_free(kv, _req("a", "sql", "id-sql-1"))
    assert _hit_tokens(kv, _req("b", "sql", "id-sql-1")) == 12  # same loaded adapter: shared
    assert _hit_tokens(kv, _req("c", "chat", "id-chat-1")) == 0  # other adapter: nothing shared
    assert _hit_tokens(kv, _req("d")) == 0  # base model: nothing shared
    _run_and_free(kv, _req("e"))
    assert _hit_tokens(kv, _req("f")) == 12  # base still shares with base
    assert _hit_tokens(kv, _req("g", "sql", "id-sql-1")) == 12


def test_reload_under_same_name_does_not_reuse_stale_blocks():
    kv = KVCacheManager(num_blocks=32, block_size=BS)
    _run_and_free(kv, _req("a", "sql", "id-sql-1"))
    assert _hit_tokens(kv, _req("b", "sql", "id-sql-2")) == 0  # same name, new weights


def test_base_chain_unchanged():
    # The base model's chain (and so the router's hashes) is the same as before adapters existed.
    assert root_hash(None) == NONE_HASH
    assert block_hashes(PROMPT, BS) != []
