"""A lost node costs the survivors no step (issue 49): real agents, a real etcd, CPU and gloo.

The survivors' collectives fail, they keep their state, the round re-forms without the dead
node, and the survivor furthest along hands its state to the others over the new group: nobody
reads the checkpoint folder and no step is trained again, wherever the kill lands. The figures at
2, 8 and 16 agents are benchmarks/elastic_recovery.py --lost-node's (docs/elasticity-and-checkpoints.md).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.drill_harness import EVAL_EVERY, MOMENTS, events, lost_node_drill, trainer_args
from trainctl.backends.local_cluster import Agent, wait_until
from training.loop.lost_peer import GroupBroken
from training.loop.trainer import RAISE_AT_STEP_ENV

pytestmark = pytest.mark.timeout(600)
REPO_ROOT = Path(__file__).resolve().parents[2]


def test_a_node_killed_during_a_checkpoint_write_costs_four_agents_no_step(tmp_path):
    result = lost_node_drill(tmp_path, 4, MOMENTS[1])
    assert result.steps_again == 0
    assert result.resumed_from == "memory" and result.bytes_read == 0
    assert result.write_landed  # the write in flight was rank 0's, which survived: it lands


def test_a_node_killed_during_an_evaluation_costs_no_step_and_the_evaluation_runs_once(tmp_path):
    result = lost_node_drill(tmp_path, 3, MOMENTS[2])
    assert result.steps_again == 0 and result.resumed_from == "memory"
    assert result.evaluation_again


def test_a_sigterm_during_an_evaluation_stops_every_rank_at_its_step_and_it_runs_after_the_resume(tmp_path, etcd_module):
    """The SIGTERM reaches one node's workers; the other's learn of it inside the evaluation (its
    few-batch agreement), so both leave it for the stop checkpoint at that step, and the survivor
    evaluates there once it resumes alone."""
    args = [a for a in trainer_args(tmp_path, 400_000) if a != "--eval.enabled=false"]
    args += [f"--eval.every_steps={EVAL_EVERY}", "--eval.synthetic_samples=200000", "--eval.batch_size=512",
             "--train.log_every_steps=1"]
    agents = [Agent(name, etcd_module, "eval-stop", tmp_path, args, max_nodes=2) for name in "ab"]
    try:
        step = wait_until(lambda: [e for e in events(tmp_path, "step") if e["world_size"] == 2
                                   and e["step"] % EVAL_EVERY == 0], "an evaluation starting", 180, agents,
                          poll=0.02)[0]
        time.sleep(0.3)
        terminated = agents[1].terminate()
        assert agents[1].wait(timeout=60) != 0
        resumed = wait_until(lambda: [e for e in events(tmp_path, "resume") if e["time"] > terminated], "the resume",
                             120, agents[:1])[0]
        evaluated = wait_until(lambda: [e for e in events(tmp_path, "eval") if e["step"] == step["step"]],
                               "the evaluation again", 120, agents[:1])
    finally:
        for agent in agents:
            agent.stop()
    stop = next(e for e in events(tmp_path, "checkpoint_started") if e["time"] > terminated)
    assert stop["reason"] == "stop" and stop["step"] == step["step"] == resumed["step"]
    assert len(evaluated) == 1 and evaluated[0]["time"] > resumed["time"] and evaluated[0]["samples"] == 200_000


def test_a_peer_that_stops_answering_without_closing_its_connections_costs_no_step(tmp_path, etcd_module):
    """A node that freezes (SIGSTOP: no connection reset, as after a power loss or a partition) leaves
    the survivors blocked in a collective until distributed.timeout_s (120 s on CPU). Its lease ends;
    the agents signal their workers (LOST_PEER_SIGNAL), whose watcher thread shuts the round's
    connections: the collectives fail at once and the survivors go on from memory."""
    args = [*trainer_args(tmp_path, 400_000), "--train.log_every_steps=1"]
    agents = [Agent(name, etcd_module, "frozen-peer", tmp_path, args, max_nodes=3) for name in "abc"]
    try:
        wait_until(lambda: len([e for e in events(tmp_path, "step") if e["world_size"] == 3]) >= 20,
                   "three nodes training", 180, agents)
        victim = next(a for a in reversed(agents) if '"event": "step"' not in a.output())
        frozen_at = time.time()
        os.killpg(victim.proc.pid, signal.SIGSTOP)
        first = wait_until(lambda: [e for e in events(tmp_path, "step") if e["time"] > frozen_at
                                    and e["world_size"] == 2], "the survivors training", 100, [])[0]
        resume = next(e for e in events(tmp_path, "resume") if e["time"] > frozen_at)
        outputs = [a.output() for a in agents if a is not victim]
    finally:
        os.killpg(victim.proc.pid, signal.SIGKILL)
        for agent in agents:
            agent.stop()
    assert resume["checkpoint"] is None and resume["bytes_read"] == 0
    assert first["time"] - frozen_at < 60  # not the collectives' 120 s timeout
    assert all("joined round 1 in place (no restart, recovery after a lost peer)" in out for out in outputs)
    assert any("the process group is broken (the agent reports a lost peer)" in out for out in outputs)


def test_a_workers_own_error_is_not_taken_for_a_lost_peer(tmp_path, etcd_module):
    """A RuntimeError of the job's own (not a dead peer) also breaks the collectives. With no lost peer
    to re-form without, its agent tells the worker so, and it fails with its error and restarts, as
    after any failure. (The other node's worker either is told the same, or, once the failed
    worker's restart has started a new round, keeps its state and hands it to the restarted one.)"""
    args = trainer_args(tmp_path, 400_000)
    fault = {RAISE_AT_STEP_ENV: f"60:{tmp_path}/fault-raised"}
    agents = [Agent("a", etcd_module, "own-error", tmp_path, args, max_nodes=2),
              Agent("b", etcd_module, "own-error", tmp_path, args, max_nodes=2, env=fault)]
    try:
        wait_until(lambda: (tmp_path / "fault-raised").exists(), "the fault", 180, agents)
        raised_at = time.time()
        wait_until(lambda: [e for e in events(tmp_path, "step") if e["time"] > raised_at and e["world_size"] == 2],
                   "training again", 180, agents)
        faulty = agents[1].output()
    finally:
        for agent in agents:
            agent.stop()
    assert "injected fault at step 60" in faulty
    assert "and no peer was lost; it fails with that error" in faulty
    assert "joined round 1 in place" not in faulty  # restarted, not moved with a state
    resume = next(e for e in events(tmp_path, "resume") if e["time"] > raised_at)
    # Nothing before the newest checkpoint is trained again. Which step that is depends on the write's
    # timing: the save policy starts a write early enough to land by the interval (its write lead,
    # training/loop/save_policy.py), so on a loaded machine the second save can be step 49, not 50.
    newest = max(e["step"] for e in events(tmp_path, "checkpoint_saved") if e["time"] < raised_at)
    assert newest > 0 and resume["step"] >= newest


def _guarded_trainer(tmp_path, max_steps: int):
    """A single-process trainer with the guard and the ledger a worker under the platform's launcher gets."""
    from training.config import load_train_config
    from training.loop.lost_peer import GroupGuard, StepLedger
    from training.loop.optimizer import build_optimizer
    from training.loop.trainer import Trainer

    config = load_train_config(None, [
        "--model.name=resnet18", "--model.image_size=16", "--model.num_classes=4", "--data.synthetic_samples=64",
        "--data.num_workers=0", "--train.global_batch_size=8", "--train.micro_batch_size=8",
        f"--train.max_steps={max_steps}", "--train.precision=fp32", "--train.device=cpu", "--eval.enabled=false",
        f"--checkpoint.dir={tmp_path}/c", "--checkpoint.interval_steps=1000",
    ])
    trainer = Trainer(config)
    trainer.recovers = True
    trainer.guard = GroupGuard(trainer.runtime.device, "gloo")
    trainer.ledger = StepLedger(trainer.module, trainer.runtime.device)
    trainer.ledger.start(trainer.progress.step)
    trainer.optimizer = build_optimizer(trainer.module, config.optim, fused=True)
    return trainer


def _snapshot(trainer):
    return ([p.detach().clone() for p in trainer.module.parameters()],
            [b.clone() for b in trainer.module.buffers()])


def _same(tensors, others):
    return all(torch.equal(a, b) for a, b in zip(tensors, others, strict=True))


def test_a_step_that_fails_leaves_batchnorm_statistics_as_they_were(tmp_path):
    """gloo: the collective fails in the main thread, in the backward of step 2. Its forward updated
    BatchNorm's running statistics; the state a survivor hands on is the one before that step, as
    its weights and its step count are."""
    trainer = _guarded_trainer(tmp_path, max_steps=3)
    first = trainer._step
    kept = {}

    def fail_in_backward(feed):
        kept["state"] = _snapshot(trainer)
        trainer.scaler.scale = lambda loss: (_ for _ in ()).throw(RuntimeError("Connection closed by peer"))
        return first(feed)

    trainer._step = lambda feed: first(feed) if trainer.progress.step < 2 else fail_in_backward(feed)
    with pytest.raises(RuntimeError, match="closed by peer"):
        trainer.run()
    weights, buffers = kept["state"]
    assert not _same(trainer.module.buffers(), buffers)  # the failed step's forward moved the statistics
    trainer._settle_broken_step(RuntimeError("Connection closed by peer"))
    assert trainer.progress.step == 2
    assert _same(trainer.module.parameters(), weights) and _same(trainer.module.buffers(), buffers)


def test_a_group_broken_while_steps_are_queued_goes_back_to_the_step_the_weights_hold(tmp_path):
    """NCCL: the host queues steps ahead of the device, and a collective cut short by the abort ends
    without an error. Here the group breaks (the agent's signal, on the watcher thread) after the
    backward of step 3; the host goes on to queue step 4. Both updates read the flag and are
    skipped; the ledger then says the weights hold step 3 and puts back its progress and its
    BatchNorm statistics. Without the flag, the update of step 3 would run on the cut-short gradients."""
    trainer = _guarded_trainer(tmp_path, max_steps=5)
    kept = {}
    skip = trainer.guard.step_skip

    def break_at_step_3():
        if trainer.progress.step == 3 and not trainer.guard.broken.is_set():
            kept["state"] = _snapshot(trainer)
            kept["progress"] = trainer.progress.step, trainer.progress.offset
            thread = threading.Thread(target=trainer._on_lost_peer)
            thread.start()
            thread.join()
        return skip()

    trainer.guard.step_skip = break_at_step_3
    before_step = trainer.ledger.before_step

    def keep_statistics(progress, optimizer):
        if progress.step == 3:
            kept["statistics"] = [b.clone() for b in trainer.module.buffers()]  # before step 3's forward
        before_step(progress, optimizer)

    trainer.ledger.before_step = keep_statistics
    trainer._agree = lambda loss: (False, False, False)  # single process: no agreement to read
    trainer._report = lambda window, flops: 0.0
    with pytest.raises(GroupBroken, match="the agent reports a lost peer"):
        original = trainer._after_step

        def after(run, step_time):
            original(run, step_time)
            if trainer.progress.step == 5:
                trainer.guard.check()  # the host reads a reduced value at the end of step 4

        trainer._after_step = after
        trainer.run()
    assert trainer.progress.step == 5  # queued
    weights, _ = kept["state"]
    assert not _same(trainer.module.buffers(), kept["statistics"])  # steps 3 and 4's forward passes ran
    trainer._settle_broken_step(RuntimeError("the process group was aborted"))
    assert (trainer.progress.step, trainer.progress.offset) == kept["progress"]
    assert _same(trainer.module.parameters(), weights) and _same(trainer.module.buffers(), kept["statistics"])


def test_a_first_update_that_was_skipped_leaves_no_uninitialized_momentum(tmp_path):
    """SGD creates its momentum buffers empty and fills them in the first update: when that update
    is skipped, the ledger drops the optimizer's state, as it was before the step."""
    trainer = _guarded_trainer(tmp_path, max_steps=1)
    trainer._on_lost_peer()  # broken before the first update
    trainer._agree = lambda loss: (False, False, False)
    trainer._report = lambda window, flops: 0.0
    with pytest.raises(GroupBroken):  # at the end of the run: no checkpoint of a step the weights do not hold
        trainer.run()
    assert not list((tmp_path / "c").glob("step-*"))
    assert trainer.optimizer.state  # created by the skipped update
    trainer._settle_broken_step(RuntimeError("the process group was aborted"))
    assert trainer.progress.step == 0 and not trainer.optimizer.state


def test_a_checkpoint_written_by_another_optimizer_implementation_resumes_with_this_jobs():
    """torch's load_state_dict takes every setting of the saved groups, ``fused`` too: a checkpoint
    written without the fused optimizer (an older run, a job with no recovery) must not take away
    the update-skipping flag a recovering worker relies on."""
    from torch import nn

    from training.config import OptimSection
    from training.loop.optimizer import build_optimizer, load_optimizer_state

    module = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    written = build_optimizer(module, OptimSection())
    module(torch.ones(2, 4)).sum().backward()
    written.step()
    recovering = build_optimizer(module, OptimSection(), fused=True)
    load_optimizer_state(recovering, written.state_dict(), module)
    assert all(group["fused"] for group in recovering.param_groups)
    before = [p.detach().clone() for p in module.parameters()]
    recovering.found_inf = torch.ones(())
    recovering.step()  # skipped, not "Expected grad_scale and found_inf to be None"
    assert all(torch.equal(a, p) for a, p in zip(before, module.parameters(), strict=True))


def test_a_broken_group_shuts_this_process_s_tcp_connections_and_leaves_its_listeners_and_other_sockets():
    # In a process of its own: the suite's process holds connections of other tests.
    check = textwrap.dedent("""
        import socket
        from training.loop.regroup import shut_tcp_connections

        listener = socket.create_server(("127.0.0.1", 0))
        client = socket.create_connection(listener.getsockname())
        accepted, _ = listener.accept()
        datagram = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        local_a, local_b = socket.socketpair()  # AF_UNIX: not a peer's connection
        assert shut_tcp_connections() == 2  # the client end and the accepted end; nothing else
        assert client.recv(1) == b"" and accepted.recv(1) == b""  # both ends see the connection end
        late = socket.create_connection(listener.getsockname())  # the listener still accepts
        listener.accept()[0].close()
        local_a.sendall(b"x")
        assert local_b.recv(1) == b"x"
        assert client.fileno() >= 0  # the descriptors stay open for their owners
    """)
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
