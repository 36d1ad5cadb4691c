"""The official openai client against a live server: completions and chat, streaming or not, n=2, stop
strings, logprobs, usage. Greedy texts must equal the offline engine's for the same request."""

from __future__ import annotations

import httpx
import pytest

from kvserve.runtime import SamplingParams

pytestmark = pytest.mark.timeout(120)

PROMPTS = ["The harbour town woke slowly.", "A small robot lived in the lighthouse", "Numbers: one, two, three"]


def offline_text(offline_llm, prompt, **params):
    (out,) = offline_llm.generate([prompt], SamplingParams(**params))
    return out


def chat_prompt(offline_llm, messages):
    return offline_llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_models_says_random_weights(server):
    models = server.openai().models.list()
    (model,) = models.data
    assert model.id == server.model
    extra = model.model_extra
    assert extra["random_weights"] is True and "RANDOM" in extra["description"]
    assert extra["max_model_len"] == 2048


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_matches_offline(server, offline_llm, prompt):
    resp = server.openai().completions.create(model=server.model, prompt=prompt, max_tokens=24, temperature=0)
    expected = offline_text(offline_llm, prompt, temperature=0, max_tokens=24)
    choice = resp.choices[0]
    assert choice.text == expected.outputs[0].text
    assert choice.finish_reason == expected.outputs[0].finish_reason
    assert resp.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert resp.usage.completion_tokens == len(expected.outputs[0].token_ids)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_streaming_completion_matches_offline(server, offline_llm):
    prompt = PROMPTS[0]
    stream = server.openai().completions.create(
        model=server.model,
        prompt=prompt,
        max_tokens=32,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    expected = offline_text(offline_llm, prompt, temperature=0, max_tokens=32)
    assert text == expected.outputs[0].text
    assert len([c for c in chunks if c.choices]) >= 2  # really streamed, not one blob
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [expected.outputs[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected.outputs[0].token_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_matches_offline_streaming_and_not(server, offline_llm):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me about bread."}]
    client = server.openai()
    resp = client.chat.completions.create(model=server.model, messages=messages, max_tokens=20, temperature=0)
    prompt_ids = offline_llm.tokenizer.encode(chat_prompt(offline_llm, messages), add_special_tokens=False)
    expected = offline_text(offline_llm, prompt_ids, temperature=0, max_tokens=20)
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == expected.outputs[0].text
    assert resp.usage.prompt_tokens == len(prompt_ids)
    assert resp.usage.completion_tokens == len(expected.outputs[0].token_ids)

    stream = client.chat.completions.create(
        model=server.model,
        messages=messages,
        max_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.outputs[0].text
    assert chunks[-1].usage.prompt_tokens == len(prompt_ids)


def test_n2_with_seed_matches_offline(server, offline_llm):
    prompt = PROMPTS[1]
    resp = server.openai().completions.create(
        model=server.model, prompt=prompt, max_tokens=16, temperature=1.0, n=2, seed=1234
    )
    expected = offline_text(offline_llm, prompt, temperature=1.0, max_tokens=16, n=2, seed=1234)
    assert [c.index for c in resp.choices] == [0, 1]
    assert [c.text for c in resp.choices] == [o.text for o in expected.outputs]
    assert resp.usage.completion_tokens == sum(len(o.token_ids) for o in expected.outputs)
    # streaming n=2: both choices arrive, interleaved by index
    stream = server.openai().completions.create(
        model=server.model, prompt=prompt, max_tokens=16, temperature=1.0, n=2, seed=1234, stream=True
    )
    texts = {0: "", 1: ""}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert [texts[0], texts[1]] == [o.text for o in expected.outputs]


def test_chat_n2(server):
    resp = server.openai().chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "hi"}], max_tokens=8, n=2, temperature=0.9, seed=7
    )
    assert sorted(c.index for c in resp.choices) == [0, 1]


def test_stop_string_truncates_like_offline(server, offline_llm):
    prompt = PROMPTS[2]
    full = offline_text(offline_llm, prompt, temperature=0, max_tokens=32).outputs[0].text
    stop = next(
        full[i : i + 2] for i in range(4, len(full) - 2) if full[i : i + 2].strip() and "\ufffd" not in full[i : i + 2]
    )
    expected = offline_text(offline_llm, prompt, temperature=0, max_tokens=32, stop=[stop])
    client = server.openai()
    resp = client.completions.create(model=server.model, prompt=prompt, max_tokens=32, temperature=0, stop=[stop])
    assert resp.choices[0].text == expected.outputs[0].text == full[: full.index(stop)]
    assert resp.choices[0].finish_reason == "stop"
    assert resp.choices[0].model_extra["stop_reason"] == stop
    stream = client.completions.create(
        model=server.model, prompt=prompt, max_tokens=32, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == expected.outputs[0].text


def test_completion_logprobs(server, offline_llm):
    prompt = PROMPTS[0]
    resp = server.openai().completions.create(
        model=server.model, prompt=prompt, max_tokens=8, temperature=0, logprobs=3
    )
    lp = resp.choices[0].logprobs
    expected = offline_text(offline_llm, prompt, temperature=0, max_tokens=8, logprobs=3).outputs[0]
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(expected.token_ids) == 8
    for i, (tid, entry) in enumerate(zip(expected.token_ids, expected.logprobs)):
        assert lp.token_logprobs[i] == pytest.approx(entry[tid].logprob, abs=1e-4)
        assert lp.tokens[i] == entry[tid].decoded_token
        # keyed by text (OpenAI's legacy shape): distinct ids that decode alike share a key
        assert set(lp.top_logprobs[i]) == {e.decoded_token for e in entry.values()}
        assert max(lp.top_logprobs[i].values()) == pytest.approx(lp.token_logprobs[i], abs=1e-4)  # greedy
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_chat_logprobs_streaming_and_not(server):
    client = server.openai()
    kwargs = dict(
        model=server.model,
        messages=[{"role": "user", "content": "Why is the sky blue?"}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    resp = client.chat.completions.create(**kwargs)
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens == 6
    for item in content:
        assert len(item.top_logprobs) == 2
        assert item.logprob <= 0 and item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.top_logprobs[0].token == item.token  # greedy picks the top one
    streamed = [
        lp
        for chunk in client.chat.completions.create(**kwargs, stream=True)
        if chunk.choices and chunk.choices[0].logprobs
        for lp in chunk.choices[0].logprobs.content
    ]
    assert [x.token for x in streamed] == [x.token for x in content]
    assert [x.logprob for x in streamed] == pytest.approx([x.logprob for x in content], abs=1e-3)


def test_extra_sampling_params_and_token_prompts(server, offline_llm):
    ids = offline_llm.tokenizer.encode(PROMPTS[0])
    client = server.openai()
    resp = client.completions.create(
        model=server.model,
        prompt=ids,
        max_tokens=12,
        temperature=0.8,
        seed=3,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.2, "ignore_eos": True, "min_tokens": 12},
    )
    assert resp.usage.completion_tokens == 12 and resp.usage.prompt_tokens == len(ids)
    expected = offline_text(
        offline_llm,
        ids,
        temperature=0.8,
        seed=3,
        max_tokens=12,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        top_k=20,
        min_p=0.05,
        repetition_penalty=1.2,
        ignore_eos=True,
        min_tokens=12,
    )
    assert resp.choices[0].text == expected.outputs[0].text
    # a batch of prompts: choices indexed prompt-major
    batch = client.completions.create(model=server.model, prompt=PROMPTS[:2], max_tokens=5, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[1].text == offline_text(offline_llm, PROMPTS[1], temperature=0, max_tokens=5).outputs[0].text


def test_echo(server, offline_llm):
    resp = server.openai().completions.create(
        model=server.model, prompt=PROMPTS[0], max_tokens=4, temperature=0, echo=True
    )
    assert resp.choices[0].text.startswith(PROMPTS[0])


def test_tokenize_detokenize_and_health(server, offline_llm):
    ids = httpx.post(server.base_url + "/tokenize", json={"prompt": "hello harbour"}).json()
    assert ids["tokens"] == offline_llm.tokenizer.encode("hello harbour") and ids["count"] == len(ids["tokens"])
    text = httpx.post(server.base_url + "/detokenize", json={"tokens": ids["tokens"]}).json()
    assert text["prompt"] == "hello harbour"
    chat = httpx.post(server.base_url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 3
    assert httpx.get(server.base_url + "/health").status_code == 200
