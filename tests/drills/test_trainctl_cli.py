"""trainctl for people (issue 17, item 7): wait, follow and watch a job, every worker's log,
earlier runs and recent lines, a job's checkpoints, --version, $TRAINCTL_CONFIG, options after the
subcommand, shell completion. Against the loopback API server, as users run it."""

from __future__ import annotations

import subprocess
import sys
import urllib.parse

import boto3
import pytest
from moto import mock_aws

from tests import trainctl_fixtures
from tests.conftest import REPO
from tests.unit.test_trainctl_kube import CONFIG

# untimed (tests/machine_turns.py): nothing a busy neighbour could break; under -n it runs beside other tests
pytestmark = pytest.mark.untimed

# The fixtures of tests/trainctl_fixtures.py (shared with test_operator_safety), under the names the tests ask for.
server = trainctl_fixtures.server
cli = trainctl_fixtures.cli

JOB = "k8s_charts/examples/resnet50-p4d.yaml"


def queries(server, suffix: str) -> list[dict]:
    return [urllib.parse.parse_qs(urllib.parse.urlsplit(path).query) for method, path, *_ in server.requests
            if urllib.parse.urlsplit(path).path.endswith(suffix)]


def test_submit_wait_returns_when_the_job_ends_with_its_outcome(cli, server):
    server.phases = ["Pending", "Running", "Running", "Completed"]
    code, out, err = cli("submit", JOB, "--wait", "--interval", "0.01", "--context", "lab")
    assert code == 0 and "submitted resnet50-imagenet" in out
    assert [line.split(": ", 1)[1].split(" (")[0] for line in err.splitlines()
            if not line.startswith(trainctl_fixtures.HEADER)] == ["Pending", "Running", "Completed"]
    server.jobs.clear()
    server.phases = ["Running", "Failed"]
    assert cli("submit", JOB, "--wait", "--interval", "0.01", "--context", "lab")[0] == 1


def test_submit_follow_streams_rank_0s_log_until_the_job_ends(cli, server):
    server.phases = ["Running", "Completed"]
    code, out, _ = cli("submit", JOB, "--follow", "--interval", "0.01", "--context", "lab")
    assert code == 0 and '"event": "checkpoint_saved"' in out
    assert any(q.get("follow", [""])[0].lower() == "true" for q in queries(server, "/pods/resnet50-imagenet-worker-0/log"))


def test_status_watch_refreshes_until_the_job_ends(cli, server):
    cli("submit", JOB, "--context", "lab")
    server.phases = ["Running", "Running", "Completed"]
    code, out, _ = cli("status", "resnet50-imagenet", "--watch", "--interval", "0.01", "--context", "lab")
    assert code == 0
    assert [line for line in out.splitlines() if line.startswith("job ")] == [
        "job resnet50-imagenet: Running", "job resnet50-imagenet: Running", "job resnet50-imagenet: Completed"]


def test_logs_of_every_worker_of_an_earlier_run_and_of_recent_minutes(cli, server):
    cli("submit", JOB, "--context", "lab")
    code, out, _ = cli("logs", "resnet50-imagenet", "--all", "--previous", "--since", "10m", "--context", "lab")
    assert code == 0
    assert "[resnet50-imagenet-worker-1] worker log" in out.splitlines()
    assert any(line.startswith('[resnet50-imagenet-worker-0] {"event": "step"') for line in out.splitlines())
    for query in queries(server, "/log"):
        assert query["previous"][0].lower() == "true" and query["sinceSeconds"] == ["600"]
    code, _, err = cli("logs", "resnet50-imagenet", "--since", "10 minutes", "--context", "lab")
    assert code == 2 and "allowed: a positive duration such as 90s, 10m, 2h or 1d" in err


def test_options_are_accepted_after_the_subcommand_and_the_config_comes_from_the_environment(cli, server, tmp_path):
    assert cli("list", "--context", "lab")[0] == 0
    code, _, err = cli("list", "--context", "lab", extra_env={"TRAINCTL_CONFIG": str(tmp_path / "mine.yaml")})
    assert code == 2 and f"config error: {tmp_path / 'mine.yaml'}: cannot read the file" in err


