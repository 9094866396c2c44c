"""trainctl's Kubernetes paths against a small API server on loopback that records every request."""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from kubernetes import client

from config import parse_config
from config.job_spec import load_job_spec, parse_job_spec
from tests.conftest import REPO, example_data
from trainctl.errors import UserError
from trainctl.backends.eks import Jobs, pod_at_index, pod_for_rank, render, render_text, status

CONFIG = parse_config(example_data())
SPEC_PATH = REPO / "k8s_charts" / "examples" / "resnet50-p4d.yaml"
SPEC = load_job_spec(SPEC_PATH, CONFIG)
JOBS_PATH = "/apis/batch.volcano.sh/v1alpha1/namespaces/training/jobs"
WORKER_LOG = "worker log\n" + json.dumps({"event": "node_ranks", "time": 9.5, "group_rank": 1,
                                          "group_world_size": 2, "global_ranks": list(range(8, 16))}) + "\n"
RANK0_LOG = "\n".join([
    "I1122 torchrun agent starting",
    json.dumps({"event": "node_ranks", "time": 9.5, "group_rank": 0, "group_world_size": 2,
                "global_ranks": list(range(8))}),
    json.dumps({"event": "rendezvous", "time": 10.0, "world_size": 16, "restart_count": 1, "run_id": "x",
                "attempt": "a1b2c3d4e5f6", "global_batch": 2048}),
    json.dumps({"event": "resume", "time": 10.5, "step": 500, "epoch": 0, "offset": 1024000,
                "checkpoint": "/fsx/checkpoints/resnet50-imagenet/step-000000500.pt"}),
    json.dumps({"event": "step", "time": 20.0, "step": 510, "epoch": 0, "loss": 5.91, "lr": 0.8,
                "samples_per_s": 40960.0, "samples_per_s_per_device": 2560.0, "step_time_s": 0.05,
                "data_wait_pct": 1.2, "peak_memory_gib": 30.1, "world_size": 16, "restart_count": 1, "mfu": 0.41}),
    json.dumps({"event": "checkpoint_started", "time": 21.0, "step": 1500, "reason": "interval",
                "asynchronous": True, "stop_budget_s": 105.0}),
    json.dumps({"event": "checkpoint_saved", "time": 21.0, "step": 1000,
                "path": "/fsx/checkpoints/resnet50-imagenet/step-000001000.pt", "bytes": 204800000,
                "write_s": 2.1, "blocking_s": 0.3, "steps_during_write": 40}),
    json.dumps({"event": "straggler", "time": 21.5, "step": 1000, "rank": 11, "pod": "resnet50-imagenet-worker-1",
                "node": "ip-10-0-1-23.ec2.internal", "instance": "p4d.24xlarge", "own_step_s": 0.031,
                "median_s": 0.021, "times_median": 1.48, "windows": 2}),
    json.dumps({"event": "straggler_replaced", "time": 21.6, "step": 1000, "rank": 11,
                "pod": "resnet50-imagenet-worker-1", "node": "ip-10-0-1-23.ec2.internal", "instance": "p4d.24xlarge",
                "nodes": 2}),
    json.dumps({"event": "step", "time": 22.0, "step": 1010, "epoch": 0, "loss": 4.87, "lr": 0.79,
                "samples_per_s": 41200.5, "samples_per_s_per_device": 2575.0, "step_time_s": 0.0497,
                "data_wait_pct": 1.1, "peak_memory_gib": 30.1, "world_size": 16, "restart_count": 1, "mfu": 0.41,
                "rank_step_s": {"min": 0.0198, "median": 0.021, "max": 0.0312}, "slowest_rank": 11,
                "slowest_pod": "resnet50-imagenet-worker-1", "slowest_node": "ip-10-0-1-23.ec2.internal"}),
]) + "\n"


