"""The rendezvous client over TLS with client certificates, against a real etcd 3.5 serving only TLS.

The platform issues these certificates in production (see the etcd chart); here a throwaway CA
signs a server certificate for 127.0.0.1 and a client certificate.
"""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from training.etcd_v3 import EtcdClient, EtcdRequestError
from training.etcd_cluster import ETCD_TIMING
from training.local_cluster import LocalEtcd, free_port

pytestmark = pytest.mark.timeout(60)


def _issue(directory: Path, name: str, ca: tuple | None, usage, san: list | None = None) -> tuple:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    issuer_name, issuer_key = (ca[0].subject, ca[1]) if ca else (subject, key)
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer_name).public_key(key.public_key())
               .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
               .not_valid_after(now + datetime.timedelta(hours=1))
               .add_extension(x509.BasicConstraints(ca=ca is None, path_length=None), critical=True))
    if usage:
        builder = builder.add_extension(x509.ExtendedKeyUsage(usage), critical=False)
    if san:
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    cert = builder.sign(issuer_key, hashes.SHA256())
    (directory / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (directory / f"{name}-key.pem").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return cert, key


@pytest.fixture(scope="module")
def tls_etcd(tmp_path_factory):
    pki = tmp_path_factory.mktemp("pki")
    ca = _issue(pki, "ca", None, None)
    # Client auth too: etcd's JSON gateway calls its own gRPC server with the server certificate
    # as the client's, and with --client-cert-auth etcd refuses one without that usage.
    _issue(pki, "server", ca, [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
           [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    _issue(pki, "client", ca, [ExtendedKeyUsageOID.CLIENT_AUTH])
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
    yield f"127.0.0.1:{client}", pki
    etcd.__exit__()


def test_the_client_speaks_mutual_tls(tls_etcd):
    endpoint, pki = tls_etcd
    client = EtcdClient(endpoint, ca_file=str(pki / "ca.pem"), cert_file=str(pki / "client.pem"),
                        key_file=str(pki / "client-key.pem"))
    client.put("/tls/probe", "ok")
    assert client.get("/tls/probe").value == b"ok"
    lease, _ = client.lease_grant(5)
    assert client.lease_keepalive(lease) > 0


def test_the_tls_files_come_from_the_environment(tls_etcd, monkeypatch):
    endpoint, pki = tls_etcd
    monkeypatch.setenv("PLATFORM_ETCD_CA_FILE", str(pki / "ca.pem"))
    monkeypatch.setenv("PLATFORM_ETCD_CERT_FILE", str(pki / "client.pem"))
    monkeypatch.setenv("PLATFORM_ETCD_KEY_FILE", str(pki / "client-key.pem"))
    assert EtcdClient(endpoint).get("/tls/nothing") is None


def test_a_client_without_a_certificate_is_refused_for_good(tls_etcd):
    endpoint, pki = tls_etcd
    with pytest.raises(EtcdRequestError, match="TLS"):
        EtcdClient(endpoint, ca_file=str(pki / "ca.pem")).get("/tls/probe")
