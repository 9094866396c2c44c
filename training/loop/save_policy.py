"""When rank 0 checkpoints: a save is due early enough to be on disk one interval after the last,
and training never runs more than one interval past the newest checkpoint on disk."""

from __future__ import annotations


class SavePolicy:
    """Rank 0's checkpoint schedule. A kill loses at most ``interval_steps`` steps.

    An asynchronous save starts early by the whole steps the last write lasted (the write lead),
    so training rarely waits for one; when a write has not finished in time, it does.
    """

    def __init__(self, interval_steps: int, async_save: bool, durable_step: int = 0):
        self.interval_steps = interval_steps
        self.async_save = async_save
        self.durable_step = durable_step  # the newest step on disk
        self.write_lead = 0  # steps the last write lasted: start the next asynchronous one that early
        self.asked_for = -1  # several ranks: the step a save was asked for, a step ahead

    def due(self, step: int, in_flight: bool, steps_ahead: int = 0) -> bool:
        """Start a save at ``step`` (or that many steps ahead)?"""
        if in_flight:
            return False
        durable = self.durable_step
        if steps_ahead and self.asked_for == step:
            # The save asked for this step starts right after this question: a step later it is
            # still being written (asynchronous), or on disk.
            if self.async_save:
                return False
            durable = step
        return step + steps_ahead - durable >= max(1, self.interval_steps - self.write_lead)

    def ask_ahead(self, step: int, in_flight: bool) -> bool:
        """With several ranks the agreement is read a step late: ask for the save one step ahead."""
        asked = self.due(step, in_flight, steps_ahead=1)
        if asked:
            self.asked_for = step + 1
        return asked

    def must_wait(self, step: int, in_flight: bool) -> bool:
        """Before the next step: is a write in flight that must land first?"""
        return in_flight and step - self.durable_step >= self.interval_steps

    def hold_ahead(self, step: int, in_flight: bool) -> bool:
        """With several ranks, asked a step ahead so that every rank waits at the same step: may a
        write have to land after the next step (:meth:`must_wait` at ``step + 1``)? The write in
        flight now may, and so may the one asked for this step or the next (it starts after
        this question). A synchronous write is on disk before the step after it."""
        if not self.async_save:
            return False
        return (in_flight or self.asked_for >= step) and step + 1 - self.durable_step >= self.interval_steps

    def saved(self, step: int, write_s: float, recent_step_s: float | None) -> None:
        """A write of ``step`` is on disk; it took ``write_s``."""
        if recent_step_s and self.async_save:
            self.write_lead = min(self.interval_steps - 1, int(write_s / recent_step_s))
        self.durable_step = max(self.durable_step, step)
