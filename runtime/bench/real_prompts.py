"""Real-text, chat-templated benchmark prompts (issue 39: benchmarks on real weights and real text).

Random token ids make a model's attention and activations unlike a real workload's (and on random weights they
hid a 2x subnormal slowdown). The text here is the original corpus that ships in the repository
(runtime/demo_model.CORPUS: stories, questions and answers, a little code and JSON); each prompt is one user turn
through the model's own chat template, its passages rotated per request so that prompts differ from their first
tokens on (no accidental prefix sharing), cut to the requested token count.
"""

from __future__ import annotations

import random


def _passages() -> list[str]:
    from kvserve.runtime.demo_model import CORPUS

    return [p.strip() for p in CORPUS.split("\n") if p.strip()]


def chat_prompt_ids(tokenizer, num_prompts: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    """`num_prompts` prompts of exactly `prompt_len` token ids: a user turn of real text in the model's chat
    template (the generic template of runtime/tokenizer.py where the model has none), truncated."""
    from kvserve.runtime.tokenizer import chat_template

    passages = _passages()
    rng = random.Random(seed)
    template = chat_template(tokenizer)
    prompts = []
    for _ in range(num_prompts):
        start = rng.randrange(len(passages))
        text, ids = "", []
        while len(ids) < prompt_len:  # grow the user turn until the templated prompt is long enough
            text += passages[(start + len(text.split("\n")) - 1) % len(passages)] + "\n"
            turn = [{"role": "user", "content": text}]
            rendered = tokenizer.apply_chat_template(
                turn, chat_template=template, add_generation_prompt=True, tokenize=False
            )
            ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
        prompts.append(ids[:prompt_len])
    return prompts
