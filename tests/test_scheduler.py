"""The scheduler's rules as plain data: no thread, no model (a pass's device tokens ride along unread).

Admission order and the slot budget, the queue-full rule (requests being
admitted still hold their slots), row placement for n samples, stop and
length endings, compaction, and the step's stats.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from model.decode.sampling import SamplingParams
from server.engine.multistep import PassCosts, ends_run_early, joinable_rows
from server.engine.scheduler import CANCELLED, QueueFull, Scheduler
from server.engine.step import RunnerOutput
from server.engine.stopping import StoppingCriteria
from server.engine.types import GenerationRequest


@dataclass(eq=False)
class Req:
    """A queued request as the scheduler sees it (the engine's GenerationStream in production)."""

    request: GenerationRequest
    cancelled: bool = False
    submitted_at: float = 0.0
    first_token_at: float | None = None
    each_event: bool = False  # streamed
    cached_tokens: int = 0  # prompt tokens the prefix cache gave


def req(name: str, n: int = 1, prompt=(1, 2), max_new: int = 3, stop=()) -> Req:
    return Req(GenerationRequest(name, list(prompt), max_new, SamplingParams(seed=0), n=n, stop=list(stop)))


def admit(scheduler: Scheduler) -> list[Req]:
    """Schedule, place and register every group, as the engine does after a successful prefill."""
    taken = scheduler.take_admissible()
    scheduler.register(scheduler.placements(taken))
    scheduler.admitted()
    return taken


def test_requests_are_admitted_in_order_while_they_fit():
    scheduler = Scheduler(max_batch=4, max_waiting=8)
    a, b, c = req("a", n=2), req("b", n=3), req("c", n=1)
    for r in (a, b, c):
        scheduler.add(r)
    assert scheduler.take_admissible() == [a]  # b needs 3 of the 2 left; c waits behind it (no overtaking)
    assert scheduler.admitting == 2 and scheduler.waiting_sequences == 4


def test_a_request_is_refused_while_another_is_being_admitted():
    """max batch 1, max waiting 0: the one slot is promised to the request being admitted."""
    scheduler = Scheduler(max_batch=1, max_waiting=0)
    scheduler.add(req("first"))  # a free slot takes it, so the empty queue limit does not refuse it
    taken = scheduler.take_admissible()
    assert [r.request.request_id for r in taken] == ["first"]
    with pytest.raises(QueueFull):
        scheduler.add(req("second"))
    scheduler.register(scheduler.placements(taken))
    scheduler.admitted()
    with pytest.raises(QueueFull):  # now the slot is running the first
        scheduler.add(req("second"))


def test_cancelled_waiting_requests_leave_the_queue_and_free_their_place():
    scheduler = Scheduler(max_batch=1, max_waiting=1)
    gone, kept = req("gone"), req("kept")
    scheduler.add(gone)
    gone.cancelled = True
    scheduler.add(kept)  # the full queue's place is freed by dropping the cancelled request
    assert list(scheduler.waiting) == [kept]


def test_samples_of_a_group_copy_the_row_their_prompt_was_prefilled_in():
    scheduler = Scheduler(max_batch=8, max_waiting=8)
    scheduler.add(req("x"))
    admit(scheduler)  # row 0 is taken
    a, b = req("a", n=3), req("b", n=2)
    places = scheduler.placements([a, b])
    assert [(p.row, p.owner, p.sample, p.copy_of) for p in places] == [
        (1, a, 0, None),
        (2, b, 0, None),
        (3, a, 1, 1),
        (4, a, 2, 1),
        (5, b, 1, 2),
    ]


def test_rows_end_by_stop_or_length_and_a_request_completes_with_its_last_row():
    scheduler = Scheduler(max_batch=4, max_waiting=4)
    a, b = req("a", n=2, max_new=2, stop=[b"\n"]), req("b", max_new=5)
    scheduler.add(a)
    scheduler.add(b)
    admit(scheduler)  # rows: a0, b0, a1
    first = scheduler.advance([[ord("\n")], [7], [7]], now=1.0)
    assert first.reasons == ["stop", None, None] and first.finished == [0] and first.completed == []
    assert scheduler.rows[0].stopping.matched == b"\n"
    assert scheduler.compact(first.finished) == [(2, 0)]  # a1 moves into a0's row
    assert [(s.owner, s.sample) for s in scheduler.rows] == [(a, 1), (b, 0)]
    second = scheduler.advance([[7], [7]], now=2.0)
    assert second.reasons == ["length", None] and second.completed == [a]


def test_update_from_output_says_what_the_runner_must_read_and_move_and_leaves_the_runner_s_tokens_as_drawn():
    """A pass's update is data for the runner (which rows to read, which to move, how many stay live) and for the
    events (the rows before they moved); the RunnerOutput it was made from is not edited."""
    scheduler = Scheduler(max_batch=4, max_waiting=4)
    a, b = req("a", n=2, max_new=2, stop=[b"\n"]), req("b", max_new=5)
    scheduler.add(a)
    scheduler.add(b)
    admit(scheduler)  # rows: a0, b0, a1
    plan = scheduler.schedule(1)
    drawn = RunnerOutput([[ord("\n")], [7], [7]], torch.zeros(3, dtype=torch.long), None, None, None, [], 0.5, 1.0)
    update = scheduler.update_from_output(plan, drawn)
    assert drawn.tokens == [[ord("\n")], [7], [7]]
    assert [(s.owner, s.sample) for s in update.rows] == [(a, 0), (b, 0), (a, 1)]  # as the pass drew them
    assert update.moves == [(2, 0)] and update.live == scheduler.running == 2 and update.copies == []
    assert {row: (r.start, r.end, r.request) for row, r in update.reads.items()} == {0: (2, 3, a.request)}
    assert (update.stats.batch, update.stats.tokens, update.stats.running, update.stats.steps) == (3, 3, 2, 1)


def test_compaction_moves_run_at_once_and_leave_rows_as_one_by_one_moves_would():
    """A row can move twice (into a hole that is itself the last row later): the runner gets each
    sequence's first row as its source, so one indexed copy per tensor does the whole compaction."""
    rng = random.Random(0)
    for _ in range(300):
        scheduler = Scheduler(max_batch=12, max_waiting=12)
        for i in range(rng.randint(1, 12)):
            scheduler.add(req(f"r{i}"))
        admit(scheduler)
        contents = list(scheduler.rows)  # what each slot holds before compaction
        finished = rng.sample(range(len(contents)), rng.randint(0, len(contents)))
        moves = scheduler.compact(finished)
        left = len(scheduler.rows)
        assert all(src >= left > dst for src, dst in moves)
        slots = list(contents)
        for src, dst in moves:
            slots[dst] = contents[src]
        assert slots[:left] == scheduler.rows
        assert sorted(map(id, scheduler.rows)) == sorted(id(s) for i, s in enumerate(contents) if i not in finished)


def test_cancelled_rows_leave_without_drawing_a_token():
    scheduler = Scheduler(max_batch=4, max_waiting=4)
    a, b = req("a", n=2), req("b")
    for r in (a, b):
        scheduler.add(r)
    admit(scheduler)  # rows a0, b0, a1
    a.cancelled = True
    outcome = scheduler.advance([[1], [2], [3]], now=1.0)
    assert outcome.reasons == [CANCELLED, None, CANCELLED] and outcome.tokens == 1
    assert outcome.completed == [a] and scheduler.rows[1].position == 3  # only b moved on
    scheduler.compact(outcome.finished)
    assert [s.owner for s in scheduler.rows] == [b]


def test_stats_time_first_tokens_once_per_request_and_gaps_per_sequence():
    scheduler = Scheduler(max_batch=4, max_waiting=4)
    a = req("a", n=2, max_new=5)
    a.submitted_at = 10.0
    scheduler.add(a)
    admit(scheduler)
    first = scheduler.advance([[1], [1]], now=10.5)
    assert first.first_token_seconds == [0.5] and first.token_gaps == {}
    second = scheduler.advance([[1], [1]], now=10.75)
    stats = scheduler.make_stats(second, state_bytes=123)
    assert stats.token_gaps == {0.25: 2}  # both sequences drew their second token 0.25 s after the first
    assert (stats.batch, stats.tokens, stats.running, stats.waiting, stats.state_bytes) == (2, 2, 2, 0, 123)


def test_steps_ahead_stay_within_every_rows_budget_and_are_one_while_a_client_watches_each_step():
    scheduler = Scheduler(max_batch=4, max_waiting=4)
    assert scheduler.steps_ahead(8) == 1  # no rows
    a, b = req("a", max_new=20), req("b", max_new=5)
    for r in (a, b):
        scheduler.add(r)
    admit(scheduler)
    assert scheduler.steps_ahead(8) == 5 and scheduler.steps_ahead(3) == 3 and scheduler.steps_ahead(1) == 1
    scheduler.advance([[1, 1, 1], [1, 1, 1]], now=1.0)
    assert scheduler.steps_ahead(8) == 2  # b has 2 tokens left
    streamed = req("s", max_new=50)
    streamed.each_event = True
    scheduler.add(streamed)
    admit(scheduler)
    assert scheduler.steps_ahead(8) == 1


def test_steps_ahead_are_one_while_a_request_runs_particles():
    scheduler = Scheduler(max_batch=4, max_waiting=4)
    particles = Req(GenerationRequest("p", [1], 9, SamplingParams(seed=0), particles=2))
    scheduler.add(particles)
    admit(scheduler)
    assert scheduler.running == 2 and scheduler.steps_ahead(8) == 1


def test_one_particle_runs_several_steps_at_once_unless_it_weighs_known_tokens():
    # The image route sends particles=1 for a digit whose known pixels all come first: a plain sample.
    scheduler = Scheduler(max_batch=4, max_waiting=4)
    scheduler.add(Req(GenerationRequest("plain", [1], 9, SamplingParams(seed=0), particles=1)))
    admit(scheduler)
    assert scheduler.steps_ahead(8) == 8
    scheduler.add(Req(GenerationRequest("weighed", [1], 9, SamplingParams(seed=0), forced={3: 1}, particles=1)))
    admit(scheduler)
    assert scheduler.running == 2 and scheduler.steps_ahead(8) == 1


def test_several_steps_at_once_advance_rows_until_a_stop_and_share_out_their_time():
    scheduler = Scheduler(max_batch=4, max_waiting=4)
    a, b = req("a", max_new=10, stop=[b"\n"]), req("b", max_new=10)
    for r in (a, b):
        scheduler.add(r)
    admit(scheduler)
    first = scheduler.advance([[1, 1], [1]], now=1.0, started=0.0)  # first tokens
    assert first.token_gaps == {0.5: 1} and first.tokens == 3  # a's second token: half of its update's time
    outcome = scheduler.advance([[7, ord("\n"), 7, 7], [7, 7, 7, 7]], now=3.0)
    assert outcome.reasons == ["stop", None] and outcome.tokens == 2 + 4  # a's tokens after its stop are dropped
    assert [s.position for s in scheduler.rows] == [2 + 4, 2 + 5] and scheduler.rows[0].stopping.generated == 4
    assert outcome.token_gaps == {1.0: 2, 0.5: 4}  # 2 s shared among the tokens each row kept
    assert scheduler.make_stats(outcome, state_bytes=0, steps=4).steps == 4


def test_stopping_criteria_report_the_longest_stop_that_matched():
    stopping = StoppingCriteria((b"b", b"ab"), max_new_tokens=10)
    assert stopping.push(ord("a")) is None
    assert stopping.push(ord("b")) == "stop" and stopping.matched == b"ab"
    assert StoppingCriteria((), max_new_tokens=1).push(0) == "length"


@pytest.mark.parametrize("stops", [(), (b"\n", b"ab")])
def test_a_run_of_tokens_stops_where_pushing_them_one_by_one_does(stops):
    rng = random.Random(0)
    for _ in range(200):
        budget, run = rng.randint(1, 12), [rng.choice(b"ab\nz") for _ in range(rng.randint(1, 8))]
        one_by_one, whole = StoppingCriteria(stops, budget), StoppingCriteria(stops, budget)
        one_by_one.generated = whole.generated = rng.randint(0, budget - 1)  # partway through its budget
        expected = (None, len(run))
        for kept, token in enumerate(run, start=1):
            if (reason := one_by_one.push(token)) is not None:
                expected = (reason, kept)
                break
        assert whole.push_run(run) == expected
        assert (whole.generated, whole.matched) == (one_by_one.generated, one_by_one.matched)


def test_a_run_ends_early_when_waiting_would_cost_the_joining_rows_more_than_a_pass_boundary_costs():
    scheduler = Scheduler(max_batch=8, max_waiting=8)
    for i in range(6):
        scheduler.add(req(f"r{i}"))
    admit(scheduler)  # 6 running, 2 free slots
    assert not ends_run_early(scheduler, 7, PassCosts(1.0, 1.0))  # nobody waits
    scheduler.add(req("one"))
    # 1 row idle for 7 steps (7 row-steps) against a boundary of 1 step for 6 rows (6 row-steps): end it.
    assert ends_run_early(scheduler, 7, PassCosts(1.0, 1.0))
    assert not ends_run_early(scheduler, 5, PassCosts(1.0, 1.0))
    assert ends_run_early(scheduler, 5, PassCosts(0.0, 1.0))  # boundary not measured yet
    assert ends_run_early(scheduler, 1, PassCosts(1.0, 0.0))  # steps not measured yet
    scheduler.add(req("two"))
    assert joinable_rows(scheduler) == 2 and ends_run_early(scheduler, 3, PassCosts(1.0, 1.0))
    scheduler.add(req("three"))
    assert joinable_rows(scheduler) == 2  # only two fit


def test_a_waiting_streamed_request_ends_a_run_at_once_unless_it_cannot_fit():
    scheduler = Scheduler(max_batch=2, max_waiting=4)
    scheduler.add(req("running"))
    admit(scheduler)
    watched = req("watched")
    watched.each_event = True
    scheduler.add(watched)
    assert ends_run_early(scheduler, 1, PassCosts(100.0, 1.0))
    scheduler.waiting.clear()
    scheduler.add(req("pair", n=2))  # two rows, one slot free: it cannot join this run's end either
    assert not ends_run_early(scheduler, 100, PassCosts(0.0, 1.0))
