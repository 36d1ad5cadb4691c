"""Prefill/decode disaggregation (issue 42): `--kv-transfer-config` (config.py) and the NIXL transport that
moves a prompt's KV from a prefill engine to a decode engine (nixl_agent.py, side_channel.py). The scheduler's
half of the connector is core/pd_connector.py (torch-free); the runner's half is executor/kv_pull.py."""
