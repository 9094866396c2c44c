"""The elastic sampler: deterministic order per epoch, exact resume, every sample once, any world size."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from training.data.sampler import ElasticBatchPlan, Layout, MicroBatchSampler, fixed_global_layout


def run_segment(plan: ElasticBatchPlan, epoch: int, offset: int, world: int, steps: int, max_micro: int):
    """Train ``steps`` steps at ``world`` ranks; return (new offset, real ids seen, padded slots)."""
    layout = fixed_global_layout(plan.global_batch, world, max_micro)
    seen, padded = [], 0
    for start in list(plan.starts(offset))[:steps]:
        for rank in range(world):
            for micro in plan.rank_micro_batches(epoch, start, rank, layout):
                assert len(micro) == layout.micro_batch  # equal shapes on every rank
                seen += [k.index for k in micro if k.weight > 0]
                padded += sum(1 for k in micro if k.weight == 0)
        offset = start + plan.global_batch
    return offset, seen, padded


def test_a_2_then_1_then_3_worker_run_sees_every_sample_once_per_epoch():
    plan = ElasticBatchPlan(dataset_size=1000, global_batch=64, seed=3)  # 16 steps, the last one short
    seen: list[int] = []
    offset = 0
    for world, steps in ((2, 5), (1, 4), (3, 100)):  # a resume point after each change
        offset, ids, _ = run_segment(plan, 0, offset, world, steps, max_micro=10)
        seen += ids
    assert sorted(seen) == list(range(1000))


def test_the_global_batch_of_a_step_does_not_depend_on_the_world_size():
    plan = ElasticBatchPlan(1000, 64, seed=0)
    for world in (1, 2, 3, 5):
        layout = fixed_global_layout(64, world, 8)
        ids = sorted(k.index for r in range(world) for m in plan.rank_micro_batches(0, 128, r, layout)
                     for k in m if k.weight)
        assert ids == sorted(plan.global_batch_indices(0, 128))


def test_order_is_deterministic_per_epoch_and_differs_between_epochs():
    from training.data.sampler import epoch_order

    a, b = ElasticBatchPlan(500, 32, seed=7), ElasticBatchPlan(500, 32, seed=7)
    drawn_by_a = a.order(0).tolist()
    epoch_order.cache_clear()  # drawn again, as in another process (another rank, a later run)
    assert b.order(0).tolist() == drawn_by_a
    assert a.order(0).tolist() != a.order(1).tolist()
    assert sorted(a.order(1).tolist()) == list(range(500))


def test_resume_starts_at_the_exact_sample():
    plan = ElasticBatchPlan(300, 20, seed=1)
    layout = Layout(world_size=1, accumulation=1, micro_batch=20)
    full = [k.index for batch in MicroBatchSampler(plan, 2, 0, 0, layout) for k in batch if k.weight]
    resumed = [k.index for batch in MicroBatchSampler(plan, 2, 140, 0, layout) for k in batch if k.weight]
    assert resumed == full[140:]
    assert len(MicroBatchSampler(plan, 2, 140, 0, layout)) == 8


def test_layout_uses_the_fewest_micro_steps_that_fit():
    assert fixed_global_layout(256, 8, 32) == Layout(8, 1, 32)
    assert fixed_global_layout(256, 2, 32) == Layout(2, 4, 32)
    assert fixed_global_layout(256, 3, 32) == Layout(3, 3, 29)  # 261 slots: 5 padded, weight 0


def test_padding_has_weight_zero_and_keeps_ranks_equal():
    plan = ElasticBatchPlan(100, 64, seed=0)  # the second step has 36 real samples
    _, ids, padded = run_segment(plan, 0, 64, world=3, steps=1, max_micro=8)
    assert len(ids) == 36 and padded == 3 * 3 * 8 - 36
    assert plan.real_samples(64) == 36


def test_augmentation_seeds_do_not_depend_on_the_rank_that_reads_the_sample():
    plan = ElasticBatchPlan(100, 20, seed=5)
    one = {k.index: k.seed for m in plan.rank_micro_batches(0, 20, 0, Layout(1, 1, 20)) for k in m}
    three = {k.index: k.seed for r in range(3) for m in plan.rank_micro_batches(0, 20, r, Layout(3, 1, 7))
             for k in m if k.weight}
    assert one == three
    assert Counter(one.values()).most_common(1)[0][1] == 1


def test_an_offset_outside_the_epoch_is_rejected():
    with pytest.raises(IndexError):
        ElasticBatchPlan(10, 4, 0).global_batch_indices(0, 10)


@pytest.mark.parametrize(("global_batch", "world", "max_micro", "expected"), [
    (30, 1, 8, Layout(1, 5, 6)),  # the fewest micro-steps (4 x 8) would pad 2 samples
    (256, 2, 48, Layout(2, 4, 32)),  # 3 x 43 would pad 2
    (256, 8, 32, Layout(8, 1, 32)),  # already exact
    (256, 3, 32, Layout(3, 3, 29)),  # 3 does not divide 256: padding cannot be avoided
    (127 * 2, 2, 8, Layout(2, 16, 8)),  # no divisor within twice the micro-steps: keep the fewest
])
def test_layouts_avoid_padding_when_the_global_batch_allows(global_batch, world, max_micro, expected):
    layout = fixed_global_layout(global_batch, world, max_micro)
    assert layout == expected and layout.micro_batch <= max_micro and layout.slots >= global_batch


def test_a_new_plan_for_a_new_round_reuses_the_epochs_order(monkeypatch):
    """A worker that joins a round in place builds a new plan (training/loop/trainer.py, _join_world);
    the permutation is drawn once per epoch in the process, not at every regroup."""
    from training.data import sampler

    drawn = []
    randperm = torch.randperm
    monkeypatch.setattr(sampler.torch, "randperm", lambda *a, **k: drawn.append(a[0]) or randperm(*a, **k))
    sampler.epoch_order.cache_clear()
    first = ElasticBatchPlan(1000, 64, seed=3)
    before = first.global_batch_indices(0, 128)
    regrouped = ElasticBatchPlan(1000, 48, seed=3)  # a new round, another global batch
    assert regrouped.order(0) is first.order(0) and drawn == [1000]
    assert regrouped.global_batch_indices(0, 128)[:48] == before[:48]
    assert ElasticBatchPlan(1000, 64, seed=4).global_batch_indices(0, 128) != before  # another seed: drawn
    assert drawn == [1000, 1000]
