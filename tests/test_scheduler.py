"""Scheduling policies (engine/policies.py): first come, first served, and priority (lower first, as vLLM's), which
lets a person's request go before simulated users' — admitted into a full batch, its prompt read while the worse
ones wait a step — without changing anyone's greedy tokens or leaking a block."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.policies import POLICIES
from tests.conftest import assert_all_blocks_free
from tests.test_features import engine_like
from tests.test_parity import random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tiny_models):
    return LLM(tiny_models["llama"][0], max_model_len=256)


def drive(engine, until=None, limit: int = 500) -> dict[str, list[int]]:
    """Step until nothing is left (or `until()` holds); the finished requests' tokens."""
    done = {}
    for _ in range(limit):
        if not engine.has_unfinished() or (until is not None and until()):
            break
        for out in engine.step():
            if out.finished:
                assert out.request_id not in done, "finished twice"
                done[out.request_id] = out.token_ids
    return done


def test_the_policies_are_registered_and_named_in_the_config(tiny):
    assert set(POLICIES) == {"fcfs", "priority"} and tiny.config.scheduling_policy == "priority"
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        engine_like(tiny, scheduling_policy="lottery")
    with pytest.raises(ValueError, match="priority must be an integer"):
        engine_like(tiny).add_request([1, 2, 3], GREEDY, priority="high")


def ran(engine) -> list[str]:
    """The requests the engine's last step computed, in its order."""
    return [e.request_id for e in engine.steps[-1].entries]


def test_a_better_priority_takes_a_full_batchs_seat_and_every_token_stays_the_same(tiny):
    prompts = random_prompts(5, seed=3)
    reference = engine_like(tiny, max_num_seqs=4)
    ids = [reference.add_request(p, GREEDY) for p in prompts]
    done = drive(reference)
    expected = [done[i] for i in ids]

    engine = engine_like(tiny, max_num_seqs=4)
    users = [engine.add_request(p, GREEDY, priority=1) for p in prompts[:4]]  # simulated users fill the seats
    drive(engine, limit=3)
    assert {r.request_id for r in engine.scheduler.running} == set(users)
    person = engine.add_request(prompts[4], GREEDY, priority=0)
    done = {out.request_id: out.token_ids for out in engine.step() if out.finished}
    # the newest user gave up its seat, and the others sat this step out: it was the person's prompt
    assert ran(engine) == [person] and engine.steps[-1].preempted == [users[-1]]
    done.update(drive(engine))
    assert [done[i] for i in users + [person]] == expected  # preempted and recomputed: the same greedy tokens
    assert_all_blocks_free(engine)


def test_worse_requests_sit_out_the_steps_of_a_better_ones_prompt(tiny):
    engine = engine_like(tiny, max_num_batched_tokens=32, chunked_prefill=True)
    users = [engine.add_request(p, GREEDY, priority=1) for p in random_prompts(3, seed=5)]
    drive(engine, until=lambda: len(engine.scheduler.running) == 3
          and not any(r.is_prefilling for r in engine.scheduler.running))
    person = engine.add_request((random_prompts(1, seed=9)[0] * 4)[:100], GREEDY, priority=0)  # four chunks
    steps = []
    while engine.requests[person].num_output_tokens == 0:
        engine.step()
        steps.append(ran(engine))
        assert len(steps) < 20
    assert steps == [[person]] * len(steps) and len(steps) >= 3  # nobody else ran while its prompt was read
    engine.step()
    assert set(users) <= set(ran(engine))  # then everyone decodes together again
    drive(engine)
    assert_all_blocks_free(engine)


def test_fcfs_ignores_priority_and_equal_priorities_are_first_come(tiny):
    prompts = random_prompts(4, seed=11)
    for policy in ("fcfs", "priority"):
        engine = engine_like(tiny, max_num_seqs=2, scheduling_policy=policy)
        ids = [engine.add_request(p, GREEDY, priority=0 if policy == "priority" else 5 - i)
               for i, p in enumerate(prompts)]
        out = engine.scheduler.schedule()
        assert [s.request.request_id for s in out.scheduled] == ids[:2] and not out.preempted, policy
        drive(engine)
        assert_all_blocks_free(engine)
    engine = engine_like(tiny, scheduling_policy="fcfs", max_num_seqs=1)
    first = engine.add_request(prompts[0], GREEDY, priority=9)
    engine.add_request(prompts[1], GREEDY, priority=0)
    assert [s.request.request_id for s in engine.scheduler.schedule().scheduled] == [first]


def test_priority_under_a_pool_too_small_gives_the_same_tokens_as_alone(tiny):
    """Random priorities, a pool that forces preemption, arrivals mid-run: every request's greedy tokens are the
    ones it gets alone, and every block is free at the end."""
    import random
    rng = random.Random(0)
    prompts = random_prompts(8, seed=21)
    alone = []
    for p in prompts:
        engine = engine_like(tiny)
        rid = engine.add_request(p, GREEDY)
        alone.append(drive(engine)[rid])
    engine = engine_like(tiny, num_kv_blocks=12, max_num_seqs=4)
    ids, done = [], {}
    for p in prompts:
        ids.append(engine.add_request(p, GREEDY, priority=rng.choice([0, 1, 2])))
        done.update(drive(engine, limit=rng.randint(1, 4)))
    done.update(drive(engine))
    assert [done[i] for i in ids] == alone
    assert engine.scheduler.num_preemptions > 0
    assert_all_blocks_free(engine)
