"""P/D disaggregation tests: two engines (prefill, decode) with NIXL agents in one process or two `kvserve
serve` processes, random-weight models from the runtime tests' factory, everything on 127.0.0.1."""

from __future__ import annotations

import os

os.environ.setdefault("UCX_NET_DEVICES", "lo")  # UCX listens on every interface otherwise: keep it on loopback

from tests.runtime.conftest import model_factory  # noqa: E402,F401  (the session-scoped model builder)