def test_version_and_completion():
    run = [sys.executable, "-m", "trainctl"]
    version = subprocess.run([*run, "--version"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert version.stdout.strip() == "trainctl 0.1.0"
    script = subprocess.run([*run, "completion", "bash"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert script.returncode == 0 and "complete" in script.stdout
    assert "stage-data" in script.stdout and "--all" in script.stdout
    checked = subprocess.run(["bash", "-n"], input=script.stdout, capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stderr


def test_checkpoints_of_a_job_are_listed_from_s3(monkeypatch, capsys):
    from trainctl import __main__ as trainctl

    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-west-2"}.items():
        monkeypatch.setenv(key, value)
    with mock_aws():
        s3 = boto3.client("s3", region_name="us-west-2")
        s3.create_bucket(Bucket="data", CreateBucketConfiguration={"LocationConstraint": "us-west-2"})
        for key in ("checkpoints/resnet50-imagenet/step-000001000.pt", "checkpoints/resnet50-imagenet/step-000000500.pt",
                    "checkpoints/resnet50-imagenet-2/step-000000100.pt", "checkpoints/resnet50-imagenet/notes.txt"):
            s3.put_object(Bucket="data", Key=key, Body=b"x" * 2**20)
        monkeypatch.setattr(trainctl, "stack_outputs", lambda *_args: ["data", "checkpoints/"])
        args = type("Args", (), {"name": "resnet50-imagenet", "profile": None})
        assert trainctl.list_checkpoints(args, CONFIG) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == ["s3://data/checkpoints/resnet50-imagenet/step-000000500.pt",
                                                 "s3://data/checkpoints/resnet50-imagenet/step-000001000.pt"]
    assert "1.0 MiB" in lines[0]


def test_list_and_status_print_json_and_yaml_for_scripts(cli, server):
    import json

    import yaml

    cli("submit", JOB, "--context", "lab")
    server.phases = ["Running"]
    code, out, _ = cli("list", "-o", "json", "--context", "lab")
    text = cli("list", "--context", "lab")[1].split()
    assert code == 0 and json.loads(out) == [{"name": "resnet50-imagenet", "state": text[1]}]
    code, out, _ = cli("status", "resnet50-imagenet", "--output", "yaml", "--context", "lab")
    report = yaml.safe_load(out)
    assert code == 0 and report["name"] == "resnet50-imagenet" and report["phase"] == "Running"
    assert report["finished"] is False and report["last_step"]["event"] == "step"
    assert {pod["pod"] for pod in report["pods"]} >= {"resnet50-imagenet-worker-0", "resnet50-imagenet-worker-1"}
    code, _, err = cli("list", "-o", "wide", "--context", "lab")
    assert code == 2 and "argument -o/--output: invalid choice: 'wide'" in err


def test_submit_dry_run_on_the_client_contacts_no_server_and_prints_the_manifests(cli, server):
    import yaml

    code, out, err = cli("submit", JOB, "--dry-run", "--context", "lab")
    assert code == 0, err
    assert [(obj["kind"], obj["metadata"]["name"]) for obj in yaml.safe_load_all(out)] == [("Job", "resnet50-imagenet")]
    assert server.requests == [] and server.jobs == {}


def test_submit_dry_run_on_the_server_is_admitted_there_and_stores_and_deletes_nothing(cli, server):
    code, out, err = cli("submit", JOB, "--dry-run=server", "--context", "lab")
    assert code == 0, err
    assert "resnet50-imagenet: the API server would accept it (server dry run, nothing created)" in err
    posts = [path for method, path, *_ in server.requests if method == "POST"]
    assert posts and all("dryRun=All" in path for path in posts) and server.jobs == {}
    cli("submit", JOB, "--context", "lab")
    stored = dict(server.jobs)
    code, _, err = cli("submit", JOB, "--dry-run=server", "--context", "lab")
    assert code == 2 and "already exists" in err  # what the real submit would say
    code, _, err = cli("submit", JOB, "--dry-run=server", "--replace", "--context", "lab")
    assert code == 0, err
    assert not [m for m, *_ in server.requests if m == "DELETE"] and server.jobs == stored
    server.refuse_create = (422, 'admission webhook "validatejob.volcano.sh" denied the request: bad')
    code, _, err = cli("submit", JOB, "--dry-run=server", "--replace", "--context", "lab")
    assert code == 2 and "denied the request" in err and server.jobs == stored


def test_logs_rank_is_the_pod_holding_that_rank_after_a_regroup_and_pod_is_the_index(cli, server):
    import json

    def ranks_line(at: float, ranks: range) -> str:
        return json.dumps({"event": "node_ranks", "time": at, "group_rank": ranks[0] // 8, "group_world_size": 2,
                           "global_ranks": list(ranks)})

    cli("submit", JOB, "--context", "lab")
    # worker-1 joined first after a regroup at t=50: it holds ranks 0-7 now, worker-0 holds 8-15.
    server.pod_logs = {
        "resnet50-imagenet-worker-0": "\n".join([ranks_line(10, range(8)), "pod 0 text", ranks_line(50, range(8, 16))]),
        "resnet50-imagenet-worker-1": "\n".join([ranks_line(10, range(8, 16)), "pod 1 text", ranks_line(50, range(8))]),
    }
    for args, pod_text in ((["--rank", "0"], "pod 1 text"), ([], "pod 1 text"), (["--rank", "9"], "pod 0 text"),
                           (["--pod", "0"], "pod 0 text"), (["--pod", "1"], "pod 1 text")):
        code, out, err = cli("logs", "resnet50-imagenet", *args, "--context", "lab")
        assert code == 0 and pod_text in out, (args, err)
    code, _, err = cli("logs", "resnet50-imagenet", "--rank", "16", "--context", "lab")
    assert code == 2 and "--rank: got 16, which no pod of resnet50-imagenet holds now" in err
    code, _, err = cli("logs", "resnet50-imagenet", "--pod", "2", "--context", "lab")
    assert code == 2 and "allowed: an index from 0 to 1" in err
    code, _, err = cli("logs", "resnet50-imagenet", "--all", "--rank", "1", "--context", "lab")  # not ignored
    assert code == 2 and "argument --rank: not allowed with argument --all" in err


def test_submit_to_a_cluster_without_volcano_is_one_line_and_creates_nothing(cli, server):
    """kube-apiserver answers a group it does not serve with a plain 404 page: the queue check listed
    the queues after it found none by name, and printed the client's traceback (issue 51, item 6)."""
    server.volcano_installed = False
    code, _out, err = cli("submit", JOB, "--context", "lab")
    assert code != 0
    line = trainctl_fixtures.one_error(err)
    assert line.startswith(f"error: queue: got 'training', but the cluster at {server.url} has no Volcano queues "
                           "(scheduling.volcano.sh/v1beta1 queues: HTTP 404)"), line
    assert "deploy the platform's cluster stack, which installs Volcano" in line
    assert not [r for r in server.requests if r[0] == "POST"]
