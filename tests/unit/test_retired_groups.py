"""A process group a worker leaves is kept a while before its last reference goes (training/loop/regroup.py,
RetiredGroups): gloo's destructor joins its threads while the main thread holds the GIL, and a thread still
freeing the broken round's tensors needs it. The deadlock itself, and the fix, are shown by a stress of lost
peers then admissions (docs/DESIGN.md, "Where the code met real components"); this holds the keeping to its rules."""

from __future__ import annotations

import gc
import weakref

from training.loop.regroup import RetiredGroups


class Group:
    """Stands for a process group: all that matters is when the last reference goes."""


def test_a_left_group_lives_until_it_has_been_kept_long_enough_and_another_is_retired():
    now = [100.0]
    retired = RetiredGroups(keep_s=30.0, clock=lambda: now[0])
    first = Group()
    gone = weakref.ref(first)
    retired.retire(first)
    del first
    gc.collect()
    assert gone() is not None  # kept: its threads may still be finishing the broken round's work
    now[0] += 29.0
    retired.retire(None)  # a worker without a group retires nothing, and lets go of nothing young
    gc.collect()
    assert gone() is not None
    now[0] += 1.0
    second = Group()
    retired.retire(second)  # the next time a group is left, the old one goes
    gc.collect()
    assert gone() is None
    assert weakref.ref(second)() is not None
