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
    return chat_prompts_of_lengths(tokenizer, [prompt_len] * num_prompts, seed)


def chat_prompts_of_lengths(tokenizer, prompt_lens: list[int], seed: int = 0) -> list[list[int]]:
    """One prompt per entry of `prompt_lens`, of exactly that many token ids (as chat_prompt_ids)."""
    from kvserve.runtime.tokenizer import chat_template

    passages = _passages()
    rng = random.Random(seed)
    template = chat_template(tokenizer)
    prompts = []
    for prompt_len in prompt_lens:
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


# ---- a pool of templated real-text prompts, for clients that draw many lengths (kvserve bench serve) ---------
POOL_SIZE = 32  # distinct starting passages: prompts share at most the template header and one passage


def pool_contents(min_chars: int, seed: int = 0, size: int = POOL_SIZE) -> list[str]:
    """User-turn texts of at least `min_chars` characters, each starting at its own passage of the corpus."""
    passages = _passages()
    starts = random.Random(seed).sample(range(len(passages)), min(size, len(passages)))
    contents = []
    for start in starts:
        parts, chars = [], 0
        while chars < min_chars:
            parts.append(passages[(start + len(parts)) % len(passages)])
            chars += len(parts[-1]) + 1
        contents.append("\n".join(parts) + "\n")
    return contents


class TextPool:
    """Chat-templated real-text token ids, one entry per starting passage, each at least `max_len` long.
    `prompt` draws a whole prompt (the template's header first), `piece` a run of text from inside one (the
    unique suffix after a shared prefix)."""

    def __init__(self, entries: list[list[int]], max_len: int):
        short = min(len(e) for e in entries)
        if short < max_len:
            raise ValueError(f"text pool entries hold {short} tokens, fewer than the {max_len} asked for")
        self.entries = entries

    def prompt(self, rng, n: int) -> list[int]:
        return self.entries[rng.randrange(len(self.entries))][:n]

    def piece(self, rng, n: int) -> list[int]:
        entry = self.entries[rng.randrange(len(self.entries))]
        start = rng.randrange(len(entry) - n + 1)
        return entry[start : start + n]


def chars_for(max_len: int) -> int:
    """A first guess at the characters that make max_len tokens (English BPE: ~4 characters a token)."""
    return 6 * max_len + 200


def local_pool(tokenizer, max_len: int, seed: int = 0) -> TextPool:
    """The pool tokenized here, with the model's chat template (as a server's /tokenize with messages does)."""
    from kvserve.runtime.tokenizer import chat_template

    template = chat_template(tokenizer)
    min_chars = chars_for(max_len)
    while True:
        entries = []
        for content in pool_contents(min_chars, seed):
            rendered = tokenizer.apply_chat_template(
                [{"role": "user", "content": content}],
                chat_template=template,
                add_generation_prompt=True,
                tokenize=False,
            )
            entries.append(tokenizer(rendered, add_special_tokens=False)["input_ids"])
        if min(len(e) for e in entries) >= max_len:
            return TextPool(entries, max_len)
        min_chars *= 2
