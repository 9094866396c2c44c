"""The elastic training loop: resume, fixed global batch, checkpoint, stop cleanly, report.

Every (re)start of the worker group runs :func:`train` from the top: it reads its rank and
world size afresh, loads the newest complete checkpoint, and goes on from the exact sample
where that checkpoint stopped.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from training.loop import agreement
from training.loop import regroup
from training.loop import signals
from training.loop import spot
from training.data.batch_slots import BatchSlots, slot_count
from training.loop.broadcast import all_gather_objects, broadcast_state
from training.loop.checkpoint import CheckpointError, CheckpointManager
from training.config import TrainConfig
from training.contract import (
    CONTROL_DIR_ENV, EXIT_MEMBERSHIP_CHANGE, EXIT_REPLACE_NODE, PROGRESS_FILE_ENV, STOP_BUDGET_ENV, WRITING_MARKER,
    checkpoint_name, control_file,
)
from training.data.datasets import DataError, attention_mask, build_dataset, build_loader
from training.data.decode import build_decoder
from training.data.feed import DeviceFeed
from training.device import Runtime, detect
from training.loop.compile import compile_with_fallback, should_compile
from training.loop.evaluate import Evaluator
from training.loop.lost_peer import ABORT_WAIT_S, GroupGuard, StepLedger
from training.loop.metrics import MetricsWriter, stdout_is_for_people
from training.loop.objective import count_training_flops, global_loss_scale, learning_rate, per_sample_loss
from training.loop.optimizer import build_optimizer, load_optimizer_state
from training.loop.checkpointer import Checkpointer
from training.loop.rank_zero_io import RankZeroIO, file_bytes, tensor_bytes
from training.loop.save_policy import SavePolicy
from training.loop.resume import decide
from training.loop.state import Progress, TrainState, flops_key, rng_state, seed_all, set_rng_state, signature
from training.loop.replacement import Replacement, taint_own_node
from training.loop.stragglers import ForwardTimer, Place, Spread, StragglerWatch, spread_slots
from training.models import build_model
from training.data.sampler import ElasticBatchPlan, Layout, MicroBatchSampler, fixed_global_layout

log = logging.getLogger(__name__)
# Fault injection for tests: "<step>:<path>" raises a RuntimeError of the worker's own at that step, once
# (the file at <path> records that it did), as a bug of the job would.
RAISE_AT_STEP_ENV = "TRAINING_FAULT_RAISE_AT_STEP"


class Diverged(Exception):
    """The loss or the weights stopped being finite; nothing after the last good checkpoint was saved."""


@dataclass
class TrainResult:
    step: int
    loss: float | None
    stopped_by_signal: bool
    elapsed_s: float


class Trainer:
    def __init__(self, config: TrainConfig):
        self.config = config
        self.started = time.perf_counter()
        self.stop = signals.StopRequest()
        self.stop.install()
        self.membership = regroup.Membership.from_environment()
        self.runtime: Runtime = detect(config.train.device)
        # Seconds between SIGTERM and SIGKILL, as the launcher was told (the pod's grace less a margin).
        self.stop_budget_s = float(os.environ.get(STOP_BUDGET_ENV, "30"))
        self.spot = spot.SpotNotice(os.environ.get(spot.SPOT_NOTICE_ENV) == "imds"
                                       and self.membership.local_rank == 0)
        # The agent counts this round's training time from our first report (training/launcher/rendezvous.py).
        self._progress_file = os.environ.get(PROGRESS_FILE_ENV) if self.membership.local_rank == 0 else None
        control = os.environ.get(CONTROL_DIR_ENV)
        # Tells the agent a checkpoint is being written (training/launcher/agent.py waits for it before a SIGKILL).
        self._writing_marker = Path(control) / control_file(WRITING_MARKER, self.membership.local_rank) if control else None
        self.generation = 0  # rounds this process joined in place (regroups)
        self.regrouping = False  # the ranks agreed to stop for a regroup, not for good
        # Whether this process holds trained state (it resumed or started): a regroup's newcomers
        # do not, and receive it from the survivor furthest along (see _resume_from_peer).
        self.holds_state = False
        self.progress = Progress()
        self.flops_per_sample: float | None = None  # counted once per run, kept in the checkpoints
        self.attempt = ""  # this round's id, agreed at its start
        self.first_step = 0  # the step this round started at
        # The last round this process joined, (attempt, first step): where the state in memory was
        # trained, closed in the history when a peer takes the state over.
        self._segment = ("", 0)
        self._reported = False  # this process was rank 0 (the one that reports) in the last round it joined
        self.refused = False  # the agent found no lost peer after a failed collective: fail as it was

        # The model, its optimizer and the data outlive a regroup: only the world changes.
        torch.manual_seed(config.train.seed)  # identical initial weights on every rank
        self.module = build_model(config.model.name, config.model.num_classes, config.model.image_size)
        self.channels_last = config.model.channels_last and not config.model.is_masked_lm
        self.module.to(self.runtime.device)
        if self.channels_last:
            self.module.to(memory_format=torch.channels_last)
        self.precision = self.runtime.precision(config.train.precision)  # auto: bf16, or fp16 without bf16
        self.scaler = self.runtime.grad_scaler(self.precision)
        # Keeps its state through a lost peer: its updates are skipped once the group breaks
        # (training/loop/lost_peer.py), through a fused optimizer's found_inf, which fp16's scaler
        # uses for its own purpose; and the XLA group has neither.
        self.guard: GroupGuard | None = None
        self.ledger: StepLedger | None = None
        if (self.membership.distributed and not self.scaler.is_enabled() and self.runtime.kind in ("cpu", "cuda")
                and (self.runtime.backend != "nccl" or config.distributed.nccl_recovery)
                and regroup.recovers_from_lost_peers(self.runtime.backend, self._on_lost_peer)):
            self.guard = GroupGuard(self.runtime.device, self.runtime.backend)
            self.ledger = StepLedger(self.module, self.runtime.device)
        self.recovers = self.guard is not None
        # Every rank's own step time, each report; a rank far behind the median is named (stragglers.py).
        self.forward_timer = ForwardTimer(self.runtime.device)
        self.stragglers = StragglerWatch(config.metrics.straggler_margin, config.metrics.straggler_windows)
        # metrics.straggler_policy=replace: the same decision on every rank, acted on at its step (replacement.py).
        self.replacement = Replacement(config.metrics.straggler_policy)
        self.leaving = False  # this worker's node was replaced: it leaves the job (EXIT_REPLACE_NODE)
        self.retired_groups = regroup.RetiredGroups()  # the groups of rounds this process left
        self.optimizer = build_optimizer(self.module, config.optim, fused=self.recovers)
        vocab = getattr(getattr(self.module, "size", None), "vocab", None)
        self.decoder = build_decoder(config.data.decode, self.runtime.kind) if config.data.kind == "imagefolder" else None
        self.dataset = build_dataset(config, vocab, encoded=self.decoder is not None)
        classes = getattr(self.dataset, "classes", None)
        if classes is not None and len(classes) > config.model.num_classes:
            raise DataError(
                f"model.num_classes: got {config.model.num_classes}; allowed: at least {len(classes)}, "
                f"the number of class folders in {config.data.path}"
            )
        self.evaluator = Evaluator.build(config, self.runtime, self.module, self.dataset, self.channels_last)
        self._join_world()

    def _join_world(self) -> None:
        """Everything that depends on this round's ranks: the process group, the resume, the wrapped
        model, the batch layout. Run at the start and again after each regroup, with the same
        collectives in the same order as a newly started worker of the round."""
        config = self.config
        # The long first timeout covers the very first start only (first broadcast, compilation);
        # a restart resumes from a checkpoint and must notice a dead peer as soon as any step would.
        self.first_start = not CheckpointManager(config.checkpoint.dir).steps()
        regroup.init_process_group(
            self.runtime.backend, self.membership, self.runtime.device,
            config.distributed.startup_timeout_s if self.first_start else config.distributed.timeout_s,
        )
        self.distributed = dist.is_initialized()
        if self.guard is not None:
            self.guard.start_round()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        previous_metrics = getattr(self, "metrics", None)
        self.metrics = MetricsWriter(self.rank == 0, config.metrics.jsonl_path, config.metrics.tensorboard_dir,
                                     progress=stdout_is_for_people(config.metrics.stdout))
        checkpoint = config.checkpoint
        if self.generation == 0:
            self.checkpoints = CheckpointManager(checkpoint.dir, checkpoint.keep_last, checkpoint.async_save,
                                                 checkpoint.staging_dir)
            # Rank 0 decides when to save (the others never need to know the newest step on disk).
            self.checkpointer = Checkpointer(self.checkpoints, SavePolicy(checkpoint.interval_steps,
                                                                          checkpoint.async_save),
                                             self.metrics, self.stop_budget_s, self._writing_marker)
        else:
            # The same writer across rounds in this process: a write still in flight when a peer died
            # lands, is announced and is waited for at the end like any other.
            self.checkpointer.metrics = self.metrics
            self.checkpointer.policy.asked_for = -1  # a save asked for in the old round was never agreed
        if previous_metrics is not None:
            # Closed only now: a write in flight when a peer died announces itself through it meanwhile.
            previous_metrics.close()
        self.resumed_from: int | None = None
        self._saved_step: int | None = None
        self._bad_pending = 0  # samples skipped on this rank since the last count across ranks
        self._nonfinite: Tensor | None = None  # single process: a non-finite loss seen since the last check
        self.agreement = agreement.LaggedAgreement(self.runtime.collective_device)
        self._hold = False  # several ranks: all wait, at this step, for rank 0's write in flight
        # Agreed before the resume: it names this round's keys in the store that the other ranks
        # wait in while rank 0 reads or writes a checkpoint.
        self.attempt = self._agree_on_attempt_id()
        self.rank_zero_io = RankZeroIO.for_group(f"checkpoint-io/{self.attempt}", checkpoint.min_throughput_mb_s,
                                                 self.runtime.collective_device)
        # Where each rank of this round runs, for the step events and straggler events (once per round).
        self.places = all_gather_objects(Place.here(), self.runtime.collective_device) if self.distributed \
            else [Place.here()]
        self.stragglers.reset()
        resume_event = self._resume_from_peer()
        if resume_event is None:
            resume_event = self._resume()
            self.checkpointer.policy.durable_step = self.progress.step
        self.holds_state = True
        self.first_step = self.progress.step
        if self.ledger is not None:
            self.ledger.start(self.progress.step)
        self._segment = (self.attempt, self.first_step)
        self._reported = self.rank == 0

        self.model: nn.Module = self.module
        if self.distributed:
            device_ids = [self.runtime.device.index] if self.runtime.kind == "cuda" else None
            self.model = DistributedDataParallel(self.module, device_ids=device_ids)
        if should_compile(config, self.runtime.kind):
            self.model = compile_with_fallback(self.model)

        self.layout, self.lr_scale, self.global_batch = self._batch_layout()
        self.plan = ElasticBatchPlan(len(self.dataset), self.global_batch, config.train.seed)
        self.sample_log = self._open_sample_log()
        self._resume_event = resume_event

    def rejoin(self, broken: BaseException | None = None) -> None:
        """Join the next round without a new process, keeping the model, optimizer and data.

        Either the agent asked (REGROUP_SIGNAL: nodes are admitted) and every rank stopped at one
        step, or ``broken``: a collective failed under this worker because a peer died. Leave the
        group, wait for this worker's place in the new round, join it, and take the state of the
        survivor furthest along (:meth:`_resume_from_peer`): a lost peer costs no step. When the
        agent finds no lost peer, the failure was the job's own, and ``broken`` is raised.
        """
        started = time.perf_counter()
        if broken is not None:
            self._settle_broken_step(broken)
        # Kept: the old DDP wrapper holds the group, and its destruction must wait (regroup.RetiredGroups).
        self.retired_groups.retire(regroup.leave_process_group())
        self.model = self.module
        if broken is not None and self.sample_log:
            self.sample_log.close()
        self.generation += 1
        log.info("left the round at step %d (%s); waiting for round %d", self.progress.step,
                 "a collective failed" if broken is not None else "a regroup", self.generation)
        try:
            env = regroup.await_membership(self.membership.local_rank, self.generation, self.stop, broken)
        except SystemExit:
            self._save_alone()
            raise
        if env is None:
            self.refused = True
            raise broken
        os.environ.update(env)
        self.membership = regroup.Membership.from_environment()
        self.stop.reset()
        self.regrouping = False
        self._join_world()
        self._resume_event["regroup_s"] = round(time.perf_counter() - started, 3)

    def _settle_broken_step(self, broken: BaseException) -> None:
        """After a failed collective: skip every update not yet run and end the group's hung work
        (GroupGuard.break_group; done already when the agent's signal or NCCL's error state came
        first), let the device run what was queued, and go back to the step the weights hold:
        its progress, its BatchNorm statistics (the forward passes of later steps changed them).
        Raises ``broken`` when that step is no longer known."""
        self.guard.break_group(f"{type(broken).__name__}: {regroup.first_line(broken)[:200]}")
        # Whatever fails from here ends the worker (it restarts from the checkpoint): not again.
        self.refused = True
        if not self.guard.wait_ended():
            raise broken
        if not self.guard.drained(ABORT_WAIT_S):
            log.error("the device did not finish the broken round's work within %.0f s of the abort; this worker "
                      "restarts from the checkpoint", ABORT_WAIT_S)
            raise broken
        self.optimizer.zero_grad(set_to_none=True)  # gradients of a step that did not count
        restored = self.ledger.restore(self.progress, self.optimizer)
        if restored is None:
            raise broken
        self.refused = False
        if restored.step != self.progress.step:
            log.warning("the weights hold step %d (steps up to %d were queued)", restored.step, self.progress.step)
        self.progress = restored

    def _on_lost_peer(self) -> None:
        """On the watcher thread, when the agent reports a lost peer (regroup.recovers_from_lost_peers)."""
        if self.guard is not None:  # None only while the worker starts
            self.guard.break_group("the agent reports a lost peer")

    def _check_group(self) -> None:
        """After reading a value the group reduced: it is not to be used if the group broke meanwhile."""
        if self.guard is not None:
            self.guard.check()

    def _received(self) -> None:
        """After a state sent over the group: with NCCL the broadcast returns before the device has
        the data, and a sender that dies mid-way leaves the buffers partly empty. Loaded only once
        the device has it all, and the group did not break meanwhile (then the round starts over)."""
        if self.guard is not None:
            self.guard.wait_for_device()

    def _save_alone(self) -> None:
        """A stop while paused between rounds: nothing was checkpointed for the regroup (the state
        goes to the next round from memory), so the last round's rank 0 writes what it holds, alone
        (its peers are stopping too; the other ranks' generators are not gathered, see _resume)."""
        steps = self.checkpoints.steps()
        if self.rank != 0 or not self.holds_state or (steps and steps[-1] >= self.progress.step):
            return
        self.checkpointer.write(self.progress.step, self._state_dict([rng_state()]), "stop", synchronous=True)

    def recoverable(self, error: BaseException) -> bool:
        """Whether ``error`` is a collective that failed under a worker whose state is whole: one of
        torch's distributed errors (RuntimeError, as gloo raises them; torch 2.13
        torch/distributed/__init__.py DistError), in a worker that recovers (:attr:`recovers`), with
        no stop asked for. The job's own errors (data, checkpoint, divergence) are not RuntimeErrors."""
        if not self.recovers or self.stop.requested or self.refused:
            return False
        # Once the group is broken, whatever the main thread meets next is its consequence: an NCCL
        # group aborted from the watcher thread has left the world ("Default process group has not
        # been initialized", a ValueError), a size read from a cut-short buffer may exhaust memory.
        if self.guard.broken.is_set():
            return True
        return isinstance(error, RuntimeError) and not isinstance(error, torch.OutOfMemoryError)

    # --- setup -----------------------------------------------------------------------------

    def _batch_layout(self) -> tuple[Layout, float, int]:
        train = self.config.train
        if train.batch_policy == "fixed_global":
            return fixed_global_layout(train.global_batch_size, self.world_size, train.micro_batch_size), 1.0, (
                train.global_batch_size
            )
        global_batch = self.world_size * train.micro_batch_size
        return Layout(self.world_size, 1, train.micro_batch_size), global_batch / train.global_batch_size, global_batch

    def _resume(self) -> dict[str, Any]:
        """One decision, made by rank 0 and followed by all: resume from which step, start fresh, or refuse.

        Rank 0 alone reads the file, while the others wait outside any collective (however long
        the read); the state reaches the other ranks by broadcast, so a restart reads each
        checkpoint once, not once per rank, and no rank can load another step.
        """
        started = time.perf_counter()
        decision = self.rank_zero_io.run(
            "read the checkpoint to resume", lambda: file_bytes(map(self.checkpoints.path, self.checkpoints.steps())),
            lambda: decide(self.checkpoints, signature(self.config), self.module.state_dict(),
                           self.config.checkpoint.if_unusable)) or {}
        summary = [{key: value for key, value in decision.items() if key != "state"}]
        if self.distributed:
            # The device named: without one, torch picks the host for a group that names no device
            # type of its own, as ProcessGroupXla, a Python ProcessGroup, does not (torch 2.8.0
            # torch/distributed/distributed_c10d.py, _get_object_coll_device), and the xla group
            # takes no host tensor.
            dist.broadcast_object_list(summary, src=0, device=self.runtime.collective_device)
        summary = summary[0]
        if summary["kind"] == "refuse":
            raise CheckpointError(summary["message"])
        if summary["kind"] == "fresh":
            return {"set_aside": summary["set_aside"]} if "set_aside" in summary else {}
        state = broadcast_state(decision.get("state"), self.runtime.collective_device)
        self._received()
        state = TrainState.from_state_dict(state)
        self.module.load_state_dict(state.model)
        load_optimizer_state(self.optimizer, state.optimizer, self.module)
        if self.scaler.is_enabled() and state.scaler:
            self.scaler.load_state_dict(state.scaler)
        self.progress = state.progress
        self.flops_per_sample = state.flops_for(flops_key(self.config))
        if self.rank < len(state.rng):
            set_rng_state(state.rng[self.rank])
        else:  # a rank that did not exist when the checkpoint was written
            seed_all(self.config.train.seed * 1009 + summary["step"] * 31 + self.rank)
        self.resumed_from = summary["step"]
        optim = self.config.optim
        written = (state.schedule.get("name"), state.schedule.get("base_lr"))
        if state.schedule and written != (optim.schedule, optim.lr):
            log.warning("the checkpoint was written with optim.schedule=%s optim.lr=%s; this job goes on with %s %s "
                        "from the same position in the schedule", *written, optim.schedule, optim.lr)
        return {"checkpoint": summary["path"], "read_s": round(summary["read_s"], 3),
                "load_s": round(time.perf_counter() - started, 3), "bytes_read": summary["bytes_read"],
                "skipped_unreadable": summary["unreadable"], "written_by_world_size": state.world_size,
                "written_with_global_batch": state.global_batch}

    def _resume_from_peer(self) -> dict[str, Any] | None:
        """After a regroup or a lost peer: go on from the state of the survivor furthest along, sent
        from its memory over the new group; nobody reads the checkpoint folder. None when no member
        holds trained state (every worker is new): then the newest checkpoint is read (:meth:`_resume`).

        A step that was in flight when a peer died completed on all survivors or on some: DDP
        averages the gradients before any rank updates, so a rank that stepped had every rank's
        gradients of that step, the dead peer's included. The survivors differ by at most that one
        step, and everyone takes the state of the first rank that holds the newest: completed
        steps are never trained again, and the step in flight counts once (its samples were logged
        by every rank before its all-reduce, see :meth:`_step`).
        """
        if not self.distributed:
            return None
        # What each member holds: its step (-1: nothing), the step it last evaluated at, its FLOPs count,
        # and whether it reported the last round (its rank 0: evaluations are reported there).
        mine = (self.progress.step, self.progress.evaluated_step, self.flops_per_sample, self._reported) \
            if self.holds_state else (-1, -1, None, False)
        members = all_gather_objects(mine, self.runtime.collective_device)
        self._check_group()
        held = [int(step) for step, _, _, _ in members]
        newest = max(held)
        if newest < 0:
            return None
        started = time.perf_counter()
        source = held.index(newest)
        state = None
        if self.rank == source:
            progress = self.progress.closing(*self._segment)
            # Whether the newest step was evaluated is the reporter's word: an evaluation whose
            # all-reduce finished there was reported, and must not be reported twice.
            progress.evaluated_step = next((evaluated for step, evaluated, _, reported in members
                                            if reported and step == newest), progress.evaluated_step)
            state = {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                     "scaler": self.scaler.state_dict(), "progress": progress.state_dict(),
                     "flops_per_sample": next((flops for _, _, flops, _ in members if flops is not None), None)}
        sent = tensor_bytes(state) if state is not None else 0
        state = broadcast_state(state, self.runtime.collective_device, src=source)
        self._received()
        if self.rank != source:
            self.module.load_state_dict(state["model"])
            load_optimizer_state(self.optimizer, state["optimizer"], self.module)
            if self.scaler.is_enabled() and state["scaler"]:
                self.scaler.load_state_dict(state["scaler"])
        self.flops_per_sample = state["flops_per_sample"]
        self.progress = Progress.from_state_dict(state["progress"])
        if not self.holds_state:  # a newcomer: generators of its own, as a rank new to a checkpoint gets
            seed_all(self.config.train.seed * 1009 + newest * 31 + self.rank)
        if self.rank == 0 and not self.checkpoints.in_flight:
            steps = self.checkpoints.steps()  # a listing, no read: the interval runs from the newest on disk
            self.checkpointer.policy.durable_step = steps[-1] if steps else 0
        self.resumed_from = newest
        return {"checkpoint": None, "from_rank": source, "steps_held": held, "bytes_read": 0,
                "bytes_from_peer": sent if self.rank == source else tensor_bytes(state),
                "load_s": round(time.perf_counter() - started, 3)}

    def _agree_on_attempt_id(self) -> str:
        attempt = [uuid.uuid4().hex[:12]]
        if self.distributed:
            dist.broadcast_object_list(attempt, src=0, device=self.runtime.collective_device)
            self._check_group()
        return attempt[0]

    def _open_sample_log(self):
        directory = self.config.metrics.sample_log_dir
        if not directory:
            return None
        Path(directory).mkdir(parents=True, exist_ok=True)
        return open(Path(directory) / f"samples-{self.attempt}-rank{self.rank}.jsonl", "a", buffering=1)

    # --- the loop --------------------------------------------------------------------------

    def run(self) -> TrainResult:
        """This round: announce it, train until the end or an agreed stop, save, report."""
        cfg = self.config
        self._announce_round()
        run = _Run(first_step=self.progress.step, flops_per_sample=self._count_flops() if self.rank == 0 else None,
                   paced_gc=bool(cfg.train.gc_every_steps) and gc.isenabled())
        self.metrics.total_steps = cfg.train.max_steps or cfg.train.epochs * self.plan.steps_per_epoch
        self._evaluate(run)  # one that a stop at a step due for it left to this round
        self.stop.training = True  # from here a stop signal checkpoints at the end of the step
        if self.stop.requested:
            log.warning("stop requested during startup")
        self.runtime.synchronize()  # the first window starts with nothing queued on the device
        run.window = _Window()
        self.forward_timer.take_s()  # the forward passes of a round before this one are not this window's
        slots = self._batch_slots()
        if run.paced_gc:
            gc.collect(1)
            gc.disable()
        try:
            while not run.stopped and self.progress.epoch < cfg.train.epochs and not self._reached():
                self._train_epoch(run, slots)
        finally:
            if slots is not None:
                slots.close()
            if run.paced_gc:
                gc.enable()
                gc.collect()  # what the loop left goes now, while all it refers to is alive, not at exit
        return self._finish(run)

    def _announce_round(self) -> None:
        self.metrics.event(
            "rendezvous", world_size=self.world_size, restart_count=self.membership.restart_count,
            run_id=self.membership.run_id, attempt=self.attempt, global_batch=self.global_batch,
            micro_batch=self.layout.micro_batch, accumulation=self.layout.accumulation,
            lr_scale=self.lr_scale, device=self.runtime.name, precision=self.precision,
        )
        if self.lr_scale != 1.0:
            log.warning("batch_policy=scale_lr: global batch %d, learning rate scaled by %.4f",
                        self.global_batch, self.lr_scale)
        self.metrics.event(
            "resume" if self.resumed_from is not None else "start",
            step=self.progress.step, epoch=self.progress.epoch, offset=self.progress.offset, **self._resume_event,
        )

    def _train_epoch(self, run: "_Run", slots: BatchSlots | None) -> None:
        """From the epoch's current offset to its end, or to an agreed stop."""
        cfg = self.config
        loader = build_loader(
            self.dataset, MicroBatchSampler(self.plan, self.progress.epoch, self.progress.offset, self.rank, self.layout),
            cfg,
            # Pinned on the feed thread, not by the DataLoader's pin thread: on an H100 that
            # thread cost a ResNet-50 step 17 % (benchmarks/throughput.py, section feed).
            pin_memory=False, slots=slots,
        )
        feed = DeviceFeed(loader, self.runtime, self.channels_last, self.decoder, cfg.model.image_size,
                          pin=self.runtime.kind == "cuda" and not (slots and slots.pinned), slots=slots,
                          attention_mask=attention_mask if cfg.model.is_masked_lm else None)
        try:
            while not run.stopped and self.progress.offset < self.plan.dataset_size and not self._reached():
                self._train_step(run, feed)
        finally:
            feed.close()  # a fetch in flight ends before its loader does
        if not run.stopped and self.progress.offset >= self.plan.dataset_size:
            self.progress.epoch += 1
            self.progress.offset = 0

    def _train_step(self, run: "_Run", feed: DeviceFeed) -> None:
        """The loop body: a step, the ranks' agreement on it, then report, stop or checkpoint as agreed."""
        # The epoch's last global batch is short, padded with weight-0 samples: only real ones count.
        real = self.plan.real_samples(self.progress.offset)
        _injected_fault(self.progress.step)
        loss, data_wait, step_time = self._step(feed)
        run.window.add(loss, data_wait, real)
        run.samples += real
        self._after_step(run, step_time)
        stop_now, notice, save_now = self._agree(loss)
        # The run's last step reports here too, before the loader's workers are torn down: that
        # teardown is not training time (on an H100 it took 5-10 % of a 40-step window).
        if self.progress.step % self.config.train.log_every_steps == 0 or self._last_step():
            run.last_loss = self._report(run.window, run.flops_per_sample)
        if self.replacement.pending is not None and not (stop_now or notice):
            self._replace_node(run)
            return
        if not (stop_now or notice):  # a stop or a spot notice saves first, within its budget
            stop_now = self._evaluate(run, yielding=True)
        if stop_now:
            if self.regrouping:  # the state goes to the new round from memory (rejoin): no checkpoint
                self._count_bad_samples()  # what _save would have counted, all ranks at this step
            else:
                self._save(synchronous=True, reason="stop")
            run.stopped = True
            return
        if notice:
            self.spot.acted()
            self._save(synchronous=True, reason="spot-notice")
            self._evaluate(run)  # after the checkpoint: the two-minute notice is for saving
        elif save_now:
            self._save(synchronous=False)
        self._keep_loss_bound()
        if run.paced_gc and self.progress.step % self.config.train.gc_every_steps == 0:
            gc.collect(1)

    def _evaluate(self, run: "_Run", yielding: bool = False) -> bool:
        """Validate at this step if eval.every_steps or the run's end asks and it was not done yet
        (training/loop/evaluate.py); its time is left out of the report window's.

        ``yielding``: the evaluation gives way to a stop or a regroup asked for meanwhile, which
        every rank agrees on as it goes: True then, and the caller stops at this step (the
        evaluation, not done, runs again when the job resumes here)."""
        at_end = self._last_step() or self.progress.epoch >= self.config.train.epochs
        if (self.evaluator is None or self.progress.evaluated_step == self.progress.step
                or not self.evaluator.due(self.progress.step, at_end)):
            return False
        started = time.perf_counter()
        figures = self.evaluator.evaluate(self.progress.step, self.progress.epoch, self.metrics,
                                          self._asked_to_stop if yielding else None, reduced=self._check_group)
        spent = time.perf_counter() - started
        run.eval_s += spent
        if run.window is not None:
            run.window.started += spent
        if figures is None:
            return True
        run.last_eval = {"step": self.progress.step, "epoch": self.progress.epoch, **figures}
        self.progress.evaluated_step = self.progress.step
        return False

    def _asked_to_stop(self) -> bool:
        """During an evaluation: has any rank been asked to stop or regroup? (All ranks ask together.)"""
        stop, regroup_asked = agreement.any_rank(self.stop.requested, self.stop.regroup,
                                                 device=self.runtime.collective_device)
        self._check_group()
        self.regrouping = regroup_asked and not stop
        return stop or regroup_asked

    def _after_step(self, run: "_Run", step_time: float) -> None:
        """Tell the agent this round trains (its first step), shorten the collectives' timeout once
        the first start is warm, and keep the step time the checkpointer plans its writes with."""
        if self.progress.step == run.first_step + 1:
            self._report_progress()
        if (self.distributed and self.first_start
                and self.progress.step - self.first_step == self.config.distributed.warmup_steps):
            regroup.shorten_timeout(self.config.distributed.timeout_s)
        self.checkpointer.stepped(self.progress.step, step_time)

    def _finish(self, run: "_Run") -> TrainResult:
        """After the loop: settle the agreement, save the end of a finished run, report, close."""
        if self.distributed:
            self.agreement.settle()
        if not run.stopped:
            if run.window.steps:
                run.last_loss = self._report(run.window, run.flops_per_sample)
            if self._saved_step != self.progress.step:
                self._save(synchronous=True, reason="finished")
        self.checkpoints.wait()
        elapsed = time.perf_counter() - run.started
        training_s = elapsed - run.eval_s  # the mean rate is training's: evaluation is reported apart
        newest = self.checkpoints.steps()
        self.metrics.event("stop" if run.stopped else "finished", step=self.progress.step,
                           signal=self.stop.signal_name, by_peer=run.stopped and not self.stop.requested,
                           # a stop to change rounds in place (nodes came or went): no checkpoint,
                           # the state goes on in memory, and this process trains on in the next round
                           regroup=run.stopped and self.regrouping,
                           bad_samples=self.progress.bad_samples, elapsed_s=round(elapsed, 3),
                           samples_per_s=round(run.samples / training_s, 2) if training_s > 0 else None,
                           loss=run.last_loss, eval=run.last_eval, eval_s=round(run.eval_s, 3),
                           checkpoint=str(self.checkpoints.path(newest[-1])) if newest else None)
        self.metrics.close()
        if self.sample_log:
            self.sample_log.close()
        return TrainResult(self.progress.step, run.last_loss, run.stopped, time.perf_counter() - self.started)

    def _batch_slots(self) -> BatchSlots | None:
        """On CUDA, with loader workers and decoded inputs: page-locked shared slots that the
        workers fill, so this process neither unpickles nor pins the batches (see batch_slots)."""
        data = self.config.data
        if self.runtime.kind != "cuda" or not data.num_workers or self.decoder is not None:
            return None
        slots = BatchSlots(slot_count(data.num_workers, data.prefetch_factor), self.layout.micro_batch,
                           self.dataset.placeholder(), pin_for=self.runtime.device)
        log.info("batch slots: %d of %d samples, %d MiB%s", slots.count, slots.batch_size, slots.nbytes >> 20,
                 " page-locked" if slots.pinned else "")
        return slots

    def _last_step(self) -> bool:
        """Has the step just taken ended the run (max_steps, or the last epoch's last batch)?"""
        return self._reached() or (
            self.progress.epoch == self.config.train.epochs - 1 and self.progress.offset >= self.plan.dataset_size)

    def _reached(self) -> bool:
        """train.max_steps, when set, is reached."""
        max_steps = self.config.train.max_steps
        return max_steps is not None and self.progress.step >= max_steps

    def _agree(self, loss: Tensor) -> tuple[bool, bool, bool]:
        """Stop? Spot notice? Save now? And is the loss finite? All in the step's one tiny all-reduce.

        With several ranks the all-reduce is read one step late (:class:`agreement.LaggedAgreement`),
        so the host never waits here for the device: a SIGTERM during step n checkpoints after
        step n + 1 on every rank (0 steps lost), and rank 0 asks one step ahead for the saves, so
        checkpoints land on the same steps as before, and whether all must wait for its write in
        flight (``_hold``, see :meth:`_keep_loss_bound`). The finiteness of the loss rides along as a
        device tensor; in a single process it is checked at the next report or save instead.
        """
        not_finite = ~torch.isfinite(loss)
        if not self.distributed:
            self._nonfinite = not_finite if self._nonfinite is None else self._nonfinite | not_finite
            self.regrouping = self.stop.regroup and not self.stop.requested
            save_now = self.rank == 0 and self.checkpointer.due(self.progress.step)
            return self.stop.requested or self.stop.regroup, self.spot.pending, save_now
        save_next = self.rank == 0 and self.checkpointer.ask_ahead(self.progress.step)
        hold_next = self.rank == 0 and self.checkpointer.hold_ahead(self.progress.step)
        agreed = self.agreement.exchange(self.stop.requested, self.spot.pending, save_next, not_finite,
                                         self.stop.regroup, hold_next)
        self._check_group()
        if agreed is None:  # the first step of this attempt: nothing was asked a step ago
            self._hold = False
            return False, False, False
        stop_now, notice, save_now, diverged, regroup_asked, self._hold = agreed
        if diverged:
            raise self._diverged()
        # A stop signal anywhere wins: the job (or this node) is going away, not changing size.
        self.regrouping = regroup_asked and not stop_now
        return stop_now or regroup_asked, notice, save_now

    def _keep_loss_bound(self) -> None:
        """Never train more than an interval past the newest checkpoint on disk. With several
        ranks, rank 0 waits for its write only at a step that all agreed on a step ahead, the
        others waiting for it outside any collective: a write that outlasts distributed.timeout_s
        then fails no collective."""
        if not self.distributed:
            self.checkpointer.keep_loss_bound(self.progress.step)
        elif self._hold:
            self.rank_zero_io.run("finish writing the checkpoint", self._state_bytes,
                                  lambda: self.checkpointer.keep_loss_bound(self.progress.step))

    def _state_bytes(self) -> int:
        return tensor_bytes(self.module.state_dict(), self.optimizer.state_dict())

    def _bytes_to_write(self) -> int:
        """What a synchronous save moves before it is done: its state, and first the rest of an
        asynchronous write still in flight (CheckpointManager.save waits for it), at most as big."""
        return self._state_bytes() * (2 if self.checkpoints.in_flight else 1)

    def _diverged(self) -> Diverged:
        steps = self.checkpoints.steps()
        kept = checkpoint_name(steps[-1]) if steps else "none yet"
        return Diverged(f"the loss is not finite at step {self.progress.step}; nothing was saved after the newest "
                        f"checkpoint ({kept}); allowed: resume with a lower optim.lr or an optim.grad_clip_norm, or "
                        "check the data")

    def _check_finite(self) -> None:
        """Before a save or a report: the loss (single process) and the weights are finite."""
        if self._nonfinite is not None:
            seen, self._nonfinite = bool(self._nonfinite), None
            if seen:
                raise self._diverged()

    def _weights_finite(self) -> bool:
        flags = [torch.isfinite(p).all() for p in self.module.parameters()]
        return bool(torch.stack(flags).all()) if flags else True

    def _step(self, feed: DeviceFeed) -> tuple[Tensor, float, float]:
        cfg = self.config
        started = time.perf_counter()
        if self.ledger is not None:
            # The progress and BatchNorm statistics from before this step: a step that does not
            # complete (a peer died in its all-reduce) still runs its forward passes.
            self.ledger.before_step(self.progress, self.optimizer)
        if cfg.train.max_steps:
            total_steps, done = cfg.train.max_steps, self.progress.step / cfg.train.max_steps
        else:
            total_steps = cfg.train.epochs * self.plan.steps_per_epoch
            done = (self.progress.epoch * self.plan.dataset_size + self.progress.offset) / (
                cfg.train.epochs * self.plan.dataset_size
            )
        lr = learning_rate(cfg, done, total_steps, self.lr_scale)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        masked_lm = cfg.model.is_masked_lm
        # A masked LM's loss is the mean over the global batch's masked tokens: the step's
        # micro-batches are taken first, to count them (objective.global_loss_scale).
        batches = [feed.take() for _ in range(self.layout.accumulation)] if masked_lm else None
        # Each rank's loss is scaled so that DDP's mean over ranks gives the mean over the global
        # batch's real samples (or masked tokens), whatever the world size and the padding.
        scale = global_loss_scale(batches, self.plan.real_samples(self.progress.offset), self.world_size)
        loss_sum = torch.zeros((), device=self.runtime.device)
        ids: list[int] = []
        skipped: list[int] = []
        for micro in range(self.layout.accumulation):
            batch = batches[micro] if batches else feed.take()
            if any(batch.problems):
                skipped += self._skip(batch.index, batch.problems)
            final = micro == self.layout.accumulation - 1
            if self.sample_log:
                ids += batch.index[batch.host_weight > 0].tolist()
                if final:
                    # Before the step's all-reduce: a rank that dies in it has logged what it
                    # contributed, and the step counts (or not) by the survivors' progress alone.
                    self._log_samples(ids, skipped)
            no_sync = self.model.no_sync() if self.distributed and not final else contextlib.nullcontext()
            with no_sync:
                self.forward_timer.start()
                with self.runtime.autocast(self.precision):
                    losses = per_sample_loss(self.model, batch.inputs, batch.target, masked_lm,
                                             cfg.data.masked_per_sequence, batch.attention_mask, cfg.label_smoothing)
                self.forward_timer.stop()
                loss = (losses * batch.weight.to(losses.dtype)).sum() * scale
                self.scaler.scale(loss).backward()
            loss_sum += loss.detach() / self.world_size
            if not final:
                feed.ahead()  # the next micro-batch's copy runs while this backward computes
        if cfg.optim.grad_clip_norm:
            self.scaler.unscale_(self.optimizer)
            nn.utils.clip_grad_norm_(self.module.parameters(), cfg.optim.grad_clip_norm)
        if self.guard is not None:
            # Read on the device after the step's all-reduce: 1 once the group broke (lost_peer.py).
            skip = self.guard.step_skip()
            self.optimizer.found_inf = skip  # the GradScaler protocol of torch.optim (sgd.py, adam.py)
            try:
                self.optimizer.step()
            finally:
                del self.optimizer.found_inf
            self.ledger.after_update(skip)
        else:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        # The steps queued; the device may run behind, and the ledger knows which it applied.
        self.progress.step += 1
        self.progress.offset += self.global_batch
        self.optimizer.zero_grad(set_to_none=True)
        feed.ahead()  # the next step's first batch, while this one's work runs on the device
        data_wait, feed.data_wait_s = feed.data_wait_s, 0.0
        self.runtime.mark_step()
        return loss_sum, data_wait, time.perf_counter() - started

    def _log_samples(self, ids: list[int], skipped: list[int]) -> None:
        extra = f', "skipped": {skipped}' if skipped else ""
        self.sample_log.write(f'{{"attempt": "{self.attempt}", "step": {self.progress.step}, '
                              f'"epoch": {self.progress.epoch}, "ids": {ids}{extra}}}\n')

    def _skip(self, index: Tensor, problems: list[str]) -> list[int]:
        """Samples that could not be read: named in the log, counted, trained as weight-0 padding."""
        skipped = []
        for sample, problem in zip(index.tolist(), problems, strict=True):
            if problem:
                log.warning("skipping sample %d at step %d: %s", sample, self.progress.step, problem)
                skipped.append(sample)
        self._bad_pending += len(skipped)
        return skipped

    def _count_bad_samples(self, reduced_pending: float | None = None) -> None:
        """Add the skipped samples of all ranks to the run's count; too many ends the run, naming the limit."""
        if reduced_pending is None:
            reduced_pending = float(self._bad_pending)
            if self.distributed:
                total = torch.tensor([reduced_pending], device=self.runtime.collective_device)
                dist.all_reduce(total)
                reduced_pending = float(total.item())
                self._check_group()
        self._bad_pending = 0
        self.progress.bad_samples += round(reduced_pending)
        limit = self.config.data.max_bad_samples
        if self.progress.bad_samples > limit:
            raise DataError(
                f"data.max_bad_samples: {self.progress.bad_samples} samples could not be read, more than the "
                f"allowed {limit} (the log names each file); allowed: repair or remove them (prepare-imagenet "
                "--verify lists them), or raise data.max_bad_samples")

    def _report(self, window: "_Window", flops_per_sample: float | None) -> float:
        self._check_finite()
        totals = torch.stack([window.loss_sum.float().reshape(()),
                              torch.tensor(float(self._bad_pending), device=self.runtime.device)])
        spread = self.distributed and self.forward_timer.measures
        if spread:  # this rank's own step time rides on the window's one all-reduce
            self.runtime.synchronize()  # the window's forward passes have run: their events can be read
            own_step_s = (window.data_wait + self.forward_timer.take_s()) / window.steps
            totals = torch.cat([totals, spread_slots(own_step_s, self.rank, self.world_size, self.runtime.device)])
        if self.distributed:
            dist.all_reduce(totals)
        self.runtime.synchronize()
        loss_total, bad, *per_rank = totals.tolist()
        self._check_group()
        self._count_bad_samples(bad)
        rank_fields = self._rank_spread(per_rank) if spread else {}
        # Wall clock between two synchronized points: the device has finished every step of the
        # window (a CPU-side timer around each step would miss the work still queued on a GPU).
        elapsed = window.elapsed()
        mean_loss = loss_total / window.steps
        samples_per_s = window.samples / elapsed if elapsed else 0.0
        peak = self.runtime.peak_memory_bytes()
        mfu = None
        if flops_per_sample and self.runtime.peak_flops:
            mfu = samples_per_s * flops_per_sample / (self.runtime.peak_flops * self.world_size)
        self.metrics.step(
            step=self.progress.step, epoch=self.progress.epoch, loss=round(mean_loss, 6),
            lr=self.optimizer.param_groups[0]["lr"], samples_per_s=round(samples_per_s, 2),
            samples_per_s_per_device=round(samples_per_s / self.world_size, 2),
            step_time_s=round(elapsed / window.steps, 4),
            data_wait_pct=round(100 * window.data_wait / elapsed, 2) if elapsed else 0.0,
            peak_memory_gib=round(peak / 2**30, 3) if peak else None,
            world_size=self.world_size, restart_count=self.membership.restart_count,
            mfu=round(mfu, 6) if mfu is not None else None, bad_samples=self.progress.bad_samples, **rank_fields,
        )
        window.reset()
        self._report_progress()
        return mean_loss

    def _rank_spread(self, per_rank: list[float]) -> dict[str, Any]:
        """The step event's spread of the ranks' own step times; a ``straggler`` event for a rank
        that stayed over the median by the configured margin."""
        spread = Spread.of(per_rank)
        named = self.stragglers.observe(per_rank)
        for rank, times_median in named:
            place = self.places[rank]
            if self.rank == 0:  # every rank names it alike; one says so
                log.warning("rank %d (pod %s, node %s) is a straggler: its own step time is %.2f times the median's "
                            "for %d reports", rank, place.pod, place.node, times_median, self.stragglers.windows)
            self.metrics.event("straggler", step=self.progress.step, rank=rank, pod=place.pod, node=place.node,
                               instance=place.instance, own_step_s=round(per_rank[rank], 4),
                               median_s=round(spread.median_s, 4), times_median=round(times_median, 2),
                               windows=self.stragglers.windows)
        pods = [place.pod for place in self.places]
        decision = self.replacement.consider(named, pods, len(set(pods)))
        if decision is not None:
            place = self.places[decision.rank]
            log.warning("replacing the node of rank %d (pod %s, node %s) at step %d: the job goes on with %d node(s), "
                        "then takes a new one in", decision.rank, place.pod, place.node, self.progress.step,
                        decision.nodes - 1)
            self.metrics.event("straggler_replaced", step=self.progress.step, rank=decision.rank, pod=place.pod,
                               node=place.node, instance=place.instance, nodes=decision.nodes)
        return spread.fields(self.places)

    def _replace_node(self, run: "_Run") -> None:
        """At the step the ranks decided to replace a straggler's node: all write the checkpoint (the
        leaving pod's stop checkpoint); its ranks taint their node and leave, the others leave their group
        and wait for the round without it, with their state in memory (train: rejoin)."""
        decision = self.replacement.take()
        self._save(synchronous=True, reason="replace")
        if self.places[self.rank].pod == decision.pod:
            if self.membership.local_rank == 0:
                try:
                    taint_own_node()
                except Exception as exc:  # noqa: BLE001 - the node leaves the job anyway; said, in one line
                    log.error("this node could not be tainted (%s); it leaves the job anyway", regroup.first_line(exc))
            self.leaving = True
        else:
            self.regrouping = True
        run.stopped = True

    def _report_progress(self) -> None:
        """Tell this node's agent that the round is training (the file's time is what it reads)."""
        if self._progress_file:
            Path(self._progress_file).write_text(str(self.progress.step))

    def _count_flops(self) -> float | None:
        """Forward+backward FLOPs of one sample, counted once per run on a copy of the model on the
        meta device: no memory, no compute, and the real model's weights, gradients and BatchNorm
        statistics are not touched. Kept in every checkpoint, so a restart does not count again."""
        if self.flops_per_sample is None:
            self.flops_per_sample = count_training_flops(self.config)
        return self.flops_per_sample

    # --- checkpoints -----------------------------------------------------------------------

    def _save(self, synchronous: bool, reason: str = "interval") -> None:
        # Never save, nor prune a good checkpoint for, a state that is not finite.
        self._check_finite()
        if not self._weights_finite():
            self._check_group()  # weights the abort left a step behind are finite but not this step's
            raise self._diverged()
        self._check_group()
        self._count_bad_samples()
        self._saved_step = self.progress.step
        rng = rng_state()
        states = [None] * self.world_size if self.rank == 0 else None
        if self.distributed and self.runtime.backend == "xla":
            states = all_gather_objects(rng, self.runtime.collective_device)  # ProcessGroupXla has no gather
        elif self.distributed:
            dist.gather_object(rng, states, dst=0)
        else:
            states = [rng]

        def write() -> None:
            self.checkpointer.write(self.progress.step, self._state_dict(states), reason, synchronous)

        if synchronous or not self.checkpoints.async_save:
            # Nobody goes on (or exits) before the checkpoint is on disk, and the others wait for
            # it outside any collective, however long the write takes.
            self.rank_zero_io.run("write the checkpoint", self._bytes_to_write, write)
        elif self.rank == 0:
            write()

    def _state_dict(self, rng_states: list[dict[str, Any]]) -> dict[str, Any]:
        """What a checkpoint of this moment holds (``rng_states``: the ranks' generators, in rank order)."""
        return TrainState(
            signature=signature(self.config), model=self.module.state_dict(), optimizer=self.optimizer.state_dict(),
            scaler=self.scaler.state_dict(), progress=self.progress.closing(self.attempt, self.first_step),
            rng=rng_states, flops_per_sample=self.flops_per_sample, flops_counted_for=flops_key(self.config),
            world_size=self.world_size, global_batch=self.global_batch,
            schedule={"name": self.config.optim.schedule, "base_lr": self.config.optim.lr,
                      "lr_scale": self.lr_scale, "lr": self.optimizer.param_groups[0]["lr"]},
        ).state_dict()

    def finish_writing(self) -> None:
        """A trainer on its way out (an error, a lost peer) waits, within its stop budget, for its write."""
        self.checkpointer.finish_writing()


def _injected_fault(step: int) -> None:
    fault = os.environ.get(RAISE_AT_STEP_ENV)
    if fault:
        at, done = fault.split(":", 1)
        if step >= int(at) and not Path(done).exists():
            Path(done).touch()
            raise RuntimeError(f"injected fault at step {step} ({RAISE_AT_STEP_ENV})")


@dataclass
class _Run:
    """One round's loop state, from :meth:`Trainer.run` to its end."""

    first_step: int
    flops_per_sample: float | None
    paced_gc: bool  # train.gc_every_steps: the loop collects garbage itself, at step boundaries
    started: float = field(default_factory=time.perf_counter)
    window: "_Window | None" = None
    samples: int = 0  # real samples trained this round (padding left out)
    last_loss: float | None = None
    last_eval: dict[str, Any] | None = None  # the figures of this round's latest evaluation
    eval_s: float = 0.0  # seconds this round spent evaluating
    stopped: bool = False


class _Window:
    """Sums over one logging interval, which starts and ends at points where the device was
    synchronized (the loop's start, each report)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.loss_sum: Tensor | float = 0.0
        self.steps = 0
        self.samples = 0
        self.data_wait = 0.0
        self.started = time.perf_counter()

    def add(self, loss: Tensor, data_wait: float, samples: int) -> None:
        self.loss_sum = loss if isinstance(self.loss_sum, float) else self.loss_sum + loss
        self.steps += 1
        self.samples += samples
        self.data_wait += data_wait

    def elapsed(self) -> float:
        """Seconds since the window started; call after synchronizing the device."""
        return time.perf_counter() - self.started


def train(config: TrainConfig) -> TrainResult:
    """Run (or resume) training to the end, or until a stop signal; exits 75 when a peer stopped.

    Under an agent that regroups in place, the worker lives through rounds: an admission
    (``regrouping``) and a lost peer (a collective failed: ``recoverable``) both move it to the next
    round with its state (:meth:`Trainer.rejoin`)."""
    trainer = Trainer(config)
    broken: BaseException | None = None
    rejoining = False
    while True:
        try:
            if rejoining:
                trainer.rejoin(broken)
            result = trainer.run()
        except BaseException as error:
            if not trainer.recoverable(error):
                # The process ends: a group whose peer is gone is not torn down (gloo's teardown then
                # waits on the dead peer for seconds, and the agent on it before it can re-form).
                trainer.finish_writing()
                raise
            log.warning("a collective failed at step %d (%s); keeping this worker's state for the round "
                        "without the lost peer", trainer.progress.step, regroup.first_line(error)[:200])
            # Its frames would keep the failed step's tensors (and the old group's objects) alive.
            error.__traceback__ = None
            broken, rejoining = error, True  # also when it failed while joining the next round
            continue
        if trainer.leaving:  # its node was replaced: its checkpoint is written, the others go on without it
            trainer.retired_groups.retire(regroup.leave_process_group())
            raise SystemExit(EXIT_REPLACE_NODE)
        if not (result.stopped_by_signal and trainer.regrouping):
            break
        broken, rejoining = None, True
    if dist.is_initialized():
        dist.destroy_process_group()
    if result.stopped_by_signal and not trainer.stop.requested:
        raise SystemExit(EXIT_MEMBERSHIP_CHANGE)
    return result
