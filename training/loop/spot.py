"""EC2's two-minute Spot interruption notice, watched from the node's instance metadata."""

from __future__ import annotations

import logging
import os
import threading
import time

from training.contract import IMDS_ENDPOINT_ENV, SPOT_NOTICE_ENV as SPOT_NOTICE_ENV  # callers use spot.NAME

log = logging.getLogger(__name__)


class SpotNotice:
    """Watches the node's metadata for EC2's two-minute Spot interruption notice.

    ``spot/instance-action`` answers 404 until EC2 schedules the interruption, then the action
    and its time (EC2 User Guide, "Spot Instance interruption notices"); IMDSv2 needs a session
    token first. One rank per node polls; the training loop checkpoints at the next step once any
    rank has seen the notice, before the drain's SIGTERM arrives.
    """

    def __init__(self, enabled: bool, interval_s: float = 5.0) -> None:
        self._seen = threading.Event()
        self._acted = False
        self.action: str | None = None
        if enabled:
            self._endpoint = os.environ.get(IMDS_ENDPOINT_ENV, "http://169.254.169.254").rstrip("/")
            thread = threading.Thread(target=self._watch, args=(interval_s,), name="spot-notice", daemon=True)
            thread.start()

    @property
    def pending(self) -> bool:
        """Seen and not acted on yet."""
        return self._seen.is_set() and not self._acted

    def acted(self) -> None:
        self._acted = True

    def _watch(self, interval_s: float) -> None:
        import http.client
        import json
        import urllib.error
        import urllib.request

        while not self._seen.is_set():
            try:
                token_request = urllib.request.Request(f"{self._endpoint}/latest/api/token", method="PUT", headers={
                    "X-aws-ec2-metadata-token-ttl-seconds": "300"})
                token = urllib.request.urlopen(token_request, timeout=2).read().decode()
                request = urllib.request.Request(f"{self._endpoint}/latest/meta-data/spot/instance-action",
                                                 headers={"X-aws-ec2-metadata-token": token})
                self.action = json.loads(urllib.request.urlopen(request, timeout=2).read()).get("action")
                log.warning("EC2 Spot interruption notice (%s): checkpointing now, before the drain", self.action)
                self._seen.set()
                return
            except urllib.error.HTTPError as exc:
                if exc.code != 404:
                    log.debug("instance metadata answered %s", exc.code)
            except (OSError, ValueError, http.client.HTTPException):
                # No metadata service (off EC2) or a transient error (a request cut by
                # shut_tcp_connections after a lost peer, say): try again.
                pass
            time.sleep(interval_s)