class FakeApiServer:
    """Answers like the API server for the few endpoints trainctl uses.

    ``fail = (status, message)`` answers every request with that Status. A deleted job stays
    (terminating, its pods too) for ``deletion_polls`` more GETs, as foreground deletion does.
    """

    def __init__(self):
        self.requests: list[tuple[str, str, str, dict | None]] = []
        self.jobs: dict[str, dict] = {}
        self.fail: tuple[int, str] | None = None
        self.deletion_polls = 0
        self.terminating: dict[str, int] = {}
        self.queues = {"training"}
        self.priority_classes = {"training"}
        self.events: list[dict] = []
        self.pods_alive = True
        self.phases: list[str] = []  # each GET of a job moves it to the next phase
        self.pod_logs: dict[str, str] = {}  # a pod's log instead of RANK0_LOG / WORKER_LOG
        self.refuse_create: tuple[int, str] | None = None  # (status, message) for every create
        # False: a cluster without Volcano. kube-apiserver answers a group it does not serve with a plain
        # 404 page, not a Status (staging/src/k8s.io/apiserver/pkg/server/mux: NotFound handler).
        self.volcano_installed = True
        # Nodes (the node check's own node, trainctl nodes) and the events posted about them.
        self.nodes: dict[str, dict] = {}
        self.node_events: list[dict] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_args):
                pass

            def _send(self, code, body, content_type="application/json"):
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _handle(self, method):
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                path = self.path.split("?")[0]
                server.requests.append((method, self.path, self.headers.get("Authorization", ""), body))
                if server.fail:
                    code, message = server.fail
                    return self._send(code, {"kind": "Status", "code": code, "message": message})
                name = path.removeprefix(JOBS_PATH + "/") if path.startswith(JOBS_PATH + "/") else None
                if name in server.terminating:
                    server.terminating[name] -= 1
                    if server.terminating[name] < 0:
                        del server.terminating[name], server.jobs[name]
                        server.pods_alive = False
                if not server.volcano_installed and path.startswith(("/apis/scheduling.volcano.sh/",
                                                                      "/apis/batch.volcano.sh/")):
                    return self._send(404, b"404 page not found\n", content_type="text/plain; charset=utf-8")
                queue = re.fullmatch(r"/apis/scheduling.volcano.sh/v1beta1/queues(?:/([^/]+))?", path)
                if queue:
                    if queue.group(1) is None:
                        return self._send(200, {"items": [{"metadata": {"name": q}} for q in sorted(server.queues)]})
                    found = queue.group(1) in server.queues
                    return self._send(*((200, {"metadata": {"name": queue.group(1)}}) if found else
                                         (404, {"kind": "Status", "code": 404})))
                priority = re.fullmatch(r"/apis/scheduling.k8s.io/v1/priorityclasses/([^/]+)", path)
                if priority:
                    found = priority.group(1) in server.priority_classes
                    return self._send(*((200, {"kind": "PriorityClass", "apiVersion": "scheduling.k8s.io/v1",
                                               "metadata": {"name": priority.group(1)}, "value": 1000}) if found else
                                         (404, {"kind": "Status", "code": 404})))
                node = re.fullmatch(r"/api/v1/nodes(?:/([^/]+))?", path)
                if node:
                    return self._send(*server.node_request(method, node.group(1), body))
                if path == "/api/v1/namespaces/default/events" and method == "POST":
                    server.node_events.append(body)
                    return self._send(201, body)
                if path == "/api/v1/namespaces/training/events":
                    return self._send(200, {"kind": "EventList", "apiVersion": "v1", "items": server.events})
                if path == JOBS_PATH and method == "GET":
                    return self._send(200, {"items": list(server.jobs.values())})
                if path == JOBS_PATH and method == "POST":
                    if server.refuse_create:  # the schema or an admission webhook says no, dry run or not
                        code, message = server.refuse_create
                        return self._send(code, {"kind": "Status", "code": code, "message": message})
                    if body["metadata"]["name"] in server.jobs:  # kube-apiserver: terminating objects too
                        return self._send(409, {"kind": "Status", "code": 409, "reason": "AlreadyExists",
                                                "message": f'jobs.batch.volcano.sh "{body["metadata"]["name"]}" '
                                                           "already exists"})
                    if "dryRun=All" in self.path:  # validated, admitted, not stored
                        return self._send(201, body)
                    server.jobs[body["metadata"]["name"]] = {**body, "status": {"state": {"phase": "Pending"}}}
                    server.pods_alive = True
                    return self._send(201, body)
                if name and method == "GET":
                    if name in server.jobs and server.phases:
                        server.jobs[name]["status"] = {"state": {"phase": server.phases.pop(0)}}
                    return self._send(200, server.jobs[name]) if name in server.jobs else self._send(
                        404, {"kind": "Status", "code": 404})
                if name and method == "DELETE":
                    if server.deletion_polls:
                        server.terminating[name] = server.deletion_polls
                    else:
                        server.jobs.pop(name, None)
                        server.pods_alive = False
                    return self._send(200, {"kind": "Status", "status": "Success"})
                if path == "/api/v1/namespaces/training/pods":
                    return self._send(200, {"kind": "PodList", "apiVersion": "v1", "items": [
                        pod(i) for i in range(2)] if server.pods_alive else []})
                match = re.fullmatch(r"/api/v1/namespaces/training/pods/([\w-]+)/log", path)
                if match:
                    text = server.pod_logs.get(match.group(1)) or (RANK0_LOG if match.group(1).endswith("-0") else
                                                                  WORKER_LOG)
                    return self._send(200, text.encode(), "text/plain")
                return self._send(404, {"kind": "Status", "code": 404})

            def do_GET(self):
                self._handle("GET")

            def do_POST(self):
                self._handle("POST")

            def do_DELETE(self):
                self._handle("DELETE")

            def do_PATCH(self):
                self._handle("PATCH")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._nodes_lock = threading.Lock()
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"


    def node_request(self, method: str, name: str | None, body) -> tuple[int, dict]:
        """Nodes as kube-apiserver serves them: a list, one by name, and a JSON patch (RFC 6902) whose
        failed ``test`` is refused with 422 (staging/src/k8s.io/apiserver/pkg/endpoints/handlers/patch.go)."""
        import jsonpatch

        with self._nodes_lock:
            if name is None:
                return 200, {"kind": "NodeList", "apiVersion": "v1", "items": list(self.nodes.values())}
            if name not in self.nodes:
                return 404, {"kind": "Status", "code": 404, "reason": "NotFound", "message": f'nodes "{name}" not found'}
            if method == "GET":
                return 200, self.nodes[name]
            try:
                patched = jsonpatch.apply_patch(self.nodes[name], body)
            except (jsonpatch.JsonPatchTestFailed, jsonpatch.JsonPatchConflict) as error:
                return 422, {"kind": "Status", "code": 422, "reason": "Invalid", "message": str(error)}
            self.nodes[name] = patched
            return 200, patched


