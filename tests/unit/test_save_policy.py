"""With several ranks, a write that rank 0 must wait for is known a step ahead (SavePolicy.hold_ahead),
so every rank waits for it at the same step, outside any collective (issue 35)."""

from __future__ import annotations

import pytest

from training.loop.save_policy import SavePolicy


def _late_writes(interval: int, write_steps: int, steps: int = 60) -> tuple[int, int]:
    """The trainer's sequence, rank 0's side, with writes that last ``write_steps`` steps: at each
    step the save and the hold asked a step ago are acted on, then ``must_wait``. Returns how
    many steps had to wait, and how many of those all ranks had agreed on (the same number, or
    a rank would wait alone while the others sat in the next step's collective)."""
    policy = SavePolicy(interval, async_save=True)
    done_at: int | None = None  # the step at whose end the write in flight lands
    save_now = hold = False
    waits = agreed = 0
    for step in range(1, steps + 1):
        if done_at is not None and step >= done_at:
            policy.saved(done_at - write_steps, write_s=write_steps, recent_step_s=1.0)
            done_at = None
        in_flight = done_at is not None
        save_next = policy.ask_ahead(step, in_flight)
        hold_next = policy.hold_ahead(step, in_flight)
        if save_now:  # asked a step ago
            done_at = step + write_steps
        if policy.must_wait(step, done_at is not None):
            waits += 1
            agreed += hold
            policy.saved(done_at - write_steps, write_s=write_steps, recent_step_s=1.0)
            done_at = None
        save_now, hold = save_next, hold_next
    return waits, agreed


@pytest.mark.parametrize("interval, write_steps", [(2, 1), (2, 5), (4, 3), (5, 12), (10, 9), (10, 30)])
def test_every_wait_for_a_write_was_agreed_a_step_ahead(interval, write_steps):
    waits, agreed = _late_writes(interval, write_steps)
    assert waits and agreed == waits


def test_no_hold_when_the_writes_are_synchronous():
    policy = SavePolicy(2, async_save=False)
    policy.asked_for = 3
    assert not policy.hold_ahead(3, in_flight=False)
