"""Property-based fuzzing of the live server (hypothesis): completions and chat bodies, valid and invalid,
with extreme ints, floats, strings and lists in every field, each sent while a canary greedy request runs.

Every answer must be 2xx, or 4xx with an OpenAI error body (never 5xx, never a Python repr, never slower
than a bound); streams end with [DONE] and carry no error event; /health stays 200; the canary's text always
equals its solo run; at the end every KV block is free and no engine step failed.

Profiles (KVSERVE_FUZZ_PROFILE): `ci` (default; derandomized, so CI runs the same examples every time,
about a minute) and `long` (random, thousands of examples; run by hand, result in docs/serving.md):
    KVSERVE_FUZZ_PROFILE=long .venv/bin/python -m pytest -q -s tests/server/test_fuzz.py
"""

from __future__ import annotations

import json
import math
import os
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.conftest import LiveServer, make_engine

PROFILE = os.environ.get("KVSERVE_FUZZ_PROFILE", "ci")
EXAMPLES = {"ci": 150, "long": 3000}[PROFILE]  # per endpoint
pytestmark = pytest.mark.timeout({"ci": 300, "long": 7200}[PROFILE])

C, CHAT = "/v1/completions", "/v1/chat/completions"
REJECT_BOUND_S = 5.0  # a 4xx must come at once (generous: 2 shared cores, GIL shared with the client)
ANSWER_BOUND_S = 60.0  # a valid request generates at most max_model_len=192 tokens x n samples
CANARY = {"prompt": "The canary sings", "max_tokens": 48, "temperature": 0, "ignore_eos": True}

# -- values --------------------------------------------------------------------------------------------
EXTREME_INTS = st.sampled_from(
    [
        0,
        1,
        -1,
        2,
        7,
        255,
        256,
        511,
        512,
        2**31,
        -(2**31),
        2**53 + 1,
        2**63 - 1,
        2**63,
        -(2**63),
        -(2**63) - 1,
        2**64,
        10**30,
        1180591620717411303424,
    ]
)
EXTREME_FLOATS = st.sampled_from(
    [0.0, -0.0, 1e-320, 0.5, 1.0, 1.5, 2.0, 2.0000001, -2.0, 3.0, 1e308, -1e308, math.inf, -math.inf, math.nan]
)
WEIRD_TEXT = st.sampled_from(
    [
        "",
        " ",
        "\x00",
        "\ud800",
        "a\udfffb",
        "<s>",
        "</s>",
        "<unk>",
        "\n" * 50,
        "😀" * 10,
        "a" * 5000,
        "lighthouse " * 3000,
        "\u202e\u200b",
    ]
)
TEXT = st.text(max_size=40) | WEIRD_TEXT
INTS = st.integers(-5, 600) | EXTREME_INTS
FLOATS = st.floats(-3, 3) | EXTREME_FLOATS
SCALARS = st.none() | st.booleans() | INTS | FLOATS | TEXT
ANY = st.recursive(
    SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=3), max_leaves=8
)
TOKEN_LISTS = st.lists(st.integers(0, 600) | EXTREME_INTS, max_size=12) | st.sampled_from([[5] * 3000, [], [[1, 2]]])


