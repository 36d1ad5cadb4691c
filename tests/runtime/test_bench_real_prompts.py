"""Real-text benchmark prompts (runtime/bench/real_prompts.py): exact lengths, the model's chat template, distinct
from their first tokens on, deterministic per seed."""

from __future__ import annotations


def test_chat_prompts_are_templated_real_text(tmp_path):
    from kvserve.runtime.bench.real_prompts import chat_prompt_ids
    from kvserve.runtime.demo_model import ensure_demo_model
    from kvserve.runtime.tokenizer import load_tokenizer

    tok = load_tokenizer(str(ensure_demo_model(tmp_path)))  # ChatML template, byte-level BPE
    prompts = chat_prompt_ids(tok, num_prompts=8, prompt_len=96, seed=1)
    assert [len(p) for p in prompts] == [96] * 8
    assert chat_prompt_ids(tok, 8, 96, seed=1) == prompts
    texts = [tok.decode(p) for p in prompts]
    assert all(t.startswith("<|im_start|>user\n") for t in texts)
    assert len({p[:12] for p in map(tuple, prompts)}) >= 5, "prompts should differ right after the template header"
    assert any(word in " ".join(texts) for word in ("lighthouse", "harbour", "sunflowers", "clock"))


def test_lengths_and_the_text_pool(tmp_path):
    import random

    from kvserve.runtime.bench.real_prompts import chat_prompt_ids, chat_prompts_of_lengths, local_pool
    from kvserve.runtime.demo_model import ensure_demo_model
    from kvserve.runtime.tokenizer import load_tokenizer

    tok = load_tokenizer(str(ensure_demo_model(tmp_path)))
    prompts = chat_prompts_of_lengths(tok, [20, 96, 5], seed=1)
    assert [len(p) for p in prompts] == [20, 96, 5]
    assert prompts[1] == chat_prompt_ids(tok, 2, 96, seed=1)[1]  # one rng stream: the same draws as equal lengths

    pool = local_pool(tok, max_len=600, seed=0)
    assert min(len(e) for e in pool.entries) >= 600 and len(pool.entries) >= 5
    rng = random.Random(0)
    whole, piece = pool.prompt(rng, 600), pool.piece(rng, 50)
    assert len(whole) == 600 and len(piece) == 50
    assert tok.decode(whole).startswith("<|im_start|>user\n")
    assert any(piece == e[i : i + 50] for e in pool.entries for i in range(len(e) - 49))
