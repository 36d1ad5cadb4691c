"""Parse a replica's /v1/models into the model names it serves, base models and LoRA adapters apart. Pure.

vLLM and kvserve list an adapter as a model card whose `parent` is the base model's name (a base card's
`parent` is null), so the card says which names are adapters -- also an adapter that no request has used yet,
which `vllm:lora_requests_info` cannot show -- and which replicas serve each one: an adapter loaded at run time
through `/v1/load_lora_adapter` exists on the replicas it was loaded on only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ReplicaModels:
    bases: frozenset[str] = frozenset()
    adapters: frozenset[str] = frozenset()


def parse_models(body: Any) -> ReplicaModels:
    """`body`: the decoded JSON of GET /v1/models. ValueError when it is not an OpenAI model list."""
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        raise ValueError("/v1/models: no 'data' list")
    bases, adapters = set(), set()
    for card in data:
        name = card.get("id") if isinstance(card, dict) else None
        if not isinstance(name, str) or not name:
            raise ValueError(f"/v1/models: a card without an 'id': {card!r}")
        (adapters if card.get("parent") else bases).add(name)
    return ReplicaModels(frozenset(bases), frozenset(adapters))