def pod(index: int) -> dict:
    return {"metadata": {"name": f"resnet50-imagenet-worker-{index}", "namespace": "training"},
            "spec": {"nodeName": f"ip-10-0-{index}-7.us-west-2.compute.internal", "containers": []},
            "status": {"phase": "Running", "containerStatuses": [
                {"name": "trainer", "restartCount": index, "ready": True, "image": "i", "imageID": "",
                 "image_id": ""}]}}


@pytest.fixture
def api():
    server = FakeApiServer()
    configuration = client.Configuration()
    configuration.host = server.url
    configuration.api_key = {"authorization": "Bearer k8s-aws-v1.test-token"}
    yield server, Jobs(client.ApiClient(configuration), "training")
    server.httpd.shutdown()


def test_submit_creates_the_volcano_job_with_the_bearer_token(api):
    server, jobs = api
    job = render(CONFIG, SPEC)[0]
    assert jobs.submit(job) == "resnet50-imagenet"
    method, path, auth, body = server.requests[-1]
    assert (method, path, auth) == ("POST", JOBS_PATH, "Bearer k8s-aws-v1.test-token")
    assert body["kind"] == "Job" and body["spec"]["minAvailable"] == 2


def test_an_existing_name_is_refused_unless_replace(api):
    server, jobs = api
    job = render(CONFIG, SPEC)[0]
    jobs.submit(job)
    with pytest.raises(UserError, match="already exists"):
        jobs.submit(job)
    before = len(server.requests)
    jobs.submit(job, replace=True)
    calls = [(m, p.split("?")[0].removeprefix(JOBS_PATH)) for m, p, *_ in server.requests[before:]
             if p.startswith(JOBS_PATH)]
    # exists? -> would the new one be created (dry run)? -> cancel (exists? delete) -> gone? -> create
    assert calls == [("GET", "/resnet50-imagenet"), ("POST", ""), ("GET", "/resnet50-imagenet"),
                     ("DELETE", "/resnet50-imagenet"), ("GET", "/resnet50-imagenet"), ("POST", "")]
    assert "dryRun=All" in [p for m, p, *_ in server.requests[before:] if m == "POST"][0]


