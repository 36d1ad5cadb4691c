"""n > 1 samples fanned out in front (vLLM V1's ParentRequest, vllm/v1/engine/parallel_sampling.py).

The engine core -- scheduler, KV-cache manager, runner -- runs one sequence per request. A request for n
samples becomes n child requests with the same prompt, here on the tokenizer's side of the core boundary
(RequestTracker, used by the in-process LLMEngine and by CoreClient alike), and their outputs are merged back
into one RequestOutput whose choice `index` is the child's index (output_processor.RequestState).

What each child gets:
- its own core request id, `child_request_id(parent id, index)`;
- the parent's params with n=1 and, for a seeded request, the seed `seed + index` (vLLM's rule; the seed
  bounds in SamplingParams make room for it), so a seeded n > 1 request is reproducible and its i-th choice
  equals a single request seeded `seed + i`;
- `counts_prompt_tokens` set on child 0 only: the core's prompt-token counter (vllm:prompt_tokens) counts
  a prompt once per user request, as the request-level histogram does.

How the children share the prompt: they are queued back to back, child 0 first, in one go. The scheduler
caches a request's full blocks when it allocates them for the step that fills them, so a child admitted in
the same step as child 0 (or later) takes the prompt's full blocks as prefix-cache hits -- the same physical
blocks, ref-counted -- and computes only what prefix caching always recomputes: the partial last block, or
the last block when the prompt ends on a block boundary (its logits are needed). A long prompt that child 0
prefills in chunks takes the whole step budget, so its siblings are admitted on the step child 0 finishes
(and hit every full block). Two exceptions: with prefix caching disabled the children simply prefill the
prompt separately, and with `long_prefill_token_threshold` capping child 0's chunk a sibling can be admitted
mid-prefill, hit the blocks cached so far and compute the next chunk itself.

Abort and failure are per user request: aborting the parent aborts every child still running; a child the
core fails (its sampling failed, a failed step) fails the parent, and the front aborts the other children.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.runtime.sampling_params import SamplingParams


def child_request_id(request_id: str, index: int) -> str:
    """The core's id of the index-th child (one-to-one: the index is the digits after the last '#')."""
    return f"{request_id}#{index}"


@dataclass(frozen=True, slots=True)
class ChildRequest:
    request_id: str  # the core's request id
    index: int  # the choice index in the parent's outputs
    params: SamplingParams  # n=1, seed + index when seeded
    counts_prompt_tokens: bool  # child 0 only


class ParentRequest:
    """One user request and the n child requests the core runs for it."""

    __slots__ = ("request_id", "params", "children")

    def __init__(self, request_id: str, params: SamplingParams):
        self.request_id = request_id
        self.params = params
        self.children = [
            ChildRequest(child_request_id(request_id, i), i, params.for_sample(i) if params.n > 1 else params, i == 0)
            for i in range(params.n)
        ]

    @property
    def child_ids(self) -> list[str]:
        return [child.request_id for child in self.children]
