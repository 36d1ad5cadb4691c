"""use_beam_search through the OpenAI server (engine core in its own process): completions and chat return
the offline LLM.beam_search beams (which tests/runtime/test_beam_search.py checks against HF), best first,
one choice per beam; what beam search cannot combine with is a 400 naming the field."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import LiveServer

ENGINE = dict(max_model_len=128, num_kv_blocks=256, block_size=8, seed=0)
PROMPT = [5, 17, 33, 2, 8, 11, 40]


@pytest.fixture(scope="module")
def beam_setup(tmp_path_factory):
    from kvserve_testing import TEST_MODEL_CONFIGS

    from kvserve.runtime.engine.core_client import CoreClient
    from kvserve.runtime.models.synthetic import make_random_model_dir

    arch, kwargs = TEST_MODEL_CONFIGS["llama_gqa"]
    model_dir = str(tmp_path_factory.mktemp("beam-api"))
    make_random_model_dir(model_dir, arch, seed=1234, **kwargs)
    srv = LiveServer(CoreClient.from_kwargs(model_dir, **ENGINE), model_dir=model_dir, random_weights=True)
    yield srv, model_dir
    srv.stop()


def test_completions_and_chat_return_the_offline_beams(beam_setup):
    from kvserve.runtime import LLM
    from kvserve.runtime.engine.beam_search import BeamSearchParams

    srv, model_dir = beam_setup
    llm = LLM(model_dir, **ENGINE)
    params = BeamSearchParams(beam_width=3, max_tokens=8, early_stopping=True, length_penalty=0.5)
    (expected,) = llm.beam_search([{"prompt_token_ids": PROMPT}], params)
    with httpx.Client(base_url=srv.base_url, timeout=60) as client:
        body = {"prompt": PROMPT, "max_tokens": 8, "n": 3, "use_beam_search": True, "length_penalty": 0.5}
        r = client.post("/v1/completions", json={**body, "early_stopping": True})
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
        assert [c["text"] for c in choices] == [s.text for s in expected.sequences]
        assert [c["index"] for c in choices] == [0, 1, 2]
        assert r.json()["usage"]["completion_tokens"] == sum(len(s.output_token_ids) for s in expected.sequences)

        chat = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 6, "n": 2}
        r = client.post("/v1/chat/completions", json={**chat, "use_beam_search": True})
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"]) == 2 and r.json()["choices"][0]["message"]["role"] == "assistant"

        for extra, param in (
            ({"stream": True}, "stream"),
            ({"temperature": 0.7}, "temperature"),
            ({"logprobs": 2}, "logprobs"),
            ({"n": 11}, "n"),
            ({"early_stopping": "sometimes"}, "early_stopping"),
        ):
            r = client.post("/v1/completions", json={**body, **extra})
            assert r.status_code == 400, (extra, r.text)
            error = r.json()["error"]
            assert param in (error.get("param") or "") + error["message"], (extra, error)
