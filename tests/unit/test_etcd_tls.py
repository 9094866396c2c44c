"""The rendezvous client over TLS with client certificates, against a real etcd 3.5 serving only TLS.

The platform issues these certificates in production (see the etcd chart); here a throwaway CA
signs a server certificate for 127.0.0.1 and a client certificate.
"""

from __future__ import annotations

import shutil
import socket
import ssl

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from tests.local_pki import BOTH, LOOPBACK, issue, platform_pki
from training.contract import ETCD_TIMING
from training.launcher.etcd_v3 import EtcdClient, EtcdRequestError
from trainctl.backends.local_cluster import LocalEtcd, free_port

# Timed (a deadline: a real etcd must start within 20 s and a 5 s lease outlive the test's keep-alive): make test
# runs it with the timed drills, not at the lowest priority beside them (tests/background.py), where a timed drill
# keeping both cores busy would make it late.
pytestmark = [pytest.mark.timed, pytest.mark.timeout(60)]


@pytest.fixture(scope="module")
def tls_etcd(tmp_path_factory):
    pki = tmp_path_factory.mktemp("pki")
    # The server certificate has client auth too: etcd's JSON gateway calls its own gRPC server
    # with it as the client's, and with --client-cert-auth etcd refuses one without that usage.
    ca = platform_pki(pki)
    client, peer = free_port(), free_port()
    data = tmp_path_factory.mktemp("etcd-data")
    args = ["--name=tls", f"--data-dir={data}", *ETCD_TIMING,
            f"--listen-client-urls=https://127.0.0.1:{client}", f"--advertise-client-urls=https://127.0.0.1:{client}",
            f"--listen-peer-urls=http://127.0.0.1:{peer}", f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-cluster=tls=http://127.0.0.1:{peer}", f"--cert-file={pki}/server.pem",
            f"--key-file={pki}/server-key.pem", "--client-cert-auth", f"--trusted-ca-file={pki}/ca.pem"]
    etcd = LocalEtcd(args, client_port=client)
    etcd.start(probe=f"https://127.0.0.1:{client}", ca_file=str(pki / "ca.pem"),
               cert=(str(pki / "client.pem"), str(pki / "client-key.pem")))
    yield f"127.0.0.1:{client}", pki, ca
    etcd.__exit__()


def test_the_client_speaks_mutual_tls(tls_etcd):
    endpoint, pki, _ = tls_etcd
    client = EtcdClient(endpoint, ca_file=str(pki / "ca.pem"), cert_file=str(pki / "client.pem"),
                        key_file=str(pki / "client-key.pem"))
    client.put("/tls/probe", "ok")
    assert client.get("/tls/probe").value == b"ok"
    lease, _ = client.lease_grant(5)
    assert client.lease_keepalive(lease) > 0


def test_the_tls_files_come_from_the_environment(tls_etcd, monkeypatch):
    endpoint, pki, _ = tls_etcd
    monkeypatch.setenv("PLATFORM_ETCD_CA_FILE", str(pki / "ca.pem"))
    monkeypatch.setenv("PLATFORM_ETCD_CERT_FILE", str(pki / "client.pem"))
    monkeypatch.setenv("PLATFORM_ETCD_KEY_FILE", str(pki / "client-key.pem"))
    assert EtcdClient(endpoint).get("/tls/nothing") is None


def test_a_client_without_a_certificate_is_refused_for_good(tls_etcd):
    endpoint, pki, _ = tls_etcd
    with pytest.raises(EtcdRequestError, match="TLS"):
        EtcdClient(endpoint, ca_file=str(pki / "ca.pem")).get("/tls/probe")


def _served_certificate(endpoint: str, pki) -> x509.Certificate:
    host, port = endpoint.split(":")
    context = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    context.load_cert_chain(str(pki / "client.pem"), str(pki / "client-key.pem"))
    with socket.create_connection((host, int(port)), timeout=5) as raw, \
            context.wrap_socket(raw, server_hostname=host) as tls:
        return x509.load_der_x509_certificate(tls.getpeercert(binary_form=True))


def test_a_renewed_server_certificate_is_served_without_a_restart(tls_etcd, tmp_path):
    """etcd 3.5 reads its certificate files on every handshake: cert-manager's renewal needs no restart."""
    endpoint, pki, ca = tls_etcd
    before = _served_certificate(endpoint, pki)
    for name in ("server.pem", "server-key.pem"):
        shutil.copy(pki / name, tmp_path / name)
    try:
        renewed, _ = issue(pki, "server", ca, BOTH, LOOPBACK)
        served = _served_certificate(endpoint, pki)
        assert served.serial_number == renewed.serial_number != before.serial_number
    finally:
        for name in ("server.pem", "server-key.pem"):
            shutil.copy(tmp_path / name, pki / name)


def test_the_client_reads_renewed_certificate_files_on_its_next_connection(tls_etcd, tmp_path):
    endpoint, pki, _ = tls_etcd
    renewing = tmp_path / "client"
    renewing.mkdir()
    for name in ("ca.pem", "client.pem", "client-key.pem"):
        shutil.copy(pki / name, renewing / name)
    client = EtcdClient(endpoint, ca_file=str(renewing / "ca.pem"), cert_file=str(renewing / "client.pem"),
                        key_file=str(renewing / "client-key.pem"))
    assert client.get("/tls/nothing") is None
    # A certificate of another CA in its place: the next connection presents it, and etcd refuses it.
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    issue(foreign, "client", issue(foreign, "ca", None, None), [ExtendedKeyUsageOID.CLIENT_AUTH])
    for name in ("client.pem", "client-key.pem"):
        shutil.copy(foreign / name, renewing / name)
    client.close()
    with pytest.raises(EtcdRequestError, match="TLS"):
        client.get("/tls/nothing")
    for name in ("client.pem", "client-key.pem"):
        shutil.copy(pki / name, renewing / name)
    assert client.get("/tls/nothing") is None  # and the platform's renewed one again