# Each field: (values it accepts, edge values -- extremes, wrong types of the same shape).
SAMPLING_FIELDS = {
    "model": (st.just("test-model"), TEXT),
    "max_tokens": (st.integers(1, 24), EXTREME_INTS),
    "temperature": (st.floats(0, 2), EXTREME_FLOATS),
    "top_p": (st.floats(0, 1, exclude_min=True), EXTREME_FLOATS),
    "top_k": (st.integers(-1, 600), EXTREME_INTS),
    "min_p": (st.floats(0, 1), EXTREME_FLOATS),
    "n": (st.integers(1, 4), EXTREME_INTS),
    "seed": (st.integers(-(2**63), 2**63 - 1), EXTREME_INTS),
    "stop": (st.lists(st.text(min_size=1, max_size=5), max_size=3), TEXT | st.lists(TEXT, max_size=20)),
    "stop_token_ids": (st.lists(st.integers(0, 511), max_size=4), TOKEN_LISTS),
    "min_tokens": (st.integers(0, 1), EXTREME_INTS),
    "ignore_eos": (st.booleans(), SCALARS),
    "presence_penalty": (st.floats(-2, 2), EXTREME_FLOATS),
    "frequency_penalty": (st.floats(-2, 2), EXTREME_FLOATS),
    "repetition_penalty": (st.floats(0.01, 2), EXTREME_FLOATS),
    "stream": (st.booleans(), SCALARS),
    "stream_options": (st.fixed_dictionaries({"include_usage": st.booleans()}), ANY),
    "skip_special_tokens": (st.booleans(), SCALARS),
    "include_stop_str_in_output": (st.booleans(), SCALARS),
    "user": (st.text(max_size=10), TEXT),
    "best_of": (st.integers(1, 4), EXTREME_INTS),
    "logit_bias": (st.just({}), st.dictionaries(st.sampled_from(["5", "x"]), FLOATS, max_size=2)),
}
COMPLETION_FIELDS = {
    **SAMPLING_FIELDS,
    "prompt": (
        st.text(min_size=1, max_size=30)
        | st.lists(st.integers(0, 511), min_size=1, max_size=12)
        | st.lists(st.text(min_size=1, max_size=10), min_size=1, max_size=3),
        TEXT | TOKEN_LISTS | st.lists(TEXT | TOKEN_LISTS, min_size=1, max_size=3),
    ),
    "logprobs": (st.integers(0, 5), EXTREME_INTS),
    "echo": (st.booleans(), SCALARS),
    "suffix": (st.just(""), TEXT),
}
_VALID_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"]), "content": st.text(max_size=30)}
)
_EDGE_MESSAGE = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant", "tool", "developer", "wizard"]) | SCALARS,
        "content": TEXT
        | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": TEXT}), max_size=2)
        | SCALARS,
    }
)
CHAT_FIELDS = {
    **SAMPLING_FIELDS,
    "messages": (st.lists(_VALID_MESSAGE, min_size=1, max_size=4), st.lists(_EDGE_MESSAGE, max_size=4)),
    "logprobs": (st.booleans(), SCALARS),
    "top_logprobs": (st.integers(0, 5), EXTREME_INTS),
    "max_completion_tokens": (st.integers(1, 24), EXTREME_INTS),
    "add_generation_prompt": (st.booleans(), SCALARS),
    "tools": (st.just([]), st.lists(ANY, max_size=2)),
    "response_format": (st.just({"type": "text"}), st.fixed_dictionaries({"type": TEXT})),
}


def bodies(fields: dict, required: str) -> st.SearchStrategy:
    """Three kinds of bodies: every field valid (they run, next to the canary); fields valid or at their
    edges; fields valid, at their edges, or anything at all -- plus raw bytes that are not even JSON."""

    def body(pick) -> st.SearchStrategy:
        others = {k: pick(v) for k, v in fields.items() if k != required}
        return st.fixed_dictionaries({required: pick(fields[required])}, optional=others).map(lambda d: ("json", d))

    valid = body(lambda v: v[0])
    edge = body(lambda v: st.one_of(v[0], v[0], v[0], v[1]))
    hostile = body(lambda v: st.one_of(v[0], v[0], v[1], ANY))
    raw = st.binary(max_size=64).map(lambda b: ("raw", b))
    return st.one_of(valid, valid, edge, edge, hostile, raw)


