"""Incremental detokenisation gives exactly the text of a full decode, token by token, on three kinds of
tokenizer: sentencepiece-style BPE with byte fallback (stories260K), byte-level BPE (the demo model) and
word-level (the synthetic test models)."""

from __future__ import annotations

import random

import pytest
from kvserve_testing import STORIES_DIR

from kvserve.runtime.core.outputs import EngineCoreOutput
from kvserve.runtime.engine.output_processor import OutputProcessor, RequestState
from kvserve.runtime.sampling_params import SamplingParams

STORIES = str(STORIES_DIR)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    from transformers import AutoTokenizer

    from kvserve.runtime.demo_model import ensure_demo_model
    from kvserve.runtime.models.synthetic import write_word_tokenizer

    word_dir = str(tmp_path_factory.mktemp("wordtok"))
    write_word_tokenizer(word_dir, 300)
    toks = {
        "word-level": AutoTokenizer.from_pretrained(word_dir),
        "byte-level BPE": AutoTokenizer.from_pretrained(ensure_demo_model(tmp_path_factory.mktemp("demo"))),
    }
    toks["sentencepiece BPE"] = AutoTokenizer.from_pretrained(STORIES)
    return toks


def _byte_fallback_ids(tok) -> set[int]:
    return {i for t, i in tok.get_vocab().items() if len(t) == 6 and t.startswith("<0x") and t.endswith(">")}


@pytest.mark.parametrize("skip_special", [True, False])
@pytest.mark.parametrize("with_byte_tokens", [False, True])
def test_incremental_equals_full_decode(tokenizers, skip_special, with_byte_tokens):
    """With byte-fallback tokens (<0xNN>) drawn at random, a later invalid byte can turn an earlier byte
    run into U+FFFD in the full decode, so no streaming detokenizer can keep what it released; there only
    the final text is checked."""
    rng = random.Random(0)
    for name, tok in tokenizers.items():
        byte_ids = _byte_fallback_ids(tok)
        if with_byte_tokens and not byte_ids:
            continue
        allowed = list(range(len(tok))) if with_byte_tokens else [i for i in range(len(tok)) if i not in byte_ids]
        for _ in range(20):
            ids = [rng.choice(allowed) for _ in range(rng.randint(1, 60))]
            proc = OutputProcessor(tok)
            state = RequestState("r", None, [1], SamplingParams(skip_special_tokens=skip_special), ["r#0"], 0.0)
            for i, token in enumerate(ids):
                last = i == len(ids) - 1
                proc.process(state, 0, EngineCoreOutput("r#0", [token], None, "length" if last else None))
                released = state.samples[0].text
                full = tok.decode(ids[: i + 1], skip_special_tokens=skip_special)
                # While running, the released text is a prefix of the full decode (an incomplete UTF-8
                # character may still be held back).
                assert last or with_byte_tokens or full.startswith(released), (name, ids[: i + 1], released, full)
            assert state.samples[0].text == tok.decode(ids, skip_special_tokens=skip_special), (name, ids)


def test_fast_decode_equals_transformers_decode(tokenizers):
    """The detokeniser calls the Rust tokenizer directly where that is exactly transformers' decode; on every
    tokenizer here (and on one with clean_up_tokenization_spaces, which must keep transformers' path) the
    two agree on random windows, special tokens included."""
    from kvserve.runtime.tokenizer import fast_decode

    rng = random.Random(0)
    for name, tok in tokenizers.items():
        decode = fast_decode(tok)
        vocab = len(tok)
        for _ in range(300):
            ids = [rng.randrange(vocab) for _ in range(rng.randint(0, 8))]
            for skip in (True, False):
                assert decode(ids, skip) == tok.decode(ids, skip_special_tokens=skip), (name, ids, skip)
    assert fast_decode(tokenizers["byte-level BPE"]).__name__ == "fast"  # the demo model takes the fast path
    tok = tokenizers["word-level"]
    original = tok.clean_up_tokenization_spaces
    tok.clean_up_tokenization_spaces = True
    try:
        assert fast_decode(tok).__name__ == "slow"
    finally:
        tok.clean_up_tokenization_spaces = original
