"""Validation at step boundaries: top-1 and top-5 for image models, masked-LM accuracy and loss for BERT.

Exact at any world size. The validation set is cut into batches in index order and the batches
are dealt out to the ranks, none padded (:func:`~training.data.validation.rank_batches`), so
each sample is evaluated once and always in the same batch. Each batch's sums land in the row of
a table that bears its number; one all-reduce adds the ranks' tables, whose rows are each
filled by one rank (a sum with zeros, exact), so every world size ends with the same table and
sums it the same way: the same numbers as one process gets on the same hardware, to the last bit.

Evaluation is a pure function of the weights (rank 0's, which are the ones a checkpoint holds):
it keeps no state of its own, so it can yield to a stop (``yield_to``) and run again after the
resume, at the same step, with the same figures. The trainer records only the step it last evaluated at
(``Progress.evaluated_step``), so that a job stopped at a step before its evaluation there
makes it up when it resumes, and one resumed after it does not repeat it.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from training.config import TrainConfig
from training.data.datasets import IGNORE_LABEL, Keyed, attention_mask
from training.data.decode import collate
from training.data.feed import DeviceBatch, DeviceFeed
from training.data.validation import batch_count, build_validation_dataset, eval_batch_size, rank_batches
from training.device import Runtime
from training.loop.metrics import MetricsWriter

log = logging.getLogger(__name__)
# An evaluation asks its ``yield_to`` every this many batches (a tiny all-reduce with several ranks):
# a stop signal waits for at most that many batches, not for the whole validation set.
YIELD_EVERY_BATCHES = 4

# The columns of a batch's sums: sequences or images; images or masked tokens (what accuracy
# and loss are averaged over); summed loss; right at the top; within the top five; unreadable.
SAMPLES, UNITS, LOSS, TOP1, TOP5, SKIPPED = range(6)


def classification_sums(logits: Tensor, target: Tensor, valid: Tensor) -> Tensor:
    """One batch's [samples, samples, summed cross-entropy, top-1 hits, top-5 hits] over its
    ``valid`` samples. A hit is the target among the ``k`` highest logits, as torchvision's
    reference counts it (references/classification/utils.py, ``accuracy``: ``output.topk(maxk,
    1, True, True)``); with fewer than five classes, top-5 is top-all."""
    logits = logits.float()
    loss = F.cross_entropy(logits, target, reduction="none")
    hits = logits.topk(min(5, logits.shape[1]), dim=1).indices == target[:, None]
    zero = torch.zeros((), device=logits.device)
    count = valid.sum().float()
    return torch.stack([count, count, torch.where(valid, loss, zero).sum(),
                        (hits[:, 0] & valid).sum().float(), (hits.any(dim=1) & valid).sum().float()])


def masked_lm_sums(model: nn.Module, tokens: Tensor, labels: Tensor, mask: Tensor | None, valid: Tensor,
                   max_predictions: int) -> Tensor:
    """One batch's [sequences, masked tokens, summed cross-entropy, tokens predicted right, 0]
    over its ``valid`` sequences: original BERT's ``masked_lm_accuracy`` and
    ``masked_lm_loss``, means over the masked tokens (google-research/bert, run_pretraining.py,
    ``metric_fn``). The masked positions are gathered as training gathers them
    (BertForMaskedLM.forward: at most ``max_predictions`` a sequence, static shapes, no wait
    for the device to count them)."""
    hidden = model.encode(tokens, mask)
    positions = (labels != IGNORE_LABEL).float().topk(min(max_predictions, labels.shape[1]), dim=1,
                                                       sorted=False).indices
    picked = labels.gather(1, positions)
    states = hidden.gather(1, positions[..., None].expand(-1, -1, hidden.shape[-1]))
    logits = model.mlm_logits(states).float()
    real = (picked != IGNORE_LABEL) & valid[:, None]
    loss = F.cross_entropy(logits.flatten(0, 1), picked.flatten(), ignore_index=IGNORE_LABEL,
                           reduction="none").view_as(picked)
    right = (logits.argmax(dim=-1) == picked) & real
    zero = torch.zeros((), device=logits.device)
    return torch.stack([valid.sum().float(), real.sum().float(), torch.where(real, loss, zero).sum(),
                        right.sum().float(), zero])


class Evaluator:
    """The validation set of a run and how it is evaluated; :meth:`evaluate` at a step boundary."""

    def __init__(self, config: TrainConfig, runtime: Runtime, module: nn.Module, dataset: Dataset,
                 channels_last: bool):
        self.config, self.runtime, self.module, self.dataset = config, runtime, module, dataset
        self.channels_last = channels_last
        self.masked_lm = config.model.is_masked_lm
        self.batch_size = eval_batch_size(config)
        self.every_steps = config.eval.every_steps
        # Where the table is all-reduced: NCCL and the xla group reduce device tensors, gloo host ones.
        self.table_device = runtime.collective_device

    @classmethod
    def build(cls, config: TrainConfig, runtime: Runtime, module: nn.Module, train_set: Dataset,
              channels_last: bool) -> "Evaluator | None":
        """The run's evaluator, or None when evaluation is off (see build_validation_dataset)."""
        vocab = getattr(getattr(module, "size", None), "vocab", None)
        dataset = build_validation_dataset(config, vocab, train_set)
        if dataset is None:
            return None
        evaluator = cls(config, runtime, module, dataset, channels_last)
        every = f"every {evaluator.every_steps} steps and " if evaluator.every_steps else ""
        log.info("validation: %d samples in batches of %d, %sat the end", len(dataset), evaluator.batch_size, every)
        return evaluator

    def due(self, step: int, at_end: bool) -> bool:
        """Is step ``step`` one to evaluate at: a multiple of eval.every_steps, or the run's last?"""
        return step > 0 and (at_end or (self.every_steps > 0 and step % self.every_steps == 0))

    def evaluate(self, step: int, epoch: int, metrics: MetricsWriter,
                 yield_to: Callable[[], bool] | None = None,
                 reduced: Callable[[], None] = lambda: None) -> dict[str, Any] | None:
        """Evaluate the current weights on every rank (a collective: all ranks call it at the same
        step), report the figures as an ``eval`` event, and return them.

        ``yield_to``, asked every YIELD_EVERY_BATCHES batches at the same batches on every rank (it
        may be a collective: every rank asks as often, a rank out of batches too): True abandons
        the evaluation (None is returned, nothing reported). A long evaluation then never holds up
        a stop checkpoint; the evaluation runs again once the job resumes at this step.
        ``reduced`` runs once the sums are read back from the all-reduce, before they are reported."""
        started = time.perf_counter()
        distributed = dist.is_initialized()
        rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
        if distributed:
            self._take_rank_zeros_buffers()
        table = torch.zeros(batch_count(len(self.dataset), self.batch_size), SKIPPED + 1, dtype=torch.float64,
                            device=self.table_device)
        batches = rank_batches(len(self.dataset), self.batch_size, rank, world)
        was_training = self.module.training
        self.module.eval()  # BatchNorm's running statistics, no dropout
        try:
            # no_grad, not inference_mode: tensors made here may be cached and used by training
            # later (the feed's normalization constants, an lru_cache filled by the first batch,
            # a validation one when a resumed job evaluates first), and inference tensors can be
            # neither saved for backward nor changed in place outside inference_mode.
            with torch.no_grad():
                rounds = -(-table.shape[0] // world)  # the most batches a rank has
                if not self._fill(table, batches, rounds, yield_to):
                    log.warning("the evaluation at step %d yielded to a stop; it runs again on resuming", step)
                    return None
        finally:
            self.module.train(was_training)
        if distributed:
            dist.all_reduce(table)
        totals = table.sum(dim=0).tolist()  # the same table at any world size: the same sums
        reduced()  # raises when the group broke under the all-reduce: its sums are not to be reported
        figures = self._figures(totals)
        metrics.evaluation(step=step, epoch=epoch, **figures, eval_s=round(time.perf_counter() - started, 3))
        return figures

    def _take_rank_zeros_buffers(self) -> None:
        """Every rank evaluates rank 0's weights. The parameters are the same on every rank (DDP
        averages the gradients), but BatchNorm's running statistics are not: DDP copies rank 0's
        buffers to the others before each forward (torch/nn/parallel/distributed.py, torch
        2.13.0, ``_sync_buffers``: "The process with rank 0 is considered the authoritative
        copy"), after which each rank's own batch updates its copy. This is the copy DDP's next
        forward would make anyway, so training does not change."""
        for buffer in self.module.buffers():
            dist.broadcast(buffer, src=0)

    def _fill(self, table: Tensor, batches: list, rounds: int, yield_to: Callable[[], bool] | None) -> bool:
        """This rank's batches into ``table``; False when ``yield_to`` said to stop first. It is asked
        as often on every rank, a rank with fewer batches (or none) too: it may be a collective."""
        feed = self._feed(batches) if batches else None
        try:
            for turn in range(rounds):
                if turn and turn % YIELD_EVERY_BATCHES == 0 and yield_to is not None and yield_to():
                    return False
                if turn >= len(batches):
                    continue
                number = batches[turn][0]
                batch = feed.take()
                # The precision training runs in: train.precision resolved for this device (auto: bf16, or fp16).
                with self.runtime.autocast(self.runtime.precision(self.config.train.precision)):
                    sums = self._sums(batch)
                table[number, :SKIPPED] = sums.to(table.device, torch.float64)
                skipped = self._skipped(batch)
                if skipped:
                    table[number, SKIPPED] = skipped
                feed.ahead()  # the next batch, while this one's work runs on the device
        finally:
            if feed is not None:
                feed.close()
        return True

    def _feed(self, batches: list) -> DeviceFeed:
        data = self.config.data
        loader = DataLoader(
            Keyed(self.dataset), batch_sampler=[keys for _, keys in batches], num_workers=data.num_workers,
            prefetch_factor=data.prefetch_factor if data.num_workers else None, collate_fn=collate,
            # Its own generator: each iterator draws its workers' base seed from the loader's
            # generator, by default the global one (torch/utils/data/dataloader.py, torch 2.13.0,
            # _BaseDataLoaderIter), which training's dropout draws from: evaluating must not change it.
            generator=torch.Generator().manual_seed(0),
        )
        return DeviceFeed(loader, self.runtime, self.channels_last, pin=self.runtime.kind == "cuda",
                          attention_mask=attention_mask if self.masked_lm else None)

    def _sums(self, batch: DeviceBatch) -> Tensor:
        valid = batch.weight > 0
        if self.masked_lm:
            return masked_lm_sums(self.module, batch.inputs, batch.target, batch.attention_mask, valid,
                                  self.config.data.masked_per_sequence)
        return classification_sums(self.module(batch.inputs), batch.target, valid)

    @staticmethod
    def _skipped(batch: DeviceBatch) -> int:
        """Unreadable samples (weight 0, with what went wrong): named here, left out of the figures."""
        for index, problem in zip(batch.index.tolist(), batch.problems, strict=True):
            if problem:
                log.warning("skipping validation sample %d: %s", index, problem)
        return sum(1 for problem in batch.problems if problem)

    def _figures(self, totals: list[float]) -> dict[str, Any]:
        samples, units, loss = int(totals[SAMPLES]), int(totals[UNITS]), totals[LOSS]
        top1, top5 = int(totals[TOP1]), int(totals[TOP5])

        def share(count: float) -> float | None:
            return round(count / units, 6) if units else None

        figures: dict[str, Any] = {"samples": samples}
        if self.masked_lm:
            figures.update(masked_tokens=units, mlm_accuracy=share(top1), correct=top1)
        else:
            figures.update(top1=share(top1), top5=share(top5), correct_top1=top1, correct_top5=top5)
        figures.update(loss=share(loss), skipped=int(totals[SKIPPED]))
        return figures
