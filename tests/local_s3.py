"""A local S3 for stage-data's tests and benchmark: moto's S3 application in its own process,
with a fixed delay per request standing in for the round trip to S3 (the issue measured ~50 ms
per file). Without the delay, loopback makes every request CPU-bound and says nothing about how
uploads overlap their waiting. One Python process serves at most ~1 / (its CPU per request,
~1.7 ms here) requests per second, whatever the delay.

    with local_s3(latency_s=0.05) as endpoint: boto3.client("s3", endpoint_url=endpoint, ...)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


class Delayed:
    """WSGI middleware: every request waits ``latency_s`` before moto answers it."""

    def __init__(self, app, latency_s: float):
        self.app, self.latency_s = app, latency_s

    def __call__(self, environ, start_response):
        time.sleep(self.latency_s)
        return self.app(environ, start_response)


def serve(latency_s: float) -> None:
    import logging
    import warnings

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    warnings.simplefilter("ignore")
    from moto.moto_server.werkzeug_app import MotoRequestHandler, create_backend_app
    from werkzeug.serving import make_server

    # moto's S3 application alone: its all-services dispatcher would scan
    # moto's package folders on every request (~1 ms, a third of a PUT's cost), which would make
    # the stand-in, not the client, the bottleneck.
    server = make_server("127.0.0.1", 0, Delayed(create_backend_app("s3"), latency_s),
                         threaded=True, request_handler=MotoRequestHandler)
    print(server.server_address[1], flush=True)
    server.serve_forever()


@contextlib.contextmanager
def local_s3(latency_s: float = 0.0):
    """The endpoint URL of a fresh local S3 (own process), stopped on exit."""
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
    process = subprocess.Popen([sys.executable, "-m", "tests.local_s3", "--latency", str(latency_s)],
                               cwd=REPO, stdout=subprocess.PIPE, text=True, env=env)
    try:
        port = int(process.stdout.readline())
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(timeout=30)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--latency", type=float, default=0.0)
    serve(parser.parse_args().latency)
