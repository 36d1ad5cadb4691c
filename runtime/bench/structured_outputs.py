"""Per-step cost of grammar-constrained decoding at 64 constrained sequences.

Runs the same 64-request greedy batch twice on one engine -- free text, then every request under a JSON
schema -- and times, inside the sampler, the bitmask fill + apply for the constrained rows and the matcher
advance (what structured outputs add to a step). Prints ms per step for each and the share of the step.

    .venv/bin/python runtime/bench/structured_outputs.py [MODEL_DIR]      (default examples/models/stories260K)
"""

from __future__ import annotations

import sys
import time

from kvserve.runtime import LLM, SamplingParams, sampling
from kvserve.runtime.structured_output import StructuredOutputSpec, constraint

SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "age", "tags"],
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
    },
}


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else "examples/models/stories260K"
    llm = LLM(model, max_model_len=512, max_num_seqs=64)
    prompts = [f"Story {i}: Once upon a time" for i in range(64)]
    timings = {"mask": 0.0, "accept": 0.0, "steps": 0}
    real_apply, real_accept = sampling.apply_constraints, constraint.GrammarConstraint.accept

    def timed_apply(logits, rows):
        t = time.perf_counter()
        real_apply(logits, rows)
        timings["mask"] += time.perf_counter() - t
        timings["steps"] += 1

    def timed_accept(self, token):
        t = time.perf_counter()
        real_accept(self, token)
        timings["accept"] += time.perf_counter() - t

    sampling.apply_constraints, constraint.GrammarConstraint.accept = timed_apply, timed_accept
    free = SamplingParams(temperature=0, max_tokens=64)
    constrained = SamplingParams(
        temperature=0, max_tokens=64, structured_outputs=StructuredOutputSpec.from_request("json", SCHEMA, "bench")
    )
    llm.generate(prompts[:4], free, use_tqdm=False)  # warm-up
    t = time.perf_counter()
    llm.generate(prompts, free, use_tqdm=False)
    free_s = time.perf_counter() - t
    t = time.perf_counter()
    outs = llm.generate(prompts, constrained, use_tqdm=False)
    constrained_s = time.perf_counter() - t
    steps = max(timings["steps"], 1)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"64 sequences, {steps} constrained steps, {tokens} constrained tokens")
    print(
        f"bitmask fill+apply: {1e3 * timings['mask'] / steps:.2f} ms/step; matcher advance: "
        f"{1e3 * timings['accept'] / steps:.2f} ms/step"
    )
    print(
        f"batch wall time: free text {free_s:.2f} s, constrained {constrained_s:.2f} s "
        f"(grammar share of the constrained run: {100 * (timings['mask'] + timings['accept']) / constrained_s:.1f}%)"
    )


if __name__ == "__main__":
    main()