# -- the server, the canary ----------------------------------------------------------------------------
class Canary:
    """Greedy completions back to back in a thread, for the whole fuzz run: every fuzz request is sent
    while one is generating. Each text must equal the solo run's."""

    def __init__(self, base_url: str):
        self.client = httpx.Client(base_url=base_url, timeout=120)
        self.solo = self._one()
        self.texts: list[str] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _one(self) -> str:
        resp = self.client.post(C, json=CANARY)
        assert resp.status_code == 200, resp.text
        return resp.json()["choices"][0]["text"]

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.texts.append(self._one())
            except BaseException as exc:  # noqa: BLE001 -- reported by the test
                self.errors.append(f"{type(exc).__name__}: {exc}")

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(120)
        self.client.close()


@pytest.fixture(scope="module")
def fuzz_server(demo_model_dir):
    srv = LiveServer(make_engine(demo_model_dir, max_model_len=192, max_num_seqs=8, kv_cache_bytes=8 << 20))
    canary = Canary(srv.base_url)
    client = httpx.Client(base_url=srv.base_url, timeout=ANSWER_BOUND_S + 10)
    yield srv, canary, client
    client.close()
    canary.stop()
    srv.stop()


STATUSES: dict[int, int] = {}  # status -> count, printed at the end (the run must exercise both 2xx and 4xx)


def check_answer(client: httpx.Client, path: str, kind: str, body) -> None:
    if kind == "raw":
        content = body
    else:
        content = json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")
    start = time.monotonic()
    resp = client.post(path, content=content, headers={"content-type": "application/json"})
    seconds = time.monotonic() - start
    STATUSES[resp.status_code] = STATUSES.get(resp.status_code, 0) + 1
    label = f"{path} {content[:300]!r} -> {resp.status_code} {resp.text[:300]!r}"
    assert resp.status_code < 500, label
    if resp.status_code >= 400:
        assert seconds < REJECT_BOUND_S, f"{label}: rejected after {seconds:.1f} s"
        error = resp.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], label
        assert not any(m in error["message"] for m in ("Error(", "Traceback", "object at 0x")), label
        return
    assert 200 <= resp.status_code < 300 and seconds < ANSWER_BOUND_S, label
    if resp.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", label
        assert not any('"error"' in e[:12] for e in events), label
    else:
        assert resp.json()["choices"], label


def _check_health(srv: LiveServer, canary: Canary) -> None:
    assert httpx.get(srv.base_url + "/health", timeout=10).status_code == 200
    assert not canary.errors, canary.errors
    assert canary.thread.is_alive()


FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES,
    derandomize=PROFILE == "ci",
    database=None,
    deadline=None,
    print_blob=True,
    suppress_health_check=list(HealthCheck),
)


def test_fuzz_completions(fuzz_server):
    srv, canary, client = fuzz_server

    @FUZZ_SETTINGS
    @given(bodies(COMPLETION_FIELDS, "prompt"))
    def run(case):
        check_answer(client, C, *case)
        _check_health(srv, canary)

    run()


def test_fuzz_chat(fuzz_server):
    srv, canary, client = fuzz_server

    @FUZZ_SETTINGS
    @given(bodies(CHAT_FIELDS, "messages"))
    def run(case):
        check_answer(client, CHAT, *case)
        _check_health(srv, canary)

    run()


def test_canary_unharmed_and_every_block_free(fuzz_server):
    srv, canary, _ = fuzz_server
    canary.stop()
    assert not canary.errors, canary.errors
    assert len(canary.texts) >= 5 and all(t == canary.solo for t in canary.texts), (
        f"{sum(t != canary.solo for t in canary.texts)} of {len(canary.texts)} canary runs differ from the solo run"
    )
    stats = srv.wait_idle()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert srv.state.engine.num_step_failures == 0 and srv.state.engine.is_running
    print(
        f"\nfuzz profile {PROFILE}: {EXAMPLES} examples per endpoint, statuses {dict(sorted(STATUSES.items()))}, "
        f"{len(canary.texts)} canary runs, all equal to the solo run; every KV block free"
    )
    assert STATUSES.get(200, 0) >= EXAMPLES // 20 and sum(n for s, n in STATUSES.items() if s >= 400) >= EXAMPLES // 2
