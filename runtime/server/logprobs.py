"""Logprobs in OpenAI's two shapes (completions: parallel lists; chat: a content list with top_logprobs), from
the engine's per-token {token id: Logprob} dicts."""

from __future__ import annotations

from typing import Any


class LogprobFormatter:
    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def token_text(self, token_id: int, logprob_entry: Any) -> str:
        decoded = getattr(logprob_entry, "decoded_token", None)
        if decoded is None:
            decoded = self.tokenizer.decode([token_id])
        return decoded

    def _entries(self, logprob_dict: dict) -> list[tuple[int, Any]]:
        return sorted(logprob_dict.items(), key=lambda kv: (getattr(kv[1], "rank", 0) or 0, -kv[1].logprob))

    def completion_logprobs(self, token_ids: list[int], logprobs: list[dict], offset: int) -> dict[str, Any]:
        tokens, token_logprobs, top, offsets = [], [], [], []
        for token_id, entry in zip(token_ids, logprobs):
            sampled = entry.get(token_id)
            text = self.token_text(token_id, sampled)
            tokens.append(text)
            token_logprobs.append(None if sampled is None else finite(sampled.logprob))
            top_entry: dict[str, float] = {}
            for t, lp in self._entries(entry):  # best first; distinct ids may decode alike: keep the better
                top_entry.setdefault(self.token_text(t, lp), finite(lp.logprob))
            top.append(top_entry)
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}

    def chat_logprobs(self, token_ids: list[int], logprobs: list[dict], top_n: int) -> dict[str, Any]:
        content = []
        for token_id, entry in zip(token_ids, logprobs):
            sampled = entry.get(token_id)
            text = self.token_text(token_id, sampled)
            tops = [
                {
                    "token": (s := self.token_text(t, lp)),
                    "logprob": finite(lp.logprob),
                    "bytes": list(s.encode("utf-8")),
                }
                for t, lp in self._entries(entry)[:top_n]
            ]
            content.append(
                {
                    "token": text,
                    "logprob": None if sampled is None else finite(sampled.logprob),
                    "bytes": list(text.encode("utf-8")),
                    "top_logprobs": tops,
                }
            )
        return {"content": content, "refusal": None}


def finite(value: float) -> float:
    # JSON has no -inf; OpenAI clients expect numbers. -9999.0 is what OpenAI itself returns for "impossible".
    return value if value > -1e30 else -9999.0
