"""draft_service.due_rounds: which verdicts a drafting batch waits for, with a clock the test moves."""

from __future__ import annotations

import asyncio

from draft_service.due_rounds import FORGET_S, LATE_ROUNDS, DueRounds


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_step_s_verdicts_are_waited_for_until_all_arrived_and_left():
    clock = Clock()
    due = DueRounds(clock)
    due.arrived(1, ("v1", 7), 3)
    assert due.waiting_for(1.0) == 3  # one arrived and not left, two not arrived
    due.left(1)
    assert due.waiting_for(1.0) == 2
    due.arrived(2, ("v1", 7), 3)
    due.arrived(None, ("v1", 7), 3)  # its sequence ended here meanwhile: arrived, never due
    assert due.waiting_for(1.0) == 1
    due.left(2)
    assert due.waiting_for(1.0) == 0
    due.arrived(3, ("v2", 7), 1)  # another verifier's step of the same number, one verdict
    assert due.waiting_for(1.0) == 1
    due.left(3)
    due.left(3)  # twice: nothing
    assert due.waiting_for(1.0) == len(due) == 0


def test_what_stalls_is_waited_for_only_within_the_bound():
    """A sequence whose round never starts (its client stalls its stream) and a step whose last verdict never
    comes hold a wait of bound B for at most B after they arrived or began arriving, and no later wait."""
    clock = Clock()
    due = DueRounds(clock)
    due.arrived(1, None, 0)
    due.arrived(2, ("v", 1), 4)
    assert due.waiting_for(0.5) == 2 + 3  # two due, three of step 1 not arrived
    clock.now += 0.4
    assert due.waiting_for(0.5) == 5
    clock.now += 0.2
    assert due.waiting_for(0.5) == 0 and due.waiting_for(1.0) == 5

    async def bounded() -> None:
        await due.settled(0.5)  # returns at once: all of it is older than the bound

    asyncio.run(asyncio.wait_for(bounded(), 5))
    assert due.waiting_for(10.0) == 3  # 1 and 2 are late now; three of step 1 not arrived
    clock.now += FORGET_S
    due.arrived(3, ("v", 2), 2)  # a new step forgets the steps begun too long ago
    assert due.waiting_for(10.0) == 1 + 1  # 3; step 2's other verdict


def test_settled_returns_when_the_last_one_leaves():
    due = DueRounds()

    async def run() -> None:
        due.arrived(1, ("v", 1), 2)
        waiter = asyncio.ensure_future(due.settled(30.0))
        await asyncio.sleep(0.01)
        assert not waiter.done()
        due.left(1)
        await asyncio.sleep(0.01)
        assert not waiter.done()  # the step's other verdict has not arrived
        due.arrived(2, ("v", 1), 2)
        await asyncio.sleep(0.01)
        assert not waiter.done()  # arrived, its round not started
        due.left(2)
        await asyncio.wait_for(waiter, 5)

    asyncio.run(run())


def test_a_wait_gives_up_at_its_bound_and_the_late_one_is_not_waited_for_its_next_verdicts():
    due = DueRounds()

    async def run() -> None:
        due.arrived(1)
        await asyncio.wait_for(due.settled(0.05), 5)  # 1 never leaves: the bound ends the wait
        assert len(due) == 0 and due.waiting_for(10.0) == 0
        for _ in range(LATE_ROUNDS):
            due.arrived(1)
            assert due.waiting_for(10.0) == 0
        due.arrived(1)  # on time again after that
        assert due.waiting_for(10.0) == 1
        due.forget(1)
        assert due.waiting_for(10.0) == 0 and not due._late

    asyncio.run(run())
