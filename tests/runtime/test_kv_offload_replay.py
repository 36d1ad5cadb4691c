"""The host tier bench's workload replayed through the real scheduler without a model (torch-free, issue 41):
the pool is sized on the distinct working set, the tier changes what is computed and never the answers, and
where the p90 of the burst workload goes (admission, identical on and off) is a step count."""

from __future__ import annotations

from kvserve.runtime.bench.kv_offload import pool_shape
from kvserve.runtime.bench.kv_offload_replay import main, replay


def test_the_working_set_counts_the_shared_system_prompt_once():
    # 16 chats x 3 turns of (64-token question + 32-token answer) after a 256-token system prompt: 34 blocks
    # of 16 a chat at the last turn, 16 of them the shared prompt -> 16 + 16 * 18 distinct blocks.
    shape = pool_shape(16, 3, 256, 64, 32, 16, 4.0)
    assert shape.working_set_blocks == 304 and shape.num_kv_blocks == 76 and shape.max_model_len == 544
    assert pool_shape(2, 3, 256, 64, 32, 16, 4.0).num_kv_blocks == 2 * 34 + 1  # never below two sequences


def test_the_tier_loads_instead_of_computing_with_the_same_answers():
    off, on = replay(tier=False), replay(tier=True)
    assert off.answers == on.answers and len(on.answers) == 16 * 3
    assert off.loaded_tokens == 0 and on.loaded_tokens > 0
    assert on.computed_tokens + on.loaded_tokens == off.computed_tokens  # every loaded token one not computed


def test_a_burst_per_turn_is_admission_bound_the_same_with_the_tier_on_and_off():
    """Each turn's requests arrive at once and the pool runs a few at a time: a later wave waits for the
    earlier ones' 32 decode steps, on and off alike. The tier only makes the steps it waits behind smaller."""
    off, on = replay(tier=False), replay(tier=True)
    assert on.admissions == off.admissions and on.steps == off.steps
    assert [step for step, _ in on.admissions[2]][:3] == [1, 33, 65]  # turn 3: waves every answer_len steps
    assert on.p90_queue_steps == off.p90_queue_steps >= 64
    assert on.p90_tokens_before < off.p90_tokens_before and on.p90_tokens_to_first < off.p90_tokens_to_first


def test_loaded_tokens_cost_no_budget():
    """With a token budget that binds, the tier admits more of a turn in its first step (a load is a copy)."""
    off, on = (replay(tier=t, max_num_batched_tokens=256, num_kv_blocks=136) for t in (False, True))
    assert off.answers == on.answers
    assert on.admissions[2][0][1] > off.admissions[2][0][1]


def test_paced_arrivals_and_the_cli(capsys):
    off, on = main(["--conversations", "6", "--turns", "2", "--conversation-rate", "2", "--think-time", "5"])
    assert off.model_ttft_p90_s is not None and on.loaded_tokens > 0
    assert on.model_ttft_p90_s < off.model_ttft_p90_s  # the step-cost model: smaller prefills, nothing else
    assert len(capsys.readouterr().out.splitlines()) == 2
