"""--kv-transfer-config parsing (vLLM's KVTransferConfig field names) and the scheduler's P/D half on its own:
leases and pulls over a real block pool, with a fake clock (no NIXL, no torch)."""

from __future__ import annotations

import json

import pytest

from kvserve.runtime.core.kv_cache_manager import KVCacheManager
from kvserve.runtime.core.outputs import ModelRunnerOutput
from kvserve.runtime.core.pd_connector import PDConnector, PDEndpoint
from kvserve.runtime.core.scheduler import Scheduler, SchedulerConfig
from kvserve.runtime.errors import InvalidParameter
from kvserve.runtime.kv_transfer.config import parse_kv_transfer_config
from kvserve.runtime.request import Request, RequestStatus
from kvserve.runtime.sampling_params import SamplingParams


def test_parses_vllm_json():
    cfg = parse_kv_transfer_config(
        '{"kv_connector": "NixlConnector", "kv_role": "kv_producer", "engine_id": "p0", '
        '"kv_connector_extra_config": {"side_channel_port": 5700, "abort_request_timeout": 30}}'
    )
    assert cfg.kv_connector == "NixlConnector" and cfg.is_producer and not cfg.is_consumer
    assert cfg.engine_id == "p0" and cfg.side_channel_port == 5700 and cfg.abort_request_timeout_s == 30
    assert cfg.backends == ("UCX",)
    both = parse_kv_transfer_config({"kv_connector": "NixlConnector", "kv_role": "kv_both"})
    assert both.is_producer and both.is_consumer and len(both.engine_id) == 36  # a uuid4, as vLLM's default
    assert parse_kv_transfer_config(None) is None and parse_kv_transfer_config("") is None


def test_environment_defaults(monkeypatch):
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_HOST", "10.0.0.7")
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", "5601")
    monkeypatch.setenv("VLLM_NIXL_ABORT_REQUEST_TIMEOUT", "12")
    cfg = parse_kv_transfer_config({"kv_connector": "NixlConnector", "kv_role": "kv_consumer"})
    assert (cfg.side_channel_host, cfg.side_channel_port, cfg.abort_request_timeout_s) == ("10.0.0.7", 5601, 12)


@pytest.mark.parametrize(
    "value, param",
    [
        ("{not json", "kv_transfer_config"),
        ("[1]", "kv_transfer_config"),
        ({"kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_rol": 1}, "kv_transfer_config"),
        ({"kv_role": "kv_producer"}, "kv_transfer_config.kv_connector"),
        ({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}, "kv_transfer_config.kv_connector"),
        ({"kv_connector": "NixlConnector"}, "kv_transfer_config.kv_role"),
        ({"kv_connector": "NixlConnector", "kv_role": "producer"}, "kv_transfer_config.kv_role"),
        ({"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_port": "1"}, "kv_transfer_config.kv_port"),
        (
            {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_load_failure_policy": "fail"},
            "kv_transfer_config.kv_load_failure_policy",
        ),
        (
            {
                "kv_connector": "NixlConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"side_channel_port": 0},
            },
            "kv_transfer_config.kv_connector_extra_config.side_channel_port",
        ),
        (
            {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"backends": "UCX"}},
            "kv_transfer_config.kv_connector_extra_config.backends",
        ),
        (
            {
                "kv_connector": "NixlConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"abort_request_timeout": -1},
            },
            "kv_transfer_config.kv_connector_extra_config.abort_request_timeout",
        ),
    ],
)
def test_errors_name_the_field(value, param):
    with pytest.raises(InvalidParameter) as err:
        parse_kv_transfer_config(value if isinstance(value, str) else json.dumps(value))
    assert err.value.param == param


def test_request_params_checked():
    with pytest.raises(InvalidParameter) as err:
        SamplingParams(kv_transfer_params={"do_remote_prefill": True, "remote_block_ids": [1], "remote_port": 1})
    assert err.value.param == "kv_transfer_params.remote_engine_id"
    with pytest.raises(InvalidParameter) as err:
        SamplingParams(kv_transfer_params=[1])
    assert err.value.param == "kv_transfer_params"
    # The toy proxy's prefill leg: the remote fields present and null.
    SamplingParams(kv_transfer_params={"do_remote_decode": True, "remote_block_ids": None, "remote_port": None})


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _scheduler(clock, endpoint=PDEndpoint("p0", "127.0.0.1", 5600)) -> Scheduler:
    kv = KVCacheManager(num_blocks=32, block_size=4)
    return Scheduler(SchedulerConfig(max_model_len=128), kv, pd=PDConnector(endpoint, kv.pool, 4, 10.0, clock))


