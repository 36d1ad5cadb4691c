"""The planner accuracy grid's configurations (issue 44 scope 1): which model shapes are served, and which
workloads each replica is measured and predicted under. Pure data and request builders (no torch): the runner
is planner_grid.py.

Sized for 2 CPU cores: every model is small (the real SmolLM2-135M and random shapes of a few million
parameters), every workload a few dozen requests of a few output tokens, so the 27 configurations, five servers
and their calibrations take about a quarter of an hour (docs/planner.md, "The accuracy grid").
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvserve.runtime import engine_args
from kvserve.runtime.bench.planner_accuracy import Case

# A small random shape's common fields: vocabularies of 8k keep the LM head (a large share of a small model's
# step) realistic against the layers without making the checkpoint large.
_SMALL = dict(vocab_size=8192, max_position_embeddings=2048, initializer_range=0.02)


@dataclass(frozen=True)
class ServedModel:
    """One served replica of the grid: a model (the real default, or a random shape) at a tensor-parallel size.
    Each is calibrated once, through its own server, and every configuration on it is predicted from that."""

    name: str
    architecture: str | None  # None: the real default model (SmolLM2-135M-Instruct, float32)
    config: tuple[tuple[str, object], ...] = ()  # HF config fields of a random shape
    tensor_parallel_size: int = engine_args.default("tensor_parallel_size")


MODELS = (
    ServedModel("smollm2-135m", None),
    ServedModel(
        "llama-25m",
        "LlamaForCausalLM",
        tuple(
            dict(
                _SMALL,
                hidden_size=512,
                num_hidden_layers=6,
                num_attention_heads=8,
                num_key_value_heads=4,
                intermediate_size=1536,
            ).items()
        ),
    ),
    ServedModel(
        "qwen3-moe-8x",
        "Qwen3MoeForCausalLM",
        tuple(
            dict(
                _SMALL,
                hidden_size=256,
                num_hidden_layers=4,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=64,
                intermediate_size=768,
                moe_intermediate_size=256,
                num_experts=8,
                num_experts_per_tok=2,
            ).items()
        ),
    ),
    ServedModel(
        "gemma2-swa128",
        "Gemma2ForCausalLM",
        tuple(
            dict(
                _SMALL,
                hidden_size=384,
                num_hidden_layers=6,
                num_attention_heads=6,
                num_key_value_heads=2,
                head_dim=64,
                intermediate_size=1024,
                sliding_window=128,
                query_pre_attn_scalar=64,
            ).items()
        ),
    ),
    ServedModel("llama-25m-tp2", "LlamaForCausalLM", (), tensor_parallel_size=2),  # config: llama-25m's
)


def model_config(model: ServedModel) -> dict:
    """The HF config fields of a random shape (a TP variant shares its base model's)."""
    if model.config or model.architecture is None:
        return dict(model.config)
    base = model.name.rsplit("-tp", 1)[0]
    return dict(next(m for m in MODELS if m.name == base).config)


@dataclass(frozen=True)
class GridConfig:
    """One row of the grid: a workload (planner_accuracy.Case) on a served model. `turns` > 1: multi-turn
    conversations (multi_turn_requests), `case.concurrency` of them at once."""

    model: str
    case: Case
    turns: int = 0

    @property
    def name(self) -> str:
        return f"{self.model}/{self.case.name}"


def _configs() -> tuple[GridConfig, ...]:
    c = Case
    smol = (
        c("closed-1", 64, 8, 4, concurrency=1),
        c("closed-8", 64, 4, 24, concurrency=8, ramp_s=0.25, output_len_max=12),
        c("closed-32", 32, 4, 64, concurrency=32, ramp_s=0.5, output_len_max=12),
        c("poisson-30%", 64, 8, 32, load=0.3),
        c("poisson-60%", 64, 8, 32, load=0.6),
        c("poisson-90%", 64, 8, 40, load=0.9),
        c("long-prompt-1", 900, 8, 3, concurrency=1),
        c("long-poisson-50%", 600, 8, 12, load=0.5),
        c("shared-prefix-4", 288, 4, 16, concurrency=4, prefix_len=256, ramp_s=0.25, output_len_max=12),
    )
    llama = (
        c("closed-1", 64, 16, 4, concurrency=1),
        c("closed-16", 64, 8, 48, concurrency=16, ramp_s=0.25, output_len_max=16),
        c("poisson-50%", 128, 16, 40, load=0.5),
        c("poisson-80%", 128, 16, 48, load=0.8),
        c("long-prompt-2", 900, 8, 6, concurrency=2, ramp_s=0.1),
    )
    moe = (
        c("closed-1", 64, 16, 4, concurrency=1),
        c("closed-16", 64, 8, 48, concurrency=16, ramp_s=0.25, output_len_max=16),
        c("poisson-60%", 128, 16, 40, load=0.6),
        c("shared-prefix-8", 320, 8, 24, concurrency=8, prefix_len=256, ramp_s=0.25, output_len_max=16),
    )
    swa = (
        c("closed-1", 64, 16, 4, concurrency=1),
        c("closed-16", 64, 8, 48, concurrency=16, ramp_s=0.25, output_len_max=16),
        c("poisson-60%", 256, 16, 32, load=0.6),
        c("long-prompt-1", 900, 16, 3, concurrency=1),
    )
    tp2 = (
        c("closed-1", 64, 16, 4, concurrency=1),
        c("closed-16", 64, 8, 48, concurrency=16, ramp_s=0.25, output_len_max=16),
        c("poisson-50%", 128, 16, 32, load=0.5),
    )
    rows = [GridConfig("smollm2-135m", case) for case in smol]
    rows.append(GridConfig("smollm2-135m", c("multi-turn-4x3", 96, 8, 12, concurrency=4, ramp_s=0.2), turns=3))
    rows += [GridConfig("llama-25m", case) for case in llama]
    rows.append(GridConfig("llama-25m", c("multi-turn-8x3", 128, 8, 24, concurrency=8, ramp_s=0.2), turns=3))
    rows += [GridConfig("qwen3-moe-8x", case) for case in moe]
    rows += [GridConfig("gemma2-swa128", case) for case in swa]
    rows += [GridConfig("llama-25m-tp2", case) for case in tp2]
    return tuple(rows)


CONFIGS = _configs()
# `--quick`: one model, three shapes of load (a closed loop, Poisson near saturation, shared prefixes), for a
# development run of a minute or two.
QUICK = ("llama-25m/closed-16", "llama-25m/poisson-80%", "llama-25m/multi-turn-8x3")


def select(names: str | None, quick: bool = False) -> tuple[GridConfig, ...]:
    """The configurations named (comma-separated; a bare model name selects all of its rows), QUICK's with
    `quick`, else all. Raises ValueError naming --configs for a name that matches nothing."""
    if quick:
        names = ",".join(QUICK)
    if not names:
        return CONFIGS
    out: list[GridConfig] = []
    for name in (n.strip() for n in names.split(",") if n.strip()):
        got = [g for g in CONFIGS if name in (g.name, g.model)]
        if not got:
            known = sorted({g.model for g in CONFIGS})
            raise ValueError(f"--configs: no configuration {name!r} (models: {', '.join(known)}; or MODEL/WORKLOAD)")
        out += [g for g in got if g not in out]
    return tuple(out)


def multi_turn_requests(config: GridConfig, rng: random.Random, vocab: int) -> list[tuple[None, list[int], int]]:
    """`concurrency` conversations of `turns` turns, in turn order (every conversation's first turn, then every
    second turn, ...): a turn's prompt is the previous turn's prompt, an answer of the previous turn's output
    length (random ids standing in for it: the client never sees token ids) and a new user message of
    prompt_len // turns ids; the first turn is prompt_len // turns ids. Each turn thus finds the previous turn's
    prompt in the prefix cache once it was computed, as a chat does. A closed loop of `concurrency` streams sends
    them (a free stream takes the next), so a turn is sent about when its conversation's previous turn ends."""
    case = config.case
    convs = case.concurrency or 1
    user = max(1, case.prompt_len // config.turns)

    def ids(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    def olen() -> int:
        return rng.randint(case.output_len, case.output_len_max) if case.output_len_max else case.output_len

    history = [ids(user) for _ in range(convs)]
    last_out = [0] * convs
    out = []
    for turn in range(config.turns):
        for k in range(convs):
            if turn:
                history[k] = history[k] + ids(last_out[k]) + ids(user)
            last_out[k] = olen()
            out.append((None, list(history[k]), last_out[k]))
    return out
