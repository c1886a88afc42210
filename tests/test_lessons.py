"""Lessons: the files are valid (every named preset, workload, switch, chart and metric exists), the numbers come
from the engine's own history, and a lesson run on a live engine measures its before and after, follows Flip and
Stop, and leaves the engine as it found it."""
from __future__ import annotations

import dataclasses
import json
import time

import pytest

from engine import LLM
from engine.service import HistorySample
from playground.course import CHARTS, METRICS, Lesson, check_lesson, load_lessons
from playground.lesson_numbers import window_metrics
from playground.lesson_record import record_html, record_json
from playground.lessons import LessonRunner

COURSE = ["KV cache", "Paged KV", "Continuous", "Preemption", "Prefix caching", "Chunked prefill", "Speculative",
          "Quantization", "CUDA graphs", "Memory is still"]


def test_every_lesson_is_valid_and_in_the_course_order():
    lessons = load_lessons()
    assert [next(c for c in COURSE if c.lower() in x.title.lower()) for x in lessons] == COURSE
    for lesson in lessons:
        assert check_lesson(lesson) == [], lesson.slug
        assert lesson.chart in CHARTS and lesson.metric in METRICS
    assert [x.slug for x in lessons if x.needs] == ["09-cuda-graphs"]


def test_a_broken_lesson_is_refused_by_name():
    good = load_lessons()[4]
    bad = dataclasses.replace(good, workload="no-such-workload", chart="pie", metric="vibes", expect="sideways",
                              switch={"prefix_cashing": True}, preset=None)
    problems = " | ".join(check_lesson(bad))
    for word in ("no-such-workload", "pie", "vibes", "sideways", "prefix_cashing"):
        assert word in problems
    same = dataclasses.replace(good, switch={"prefix_caching": False})  # the preset already has it off
    assert any("changes nothing" in p for p in check_lesson(same))
    assert any("preset" in p for p in check_lesson(dataclasses.replace(good, preset="no-such-preset")))


def sample(t, gen, hits=0, queries=0, preempt=0, blocks=0, running=0, step_ms=10.0, ttft=None, tpot=None):
    return HistorySample(int(t), running, 0, preempt, blocks, queries, hits, gen, time=t, step_ms=step_ms, ttft_s=ttft,
                         tpot_s=tpot)


def test_window_numbers_come_from_the_history_and_survive_a_restart():
    history = [sample(0, 0), sample(1, 10, hits=0, queries=100), sample(2, 30, hits=50, queries=200, blocks=8,
                                                                         running=2, ttft=0.5, tpot=0.1),
               # the engine was rebuilt: its counters start again from 0
               sample(3, 5, hits=10, queries=20, preempt=1, blocks=4, running=4, step_ms=90, ttft=0.3, tpot=0.2),
               sample(4, 25, hits=30, queries=40, preempt=3, blocks=6, running=3)]
    m = window_metrics(history, 1.5, 4)
    assert m["tokens_per_s"] == pytest.approx((20 + 5 + 20) / 2.5)  # from the sample before the window: 10
    assert m["prefix_hit_rate"] == pytest.approx((50 + 10 + 20) / (100 + 20 + 20))
    assert m["preemptions"] == 3 and m["peak_kv_blocks"] == 8 and m["kv_blocks_used"] == pytest.approx(6)
    assert m["max_step_ms"] == 90 and m["running"] == pytest.approx(3)
    assert m["time_per_token_ms"] == pytest.approx((10 + 90 + 10) / (20 + 5 + 20))
    assert m["ttft_s"] == pytest.approx(0.4)
    assert m["tpot_s"] == pytest.approx((10 + 90 + 10) / 3 / 1e3)  # the steps that produced tokens, a restart's too
    empty = window_metrics(history, 10, 11)
    assert empty["ttft_s"] is None and empty["prefix_hit_rate"] is None and empty["max_step_ms"] is None


