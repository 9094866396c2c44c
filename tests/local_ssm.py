"""A loopback stand-in for SSM Run Command that really runs what it is sent.

moto's SSM records SendCommand but runs nothing, so the transport's quoting, stdin and exit
codes would go untested. This speaks SSM's JSON protocol (the botocore model's awsJson1_1:
``X-Amz-Target: AmazonSSM.<Operation>``) for the four operations trainctl's SsmShell uses,
runs each AWS-RunShellScript command with ``sh`` in a subprocess, and answers as SSM does:

- GetCommandInvocation answers InvocationDoesNotExist for the first reads after SendCommand;
- Status/StatusDetails Success, or Failed with ResponseCode = the exit status and the agent's
  "failed to run commands: exit status N" appended to stderr (as seen from real SSM in
  gruntwork-io/terratest test/terraform_aws_ssm_example_test.go);
- StandardOutputContent and StandardErrorContent cut to their first 24,000 and 8,000
  characters (botocore's ssm model, GetCommandInvocationResult);
- SendCommand to an instance SSM does not know: InvalidInstanceId; to one whose agent lost its
  connection: accepted, and the invocation stays Pending until cancelled.

    with LocalSsm({"i-0abc": "Online"}) as ssm: monkeypatch.setenv("AWS_ENDPOINT_URL_SSM", ssm.url)
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class LocalSsm:
    def __init__(self, instances: dict[str, str], *, hidden_reads: int = 2, env: dict | None = None):
        self.instances = instances  # instance id -> PingStatus
        self.hidden_reads, self.env = hidden_reads, env or {}
        self.invocations: dict[str, dict] = {}
        self.sent: list[dict] = []  # SendCommand requests, for the tests to look at
        self.lock = threading.Lock()
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                operation = self.headers["X-Amz-Target"].removeprefix("AmazonSSM.")
                status, answer = stand_in.handle(operation, body)
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/x-amz-json-1.1")
                self.send_header("x-amzn-RequestId", str(uuid.uuid4()))
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self) -> LocalSsm:
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    @staticmethod
    def error(code: str, message: str) -> tuple[int, dict]:
        return 400, {"__type": code, "message": message}

    def handle(self, operation: str, body: dict) -> tuple[int, dict]:
        if operation == "SendCommand":
            return self.send_command(body)
        if operation == "GetCommandInvocation":
            return self.get_command_invocation(body)
        if operation == "CancelCommand":
            with self.lock:
                for instance in body.get("InstanceIds", []):
                    invocation = self.invocations.get((body["CommandId"], instance))
                    if invocation and invocation["Status"] in ("Pending", "InProgress"):
                        invocation.update(Status="Cancelled", StatusDetails="Cancelled")
            return 200, {}
        if operation == "DescribeInstanceInformation":
            wanted = {v for f in body.get("Filters", []) if f["Key"] == "InstanceIds" for v in f["Values"]}
            return 200, {"InstanceInformationList": [
                {"InstanceId": i, "PingStatus": s, "PlatformType": "Linux"} for i, s in self.instances.items()
                if not wanted or i in wanted]}
        return self.error("InvalidAction", f"{operation} is not served by the stand-in")

    def send_command(self, body: dict) -> tuple[int, dict]:
        self.sent.append(body)
        if body["DocumentName"] != "AWS-RunShellScript":
            return self.error("InvalidDocument", body["DocumentName"])
        (instance,) = body["InstanceIds"]
        if instance not in self.instances:
            return self.error("InvalidInstanceId", "Instances [[%s]] not in a valid state for account 123456789012"
                              % instance)
        command_id = str(uuid.uuid4())
        invocation = {"CommandId": command_id, "InstanceId": instance, "DocumentName": "AWS-RunShellScript",
                      "PluginName": "aws:runShellScript", "Status": "Pending", "StatusDetails": "Pending",
                      "ResponseCode": -1, "StandardOutputContent": "", "StandardErrorContent": "",
                      "hidden": self.hidden_reads}
        self.invocations[(command_id, instance)] = invocation
        if self.instances[instance] == "Online":
            threading.Thread(target=self.execute, args=(invocation, "\n".join(body["Parameters"]["commands"])),
                             daemon=True).start()
        return 200, {"Command": {"CommandId": command_id, "DocumentName": "AWS-RunShellScript",
                                 "InstanceIds": [instance], "Status": "Pending"}}

    def execute(self, invocation: dict, script: str) -> None:
        with self.lock:
            invocation.update(Status="InProgress", StatusDetails="InProgress")
        with tempfile.NamedTemporaryFile("w", suffix="_script.sh", delete=False) as f:
            f.write(script)
        try:
            done = subprocess.run(["sh", f.name], capture_output=True, text=True, env={**os.environ, **self.env})
        finally:
            os.unlink(f.name)
        stderr = done.stderr + (f"failed to run commands: exit status {done.returncode}" if done.returncode else "")
        status = "Success" if done.returncode == 0 else "Failed"
        with self.lock:
            invocation.update(Status=status, StatusDetails=status, ResponseCode=done.returncode,
                              StandardOutputContent=done.stdout[:24_000], StandardErrorContent=stderr[:8_000])

    def get_command_invocation(self, body: dict) -> tuple[int, dict]:
        with self.lock:
            invocation = self.invocations.get((body["CommandId"], body["InstanceId"]))
            if invocation is None or invocation["hidden"] > 0:
                if invocation is not None:
                    invocation["hidden"] -= 1
                return self.error("InvocationDoesNotExist", "")
            return 200, {k: v for k, v in invocation.items() if k != "hidden"}
