"""Greedy tokens from the LM head (runtime/models/greedy_head.py) against full logits, in one process, interleaved:
fp32: the full fp32 head + argmax against the bf16 screen; bf16: the head's output widened to fp32 + argmax (the
path before) against the argmax over the bf16 output. Best of --rounds per path, ms per call; checks the tokens agree.

    taskset -c 0,1 .venv/bin/python tools/greedy_head_ab.py [--threads 2] [--rows 24 128] [--rounds 20]

The head is SmolLM2-135M-Instruct's tied embedding (49,152 x 576) when the default model is cached
(runtime/bench/real_model.py), else random weights of that shape; hidden states are random rows scaled to the
norm of SmolLM2's final hidden states (~46). Random directions give flatter logits than a real decode step's, so
the screen keeps more candidates here than in the engine: its times are an upper bound.
"""

from __future__ import annotations

import argparse
import time

import torch


def head_weight() -> tuple[torch.Tensor, str]:
    try:
        from safetensors.torch import load_file

        from kvserve.runtime.bench import real_model

        weights = load_file(f"{real_model.hf_dir('float32')}/model.safetensors")
        return weights["model.embed_tokens.weight"].float().contiguous(), "SmolLM2's tied head"
    except Exception as e:  # noqa: BLE001 -- no cached model and no index: random weights of the same shape
        return torch.randn(49152, 576) * 0.05, f"random weights ({type(e).__name__})"


def best_ms(fn, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def make_paths(hidden: torch.Tensor, head32, head16, screen) -> dict:
    """head32 / head16: the head as the engine runs it without the greedy head (models/cpu_linear.py's packing)."""
    from kvserve.runtime.models.cpu_linear import linear

    ops = torch.ops.kvserve_cpu
    h16 = hidden.bfloat16()
    return {
        "fp32 full": lambda: ops.greedy_argmax(linear(hidden, head32, None)),
        "fp32 screen": lambda: screen.tokens(hidden),
        "bf16 .float()": lambda: ops.greedy_argmax(linear(h16, head16, None).float()),
        "bf16 direct": lambda: ops.greedy_argmax(linear(h16, head16, None)),
    }


def packed_head(weight: torch.Tensor) -> torch.nn.Module:
    from kvserve.runtime.models.cpu_linear import pack_weight

    head = torch.nn.Module()
    head.weight = torch.nn.Parameter(weight, requires_grad=False)
    pack_weight(head, head.weight, free_original=True)
    return head


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[24, 128])
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    from kvserve.kernels import cpu_ops

    if not cpu_ops.load():
        raise SystemExit(cpu_ops.describe())
    from kvserve.runtime.models.greedy_head import ScreenedGreedyHead

    torch.set_num_threads(args.threads)
    weight, what = head_weight()
    screen = ScreenedGreedyHead(weight)
    head32, head16 = packed_head(weight), packed_head(weight.bfloat16())
    print(f"head {tuple(weight.shape)} ({what}), {args.threads} thread(s), best of {args.rounds}")
    for rows in args.rows:
        hidden = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(rows))
        hidden *= 46.0 / hidden.norm(dim=1, keepdim=True)
        paths = make_paths(hidden, head32, head16, screen)
        assert torch.equal(paths["fp32 full"](), paths["fp32 screen"]())
        assert torch.equal(paths["bf16 .float()"](), paths["bf16 direct"]())
        times = {name: float("inf") for name in paths}
        for i in range(args.rounds):
            for name in paths if i % 2 else reversed(list(paths)):
                times[name] = min(times[name], best_ms(paths[name], 1))
        print(f"  {rows:4d} rows: " + "   ".join(f"{name} {ms:6.2f} ms" for name, ms in times.items()))


if __name__ == "__main__":
    main()
