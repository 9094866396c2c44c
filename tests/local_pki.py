"""A throwaway CA and the certificates the platform's cert-manager issues, for etcd on loopback.

The same usages as k8s_charts/platform_charts.py EtcdCertificatesChart: the members' server and
peer certificates carry serverAuth and clientAuth, the jobs' client certificate clientAuth.
Names are for 127.0.0.1, where the local members listen.
"""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

LOOPBACK = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
BOTH = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]


def issue(directory: Path, name: str, ca: tuple | None, usage, san: list | None = None) -> tuple:
    """``<name>.pem`` and ``<name>-key.pem`` in ``directory``, signed by ``ca`` (None: self-signed CA)."""
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


def platform_pki(directory: Path) -> tuple:
    """ca, server, peer and client certificates as the platform issues them; returns the CA."""
    ca = issue(directory, "ca", None, None)
    issue(directory, "server", ca, BOTH, LOOPBACK)
    issue(directory, "peer", ca, BOTH, LOOPBACK)
    issue(directory, "client", ca, [ExtendedKeyUsageOID.CLIENT_AUTH])
    return ca
