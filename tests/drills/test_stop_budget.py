"""The time a stopping job has: the SIGTERM budget, the Spot notice before it, the warm-up only once."""

from __future__ import annotations

import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from training.loop import regroup
from training.loop import spot
from training.contract import STOP_BUDGET_ENV
from training.loop.trainer import Trainer
from tests.drills.test_trainer_metrics import small_run


class FakeImds:
    """A loopback stand-in for the EC2 instance metadata service, IMDSv2 tokens and all."""

    TOKEN = "token-123"

    def __init__(self) -> None:
        self.interrupting = threading.Event()
        self.requests: list[tuple[str, str, dict]] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_args):
                pass

            def _answer(self, code: int, body: str = "") -> None:
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body.encode())

            def do_PUT(self):
                owner.requests.append(("PUT", self.path, dict(self.headers)))
                if self.path == "/latest/api/token" and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                    self._answer(200, FakeImds.TOKEN)
                else:
                    self._answer(400)

            def do_GET(self):
                owner.requests.append(("GET", self.path, dict(self.headers)))
                if self.headers.get("X-aws-ec2-metadata-token") != FakeImds.TOKEN:
                    self._answer(401)  # IMDSv2 only, as the launch template requires
                elif self.path == "/latest/meta-data/spot/instance-action" and owner.interrupting.is_set():
                    self._answer(200, json.dumps({"action": "terminate", "time": "2026-11-22T15:00:00Z"}))
                else:
                    self._answer(404)

        self.server = HTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


@pytest.fixture
def imds(monkeypatch):
    fake = FakeImds()
    monkeypatch.setenv(spot.IMDS_ENDPOINT_ENV, fake.endpoint)
    yield fake
    fake.close()


def events(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def test_the_notice_is_seen_through_imdsv2_only_once_ec2_schedules_the_interruption(imds):
    notice = spot.SpotNotice(enabled=True, interval_s=0.05)
    time.sleep(0.3)
    assert not notice.pending  # 404: no interruption scheduled
    imds.interrupting.set()
    deadline = time.monotonic() + 5
    while not notice.pending and time.monotonic() < deadline:
        time.sleep(0.05)
    assert notice.pending and notice.action == "terminate"
    assert all({k.lower(): v for k, v in headers.items()}.get("x-aws-ec2-metadata-token") == FakeImds.TOKEN
               for method, path, headers in imds.requests if method == "GET")
    notice.acted()
    assert not notice.pending


def test_a_spot_notice_checkpoints_at_the_next_step_and_training_goes_on(tmp_path, imds, monkeypatch):
    monkeypatch.setenv(spot.SPOT_NOTICE_ENV, "imds")
    imds.interrupting.set()  # the notice is already there when training starts
    Trainer(small_run(tmp_path, "--train.max_steps=8", "--checkpoint.interval_steps=100")).run()
    checkpoints = [e for e in events(tmp_path) if e["event"] == "checkpoint_started"]
    assert checkpoints[0]["reason"] == "spot-notice" and checkpoints[0]["asynchronous"] is False
    assert checkpoints[0]["step"] < 8 and events(tmp_path)[-1]["event"] == "finished"  # it went on training
    assert [c["reason"] for c in checkpoints].count("spot-notice") == 1


def test_a_spot_notice_saves_before_it_evaluates(tmp_path, imds, monkeypatch):
    # The two minutes are for the checkpoint: a step due for validation saves first, then validates.
    monkeypatch.setenv(spot.SPOT_NOTICE_ENV, "imds")
    imds.interrupting.set()
    Trainer(small_run(tmp_path, "--train.max_steps=4", "--checkpoint.interval_steps=100", "--eval.every_steps=1",
                      "--eval.synthetic_samples=16")).run()
    records = events(tmp_path)
    (saved_at,) = [i for i, e in enumerate(records) if e.get("reason") == "spot-notice"]
    evaluated_at = [i for i, e in enumerate(records) if e["event"] == "eval" and e["step"] == records[saved_at]["step"]]
    assert evaluated_at and saved_at < evaluated_at[0]


def test_off_ec2_or_without_the_notice_nothing_happens(tmp_path, imds, monkeypatch):
    monkeypatch.setenv(spot.SPOT_NOTICE_ENV, "imds")
    Trainer(small_run(tmp_path, "--train.max_steps=8", "--checkpoint.interval_steps=100")).run()
    assert "spot-notice" not in {e.get("reason") for e in events(tmp_path)}


def test_each_checkpoint_reports_its_write_time_against_the_sigterm_budget(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(STOP_BUDGET_ENV, "0.0001")  # no real write fits
    with caplog.at_level(logging.WARNING, logger="training.loop.trainer"):
        Trainer(small_run(tmp_path, "--checkpoint.interval_steps=2", "--checkpoint.async_save=false")).run()
    started = next(e for e in events(tmp_path) if e["event"] == "checkpoint_started")
    saved = next(e for e in events(tmp_path) if e["event"] == "checkpoint_saved")
    assert started["stop_budget_s"] == 0.0001 and saved["write_s"] >= 0 and saved["bytes"] > 0
    warnings = [r.getMessage() for r in caplog.records if "SIGTERM leaves before SIGKILL" in r.getMessage()]
    assert len(warnings) == 1  # said once, not at every checkpoint


def test_the_long_startup_timeout_is_for_the_very_first_start_only(tmp_path, monkeypatch):
    seen = []
    real = regroup.init_process_group
    monkeypatch.setattr(regroup, "init_process_group",
                        lambda backend, membership, device, timeout_s: seen.append(timeout_s) or real(
                            backend, membership, device, timeout_s))
    config = small_run(tmp_path, "--distributed.startup_timeout_s=900", "--distributed.timeout_s=45")
    Trainer(config).run()
    Trainer(small_run(tmp_path, "--distributed.startup_timeout_s=900", "--distributed.timeout_s=45",
                      "--train.max_steps=12")).run()
    assert seen == [900, 45]