def test_the_record_is_one_page_of_escaped_text_and_inline_svg():
    result = {"lesson": "x", "title": "<script>alert(1)</script> caching", "switch": {"prefix_caching": True},
              "workload": "shared-system-prompt", "users": 4, "metric": "prefix_hit_rate", "expect": "up",
              "moved": "up", "as_expected": True, "precision": "fp32", "device": "cpu", "flip_at_s": 10.0,
              "before": {k: 0.0 for k in METRICS}, "after": {k: 0.5 for k in METRICS},
              "chart": [(1.0, 0.0), (11.0, 0.4), (19.0, 0.6)]}
    page = record_html([result], "a 2-core <b>machine</b>")
    assert "<script" not in page and "&lt;script&gt;" in page and "&lt;b&gt;machine" in page
    assert "<svg" in page and "http" not in page.replace("http://www.w3.org/2000/svg", "")
    assert "Prefix-cache hit rate went up" in page and "50%" in page
    data = json.loads(record_json([result], "m"))
    assert data["lessons"][0]["after"]["prefix_hit_rate"] == 0.5


# ---- on a live engine ---------------------------------------------------------------------------------------

@pytest.fixture()
def pg(tiny_models, tmp_path):
    from playground import Playground
    playground = Playground(LLM(tiny_models["llama"][0], max_model_len=512), store=tmp_path / "ablation.json")
    yield playground
    playground.lessons.leave()
    playground.traffic.stop()
    playground.service.shutdown()


