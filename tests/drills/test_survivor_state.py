"""What a survivor of a lost node keeps, in one process: the step a broken group leaves, BatchNorm's
statistics, the optimizer's state, the checkpoint's optimizer settings, and the peer connections a broken
group shuts (issue 49). test_lost_node.py runs the same code with real agents.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from training.loop.lost_peer import GroupBroken

# untimed (tests/machine_turns.py): single-process steps and a socket check, nothing a busy neighbour could
# break; under -n it runs beside other tests (in test_lost_node.py it took 7 s of the machine alone).
pytestmark = pytest.mark.untimed
REPO_ROOT = Path(__file__).resolve().parents[2]


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