def test_status_shows_phase_pods_rendezvous_last_metrics_and_newest_checkpoint(api, snapshot):
    _, jobs = api
    jobs.submit(render(CONFIG, SPEC)[0])
    report = status(jobs, "resnet50-imagenet").format()
    assert report == snapshot
    assert "last step: 1010 (epoch 0), loss 4.87, 41200.5 samples/s" in report
    assert "newest checkpoint: /fsx/checkpoints/resnet50-imagenet/step-000001000.pt (step 1000)" in report
    # Every rank's own step time, and the straggler the trainer named, with where it runs.
    assert ("ranks' own step time: min 0.0198 s, median 0.021 s, max 0.0312 s (rank 11, pod "
            "resnet50-imagenet-worker-1)") in report
    assert ("straggler at step 1000: rank 11, pod resnet50-imagenet-worker-1, node ip-10-0-1-23.ec2.internal, "
            "p4d.24xlarge: 1.48 times the median's own step time for 2 reports") in report
    assert ("straggler replaced at step 1000: pod resnet50-imagenet-worker-1 left node ip-10-0-1-23.ec2.internal "
            "(tainted); the job went on with 1 of its 2 nodes") in report


def test_list_cancel_and_logs_by_rank(api):
    server, jobs = api
    jobs.submit(render(CONFIG, SPEC)[0])
    assert [j["metadata"]["name"] for j in jobs.list()] == ["resnet50-imagenet"]
    assert pod_for_rank(jobs, "resnet50-imagenet", 9) == "resnet50-imagenet-worker-1"  # it holds ranks 8-15
    assert pod_at_index(jobs, "resnet50-imagenet", 1) == "resnet50-imagenet-worker-1"
    assert jobs.log("resnet50-imagenet-worker-1") == WORKER_LOG
    with pytest.raises(UserError, match="which no pod of resnet50-imagenet holds now"):
        pod_for_rank(jobs, "resnet50-imagenet", 16)
    with pytest.raises(UserError, match="allowed: an index from 0 to 1"):
        pod_at_index(jobs, "resnet50-imagenet", 5)
    jobs.cancel("resnet50-imagenet")
    assert jobs.list() == []
    with pytest.raises(UserError, match="no job"):
        jobs.cancel("resnet50-imagenet")


def test_a_missing_access_entry_is_one_line(api):
    # EKS authenticates an identity without an access entry as nobody: 401, not 403.
    server, jobs = api
    server.fail = (401, "Unauthorized")
    with pytest.raises(UserError) as caught:
        jobs.list()
    assert str(caught.value) == (
        "the cluster does not know this identity (HTTP 401: no access entry, or an expired token); fix: add your "
        "role to cluster.admin_principal_arns and redeploy, or ask for an access entry; check --profile")


def test_render_golden(snapshot):
    assert render_text(CONFIG, SPEC) == snapshot


def test_render_prints_what_make_synth_writes_into_dist_byte_for_byte(tmp_path):
    """`trainctl render` and dist/ used to differ in YAML formatting (issue 36): a user diffing the
    two saw changes that were not there."""
    from k8s_charts.__main__ import main as render_dist

    assert render_dist(["--config", "config/example.yaml", "--job", str(SPEC_PATH), "--out", str(tmp_path)]) == 0
    assert render_text(CONFIG, SPEC) == (tmp_path / f"{SPEC.name}.yaml").read_text()


def test_a_program_job_is_submitted_listed_watched_and_cancelled_like_the_trainer(api):
    """A job running its own program (docs/job-spec.md, "Your own torchrun program") is a Volcano Job like any other."""
    from tests.unit.test_charts import PROGRAM_JOB

    server, jobs = api
    spec = parse_job_spec(PROGRAM_JOB, CONFIG)
    job = render(CONFIG, spec)[0]
    assert job["spec"]["tasks"][0]["template"]["spec"]["containers"][0]["image"] == PROGRAM_JOB["image"]
    assert jobs.submit(job) == "own-program"
    assert server.requests[-1][3]["metadata"]["name"] == "own-program"
    assert [j["metadata"]["name"] for j in jobs.list()] == ["own-program"]
    assert "own-program" in status(jobs, "own-program").format()
    jobs.cancel("own-program")
    assert jobs.list() == []
