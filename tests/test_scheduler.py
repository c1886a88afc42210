"""Scheduling policies (engine/policies.py): first come, first served, and priority (lower first, as vLLM's), which
lets a person's request go before simulated users' — admitted into a full batch, its prompt read while the worse
ones wait a step — without changing anyone's greedy tokens or leaking a block."""
from __future__ import annotations

import pytest

from engine import LLM, EngineConfig, SamplingParams
from engine.blocks import PagedKVCache
from engine.policies import POLICIES, Priority
from engine.request import Request
from engine.scheduler import Scheduler
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


def test_worse_newcomers_are_not_admitted_into_a_better_ones_prompt_step(tiny):
    engine = engine_like(tiny)
    users = [engine.add_request(p, GREEDY, priority=1) for p in random_prompts(2, seed=5)]
    drive(engine, until=lambda: len(engine.scheduler.running) == 2
          and not any(r.is_prefilling for r in engine.scheduler.running))
    person = engine.add_request(random_prompts(1, seed=9)[0], GREEDY, priority=0)
    late = engine.add_request(random_prompts(1, seed=13)[0], GREEDY, priority=1)  # a simulated user's new prompt
    engine.step()
    assert ran(engine) == [person]  # the budget had room for the newcomer's prompt: it waits a step all the same
    engine.step()
    assert set(ran(engine)) == {*users, person, late}
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


# The scheduler alone (no model): a stand-in runner writes each scheduled position's token into its block, so a
# test can tell a block whose K/V exists from one that only names a prefix in the prefix cache.

class Runner:
    def __init__(self, config: EngineConfig, num_blocks: int, policy=None):
        self.kv = PagedKVCache(num_blocks, config.block_size, prefix_caching=True)
        self.scheduler = Scheduler(config, self.kv)
        if policy is not None:
            self.scheduler.policy = policy
        self.written: dict[int, list[int]] = {}  # block id -> the tokens whose K/V it holds, from its first slot

    def step(self, next_token: int = 7):
        out = self.scheduler.schedule()
        bs, pool = self.kv.block_size, self.kv.pool
        will_write = {s.block_ids[p // bs] for s in out.scheduled for p in range(s.start, s.known_end)}
        for key, block_id in pool.cached.items():  # a cached block holds its tokens, or is computed this step
            assert self.written.get(block_id) == list(key[1]) or block_id in will_write, \
                f"block {block_id} is in the prefix cache but its K/V is never computed"
        for s in out.scheduled:
            for p in range(s.start, s.known_end):
                block = self.written.setdefault(s.block_ids[p // bs], [])
                del block[p % bs:]
                block.append(s.request.token_ids[p])
            self.kv.mark_computed(s.request, s.known_end)
            if s.num_logits:
                s.request.token_ids.append(next_token)
                if s.request.num_output_tokens >= s.request.params.max_tokens:
                    self.scheduler.finish(s.request)
        return out


class PriorityWithoutSitOut(Priority):
    """Priority's ranks and victims, but every running request runs each step: nothing in the scheduler may rely on
    the sit-out to keep a request it already put in the step from being preempted."""
    name = "priority-without-sit-out"

    def cutoff(self, running, waiting):
        return None


def test_an_arrival_that_outranks_never_preempts_a_request_already_in_the_step():
    """A request mid-prefill registers its chunk's full blocks before the forward pass; if a better arrival then
    took its seat in the same step, those blocks would sit cached-free without K/V, and the arrival's own prefix
    lookup would hit them: silently wrong tokens."""
    config = EngineConfig(block_size=4, max_num_seqs=1, max_num_batched_tokens=8, max_model_len=64)
    run = Runner(config, num_blocks=16, policy=PriorityWithoutSitOut())
    prompt = list(range(100, 124))  # three chunks of 8
    user = Request("user", prompt, SamplingParams(max_tokens=2), priority=1)
    run.scheduler.add(user)
    run.step()  # its first chunk: blocks 0 and 1 computed and cached
    person = Request("person", prompt[:16] + [1, 2, 3, 4], SamplingParams(max_tokens=2), priority=0)
    run.scheduler.add(person)
    out = run.step()  # the user's second chunk registers blocks 2 and 3; the person outranks it, for its seat
    assert [s.request.request_id for s in out.scheduled] == ["user"] and not out.preempted
    for _ in range(10):
        if not run.scheduler.has_unfinished():
            break
        run.step()
    assert person.num_output_tokens == 2 and user.num_output_tokens == 2


@pytest.mark.parametrize("policy", [Priority(), PriorityWithoutSitOut()], ids=lambda p: p.name)
def test_every_cached_block_holds_its_tokens_under_random_priorities_and_a_small_pool(policy):
    import random
    for seed in range(40):
        rng = random.Random(seed)
        config = EngineConfig(block_size=4, max_num_seqs=rng.randint(1, 4), max_num_batched_tokens=rng.randint(4, 24),
                              max_model_len=64)
        run = Runner(config, num_blocks=rng.randint(6, 16), policy=policy)
        for i in range(40):
            if rng.random() < 0.4:
                shared = rng.choice([[1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9], []])
                prompt = shared + [rng.randint(10, 13) for _ in range(rng.randint(1, 16))]
                run.scheduler.add(Request(f"{seed}-{i}", prompt, SamplingParams(max_tokens=rng.randint(1, 8)),
                                          priority=rng.choice([0, 1, 2])))
            run.step(next_token=rng.randint(10, 13))