def wait_phase(runner: LessonRunner, phases: tuple[str, ...], timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while runner.run is None or runner.run.phase not in phases:
        assert time.monotonic() < deadline, f"still {runner.run and runner.run.phase}: {runner.run and runner.run.note}"
        time.sleep(0.1)


@pytest.mark.slow
def test_a_lesson_measures_before_and_after_and_puts_the_engine_back(pg):
    assert "Applied" in pg.apply_settings(max_num_seqs=12)  # the presenter's own setting, to be restored
    runner = LessonRunner(pg, seconds=4)
    pg.lessons = runner
    said = runner.start("05-prefix-caching")
    assert "Started" in said, said
    wait_phase(runner, ("before",))
    assert pg.settings()["prefix_caching"] is False and pg.settings()["max_num_seqs"] == 64  # the lesson's own
    assert pg.traffic.status().running
    wait_phase(runner, ("done", "failed"))
    assert runner.run.phase == "done", runner.run.note
    result = runner.run.result
    assert result["before"]["prefix_hit_rate"] == 0  # no prefix cache: every query a miss
    assert result["after"]["prefix_hit_rate"] > 0.3  # the shared system prompt computed once
    assert result["as_expected"] is True and result["moved"] == "up"
    assert result["before"]["tokens_per_s"] > 0 and result["after"]["tokens_per_s"] > 0
    assert runner.records == [result] and result["chart"]
    assert "went up" in runner.result_table(result) and "as the lesson expected" in runner.result_table(result)
    said_to_room = [n.what for n in pg.room.notices()]
    assert "started the lesson 'Prefix caching'" in said_to_room
    assert "lesson 'Prefix caching': flipped prefix_caching → on" in said_to_room
    said = runner.leave()
    assert "back as it was" in said
    assert pg.settings()["prefix_caching"] is True and pg.settings()["max_num_seqs"] == 12
    assert runner.run is None and not pg.traffic.status().running
    deadline = time.monotonic() + 30
    while pg.service.snapshot().num_running or pg.service.snapshot().kv_blocks_used:
        assert time.monotonic() < deadline, "blocks still in use after the lesson"
        time.sleep(0.1)


def test_flip_now_then_stop_mid_lesson_keeps_no_record_and_restores(pg):
    runner = LessonRunner(pg, seconds=60)
    pg.lessons = runner
    assert "Started" in runner.start("03-continuous-batching")
    wait_phase(runner, ("before",))
    assert pg.settings()["continuous_batching"] is False and pg.settings()["max_num_seqs"] == 8
    assert "Flipping" in runner.flip()
    wait_phase(runner, ("after",), timeout_s=30)
    assert pg.settings()["continuous_batching"] is True
    assert "Nothing to flip" in runner.flip()
    runner.leave()
    assert runner.records == [] and runner.run is None
    assert pg.settings()["max_num_seqs"] == 64 and pg.settings()["continuous_batching"] is True
    assert not pg.traffic.status().running


def test_next_and_previous_walk_the_course_and_a_gpu_lesson_says_what_was_measured(pg):
    runner = LessonRunner(pg, seconds=60, device_type="cpu")
    pg.lessons = runner
    assert "first lesson" in runner.step(-1) or runner.run is not None
    runner.leave()
    runner.start("08-quantization")
    said = runner.step(+1)
    assert "needs a CUDA GPU" in said and runner.run.phase == "unavailable"
    assert "H200" in runner.run.lesson.measured and "not on this machine" in runner.phase_line()
    runner.step(+1)
    assert runner.run.lesson.slug == "10-memory-constraint"
    assert "last lesson" in runner.step(+1)
    runner.leave()
    assert pg.settings()["quantization"] is None  # the quantization lesson never got to flip


def test_a_lesson_does_not_start_over_a_running_traffic_run_or_while_attached(pg):
    runner = LessonRunner(pg, lessons=[dataclasses.replace(load_lessons()[4], before_s=1, after_s=1)])
    assert pg.start_traffic("shared-system-prompt", 2, 30) == ""
    assert "simulated users are running" in runner.start("05-prefix-caching")
    pg.stop_traffic()
    assert isinstance(runner.lessons[0], Lesson)


@pytest.mark.slow
@pytest.mark.parametrize("slug", ["02-paged-kv", "04-preemption", "05-prefix-caching"])
def test_a_lesson_whose_number_is_a_count_moves_the_way_it_says(pg, slug):
    """Quick mode (3 s phases) on a tiny model. Only lessons whose number counts something (requests running,
    preemptions, prefix hits) are asserted here: a timing's direction is never asserted in a test; those lessons'
    numbers are measured by `python -m playground.rehearse` and recorded in docs/measurements.md."""
    # the tiny model replies in a fraction of a second, so the paged-KV lesson's 12 users (each thinking 0.5-3 s
    # between requests) kept only ~2 requests in flight: arrivals, not the pool, limited how many ran, and the
    # count came out 2.2 before and 2.0 after in 1 run of 3. 32 users make the pool the limit, as the real model's
    # slower replies do with 12. The preemption lesson's 40-block pool held 15-25 blocks on average here (1-2
    # requests in flight, even with 32 users) and a run in two saw no preemption before the flip: its pool here is
    # 24 blocks, one longest request (160 + 128 tokens: 18 blocks) and not two, so any overlap preempts
    lessons = [dataclasses.replace(x, users=32) if x.metric == "running" else
               dataclasses.replace(x, users=32, start={**x.start, "num_kv_blocks": 24}) if x.metric == "preemptions"
               else x for x in load_lessons()]
    # and the paged-KV lesson's users think 0-0.2 s, not 0.5-3 s: as the tiny model got faster, 32 thinking users kept
    # ~1.6 requests in flight with paging off and on alike (a clean-clone CI run: 1.63 before, 1.57 after), so the
    # pool never limited them and the count went either way
    if slug == "02-paged-kv":
        pg.traffic.think_s = (0.0, 0.2)
    runner = LessonRunner(pg, lessons=lessons, seconds=3)
    pg.lessons = runner
    runner.start(slug)
    wait_phase(runner, ("done", "failed"), timeout_s=120)
    result = runner.run.result
    assert runner.run.phase == "done" and result["as_expected"] is True, (
        result["before"]["running"], result["after"]["running"], result["before"], result["after"])