def _step(s: Scheduler, sampled: int = 7, **runner):
    out = s.schedule()
    return out, s.update_from_output(
        out, ModelRunnerOutput({r.req_id: sampled for r in out.scheduled if r.sample}, **runner)
    )


def test_prefill_lease_held_until_notified_or_expired():
    clock = _Clock()
    s = _scheduler(clock)
    free = s.kv.num_free_blocks
    for rid in ("a", "b"):
        s.add_request(
            Request(
                rid, list(range(1, 11)), SamplingParams(max_tokens=1, kv_transfer_params={"do_remote_decode": True})
            )
        )
    _, outs = _step(s)
    params = {o.req_id: o.kv_transfer_params for o in outs}
    assert params["a"]["remote_block_ids"] and params["a"]["remote_request_id"] == "a"
    assert params["a"]["remote_engine_id"] == "p0" and params["a"]["remote_port"] == 5600
    assert s.pd.num_leased_blocks == 6 and s.has_kv_transfers and not s.has_unfinished_requests()
    _step(s, finished_sending={"a"})  # a's decode engine pulled it
    assert s.pd.num_leased_blocks == 3
    clock.now = 9.9
    _step(s)
    assert s.pd.num_leased_blocks == 3
    clock.now = 10.0
    _step(s)
    assert s.pd.num_leased_blocks == 0 and s.pd.num_leases_expired == 1 and s.kv.num_free_blocks == free
    assert not s.has_kv_transfers


def test_prefill_that_stops_early_holds_nothing():
    s = _scheduler(_Clock())
    params = SamplingParams(max_tokens=4, kv_transfer_params={"do_remote_decode": True}, stop_token_ids=[7])
    s.add_request(Request("a", list(range(1, 11)), params))
    _, outs = _step(s)
    assert outs[0].finish_reason == "stop" and outs[0].kv_transfer_params is None and s.pd.num_leased_blocks == 0


def _remote(block_ids) -> dict:
    return {
        "do_remote_prefill": True,
        "remote_block_ids": block_ids,
        "remote_engine_id": "p0",
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
        "remote_request_id": "a",
    }


@pytest.mark.parametrize("failed", [False, True])
def test_decode_waits_for_the_pull_then_computes_the_last_token(failed):
    s = _scheduler(_Clock(), endpoint=None)
    s.add_request(Request("d", list(range(1, 11)), SamplingParams(max_tokens=3, kv_transfer_params=_remote([5, 6, 7]))))
    out, outs = _step(s)
    assert not out.scheduled and outs == []
    pull = out.kv_connector.pull["d"]
    assert pull.remote["remote_block_ids"] == [5, 6, 7] and len(pull.block_ids) == 3 and pull.num_tokens == 9
    assert s.requests["d"].status == RequestStatus.WAITING_FOR_REMOTE_KVS and s.num_waiting == 1
    out, _ = _step(s)  # still pulling: nothing runs
    assert not out.scheduled and not out.kv_connector.pull
    runner = {"failed_receiving": {"d": [0, 1, 2]}} if failed else {"finished_receiving": {"d"}}
    _step(s, **runner)
    out, outs = _step(s)
    (sched,) = out.scheduled
    # Pulled: only the last prompt token is computed here; failed: the whole prompt, recomputed.
    assert len(sched.token_ids) == (10 if failed else 1) and sched.sample and outs[0].new_token_ids == [7]
    assert s.pd.num_failed_pulls == int(failed)


def test_compat_hash_names_the_block_layout():
    """Two engines whose blocks order their elements differently (the CPU backend's AMX block layout against token
    order) must fail the handshake's layout check instead of reading each other's blocks."""
    from kvserve.runtime.kv_transfer.side_channel import compat_hash

    shape = (2, 30, 16, 3, 64)
    assert compat_hash(shape, "torch.bfloat16", "token") == compat_hash(shape, "torch.bfloat16", "token")
    assert compat_hash(shape, "torch.bfloat16", "token") != compat_hash(shape, "torch.bfloat16", "amx-bf16")
