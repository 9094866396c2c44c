"""How a member of the rendezvous store is started: the flags the etcd chart and the local cluster share.

Torch-free and CDK-free: the chart (k8s_charts/platform_charts.py) renders these flags into
its StatefulSet, and training/local_cluster.py starts real etcd 3.5 members with the same
flags on loopback, so the tests run what the cluster runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# Members of the platform's etcd: one lost system node leaves a quorum of two, and the jobs see
# no outage at all. The system node group keeps at least this many nodes (config/model.py).
ETCD_MEMBERS = 3
# etcd's Raft timing: a heartbeat every 50 ms and an election after 500 ms (defaults 100 and 1000).
# etcd grants no lease shorter than 1.5 election timeouts, rounded up to whole seconds
# (server/etcdserver/server.go, minTTL): 1 s here instead of 2 s, so a dead node's lease ends
# that much sooner. 50 ms is still tens of times a round trip between nodes of one Region.
ETCD_TIMING = ("--heartbeat-interval=50", "--election-timeout=500")
# Old revisions are dropped after an hour: the rendezvous compares only current revisions and
# never watches history, and without compaction the database would grow to its quota over months
# and turn read-only (etcd's NOSPACE alarm).
ETCD_COMPACTION = ("--auto-compaction-mode=periodic", "--auto-compaction-retention=1h")


# Where pods find the client certificate the platform issues them (a Secret of cert-manager's
# layout: ca.crt, tls.crt, tls.key), and the environment that tells the rendezvous client so
# (training/etcd_v3.py reads it).
CLIENT_TLS_DIR = "/etc/platform/etcd-tls"


def client_tls_environment(directory: str = CLIENT_TLS_DIR) -> dict[str, str]:
    from training.etcd_v3 import ETCD_CA_ENV, ETCD_CERT_ENV, ETCD_KEY_ENV

    return {ETCD_CA_ENV: f"{directory}/ca.crt", ETCD_CERT_ENV: f"{directory}/tls.crt",
            ETCD_KEY_ENV: f"{directory}/tls.key"}


@dataclass(frozen=True)
class MemberTLS:
    """PEM files of one member: its certificate for clients, its certificate for peers, and the CA of both.

    Clients and peers must present a certificate of that CA (``--client-cert-auth``,
    ``--peer-client-cert-auth``). The server certificate needs the clientAuth usage as well as
    serverAuth: etcd's JSON gateway dials the member's own gRPC server with it.
    """

    ca_file: str
    cert_file: str
    key_file: str
    peer_cert_file: str
    peer_key_file: str


def etcd_arguments(name: str, data_dir: str, *, peers: Mapping[str, str], listen_client_urls: Sequence[str],
                   advertise_client_url: str, listen_peer_url: str, cluster_token: str,
                   advertise_peer_url: str | None = None, tls: MemberTLS | None = None,
                   metrics_url: str | None = None) -> list[str]:
    """Flags of member ``name`` of the cluster ``peers`` (member name -> its advertised peer URL).

    ``--initial-cluster*`` is read only when the data dir is empty: a member restarted on its
    data rejoins as the member it was. The URLs carry their scheme; with ``tls`` they must be
    https. ``metrics_url`` serves /health, /livez, /readyz and /metrics without client
    certificates, for the kubelet's probes. ``advertise_peer_url`` defaults to ``peers[name]``;
    a chart passes both with ``$(POD_NAME)`` in them, which the kubelet expands.
    """
    advertise_peer_url = advertise_peer_url or peers.get(name)
    if advertise_peer_url is None:
        raise ValueError(f"member {name!r} is not in the cluster {sorted(peers)}")
    args = [
        f"--name={name}",
        f"--data-dir={data_dir}",
        *ETCD_TIMING,
        *ETCD_COMPACTION,
        f"--listen-client-urls={','.join(listen_client_urls)}",
        f"--advertise-client-urls={advertise_client_url}",
        f"--listen-peer-urls={listen_peer_url}",
        f"--initial-advertise-peer-urls={advertise_peer_url}",
        f"--initial-cluster={','.join(f'{member}={url}' for member, url in peers.items())}",
        "--initial-cluster-state=new",
        f"--initial-cluster-token={cluster_token}",
    ]
    if metrics_url:
        args.append(f"--listen-metrics-urls={metrics_url}")
    if tls:
        args += [
            f"--trusted-ca-file={tls.ca_file}", f"--cert-file={tls.cert_file}", f"--key-file={tls.key_file}",
            "--client-cert-auth=true",
            f"--peer-trusted-ca-file={tls.ca_file}", f"--peer-cert-file={tls.peer_cert_file}",
            f"--peer-key-file={tls.peer_key_file}", "--peer-client-cert-auth=true",
        ]
    return args
