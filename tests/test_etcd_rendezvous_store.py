"""The trainer's rendezvous pins (torch, python-etcd, dnspython) against a real etcd v2 API."""

from __future__ import annotations

import etcd
import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.etcd_rendezvous_backend import create_backend

pytestmark = pytest.mark.timeout(60)


def test_python_etcd_speaks_the_v2_api(etcd_server):
    host, port = etcd_server.split(":")
    client = etcd.Client(host=host, port=int(port), protocol="http")
    client.write("/platform/probe", "ok", ttl=30)
    assert client.read("/platform/probe").value == "ok"


def test_torch_etcd_v2_backend_keeps_state(etcd_server):
    params = RendezvousParameters(
        backend="etcd-v2", endpoint=etcd_server, run_id="job-1234", min_nodes=1, max_nodes=2
    )
    backend, _store = create_backend(params)
    assert backend.name == "etcd-v2"
    assert backend.get_state() is None
    state, token, written = backend.set_state(b"round-0")
    assert (state, written) == (b"round-0", True)
    # A stale token loses: the write another agent made first wins.
    _, _, written_again = backend.set_state(b"round-1", token=token + 1 if isinstance(token, int) else "stale")
    assert written_again is False
    assert backend.get_state()[0] == b"round-0"
