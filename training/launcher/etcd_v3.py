"""A small client for etcd's v3 API, spoken as JSON over HTTP (etcd's gRPC gateway, ``/v3/...``).

The rendezvous needs seven calls: range, put, delete, transaction, and lease grant, keep-alive
and revoke. This module makes them with the standard library alone, for three reasons:

- **No dependencies.** The launcher must run in images we did not build (a user's image has
  torch and nothing of ours), so what it needs beyond torch has to be copyable as source.
  python-etcd (v2 only, last release 2017, pinned urllib3 below 2.6) was the last one.
- **Every call has a deadline and one kind of failure.** The rendezvous waits out etcd outages,
  so it must tell "etcd is away" (connection refused or reset, a timeout, a 5xx, a leader
  election) from "etcd answered no" (a failed compare, a lease that is gone). Here the first
  is :class:`EtcdUnavailable` and the second a normal return value, for every call.
- **The gateway is a stable, documented surface** (etcd's "gRPC gateway" page; served at
  ``/v3/`` since 3.4, and still by 3.6, which dropped the v2 API). etcd3gw speaks the same
  gateway; it brings requests, futurist and pbr, and a watch thread we do not use.

Endpoints are ``host:port`` (http) or ``https://host:port``; several may be given, comma
separated, and a call that cannot reach one tries the next. TLS uses a CA bundle and an
optional client certificate (mutual TLS), read from the environment names in
:data:`TLS_ENVIRONMENT` when not passed in.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import ssl
import threading
from dataclasses import dataclass
from typing import Any

from training.contract import ETCD_CA_ENV, ETCD_CERT_ENV, ETCD_KEY_ENV, TLS_ENVIRONMENT


class EtcdUnavailable(Exception):
    """etcd could not be reached, or could not answer now (no leader, overloaded): try again later."""


class LeaseNotFound(EtcdUnavailable):
    """A write on a lease that had already ended: etcd answered the grant later than its TTL allowed, so a
    new lease is the way on (seen with 64 simulated agents on a loaded machine: benchmarks/rendezvous_scale.py)."""


class EtcdRequestError(Exception):
    """etcd understood the request and refused it for good (a malformed request, permission denied)."""


@dataclass(frozen=True)
class KeyValue:
    key: str
    value: bytes
    mod_revision: int
    create_revision: int
    lease: int


@dataclass(frozen=True)
class Read:
    """What :meth:`EtcdClient.read` found: each range's key-values and count, and the store's revision then."""
    ranges: list[list[KeyValue]]
    counts: list[int]
    revision: int


def _b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def prefix_end(prefix: str) -> str:
    """The ``range_end`` that makes a range cover every key starting with ``prefix``."""
    raw = bytearray(prefix.encode())
    raw[-1] += 1  # our prefixes end in "/", never in 0xff
    return base64.b64encode(bytes(raw)).decode()


def _key_values(response: dict[str, Any]) -> list[KeyValue]:
    return [KeyValue(base64.b64decode(kv["key"]).decode(), base64.b64decode(kv.get("value", "")),
                     int(kv.get("mod_revision", 0)), int(kv.get("create_revision", 0)), int(kv.get("lease", 0)))
            for kv in response.get("kvs", [])]


# Operations of a transaction: build them with these, pass them to EtcdClient.txn.
def op_range(key: str, prefix: bool = False, keys_only: bool = False, count_only: bool = False,
             oldest_first: bool = False, newest_write_first: bool = False, limit: int = 0) -> dict[str, Any]:
    """Read ``key`` (or every key under it); ``keys_only`` leaves the values out, ``count_only`` the keys too;
    ``oldest_first`` orders them by creation, ``newest_write_first`` by their last write, latest first;
    ``limit`` keeps that many (the count is still of them all)."""
    request: dict[str, Any] = {"key": _b64(key)}
    if prefix:
        request["range_end"] = prefix_end(key)
    if oldest_first:
        request.update(sort_order="ASCEND", sort_target="CREATE")
    if newest_write_first:
        request.update(sort_order="DESCEND", sort_target="MOD")
    if limit:
        request["limit"] = str(limit)
    if keys_only:
        request["keys_only"] = True
    if count_only:
        request["count_only"] = True
    return {"request_range": request}


def op_put(key: str, value: bytes | str, lease: int = 0) -> dict[str, Any]:
    request: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
    if lease:
        request["lease"] = str(lease)
    return {"request_put": request}


def op_delete(key: str, prefix: bool = False) -> dict[str, Any]:
    request: dict[str, Any] = {"key": _b64(key)}
    if prefix:
        request["range_end"] = prefix_end(key)
    return {"request_delete_range": request}


def none_created_after(prefix: str, revision: int) -> dict[str, Any]:
    """Compare: no key under ``prefix`` was created after ``revision`` (etcd 3.3+ compares over a range)."""
    return {"key": _b64(prefix), "range_end": prefix_end(prefix), "target": "CREATE", "result": "LESS",
            "create_revision": str(revision + 1)}


def unchanged_since(key: str, mod_revision: int) -> dict[str, Any]:
    """Compare: ``key`` was last written at ``mod_revision`` (0: it does not exist)."""
    if mod_revision == 0:
        return {"key": _b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
    return {"key": _b64(key), "target": "MOD", "result": "EQUAL", "mod_revision": str(mod_revision)}


class EtcdClient:
    """Thread-safe: each thread keeps its own HTTP connection to the endpoint that answered last."""

    def __init__(self, endpoints: str, timeout_s: float = 5.0, ca_file: str | None = None,
                 cert_file: str | None = None, key_file: str | None = None):
        self.timeout_s = timeout_s
        self._endpoints = [self._parse(e.strip()) for e in endpoints.split(",") if e.strip()]
        if not self._endpoints:
            raise ValueError(f"rdzv endpoint: got {endpoints!r}; allowed: host:port[,host:port...]")
        ca_file = ca_file or os.environ.get(ETCD_CA_ENV)
        cert_file = cert_file or os.environ.get(ETCD_CERT_ENV)
        key_file = key_file or os.environ.get(ETCD_KEY_ENV)
        self._tls_files = (ca_file, cert_file, key_file)
        self._tls: ssl.SSLContext | None = None
        self._tls_stamp: tuple = ()
        if ca_file or any(scheme == "https" for scheme, _, _ in self._endpoints):
            self._tls_context()
            # With a CA file, every endpoint is TLS, whatever its spelling.
            self._endpoints = [("https", host, port) for _, host, port in self._endpoints]
        self._preferred = 0
        self._local = threading.local()

    @staticmethod
    def _parse(endpoint: str) -> tuple[str, str, int]:
        scheme = "http"
        if "://" in endpoint:
            scheme, endpoint = endpoint.split("://", 1)
        host, _, port = endpoint.rpartition(":")
        if scheme not in ("http", "https") or not host or not port.isdigit():
            raise ValueError(f"rdzv endpoint: got {endpoint!r}; allowed: [http[s]://]host:port")
        return scheme, host.strip("[]"), int(port)

    # --- transport ------------------------------------------------------------------------

    def _tls_context(self) -> ssl.SSLContext:
        """The TLS context, built again whenever a certificate file changed: the platform renews the
        pods' certificates in place (a Secret volume's files are swapped), and an agent outlives them."""
        stamp = tuple((os.stat(f).st_mtime_ns, os.stat(f).st_ino) if f else None for f in self._tls_files)
        if self._tls is None or stamp != self._tls_stamp:
            ca_file, cert_file, key_file = self._tls_files
            context = ssl.create_default_context(cafile=ca_file)
            if cert_file:
                context.load_cert_chain(cert_file, key_file)
            self._tls, self._tls_stamp = context, stamp
        return self._tls

    def _connection(self, index: int) -> http.client.HTTPConnection:
        connections = getattr(self._local, "connections", None)
        if connections is None:
            connections = self._local.connections = {}
        if index not in connections:
            scheme, host, port = self._endpoints[index]
            if scheme == "https":
                connections[index] = http.client.HTTPSConnection(host, port, timeout=self.timeout_s,
                                                                 context=self._tls_context())
            else:
                connections[index] = http.client.HTTPConnection(host, port, timeout=self.timeout_s)
        return connections[index]

    def _drop(self, index: int) -> None:
        connection = self._local.connections.pop(index, None)
        if connection is not None:
            connection.close()

    def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST ``body`` to ``/v3/<path>`` on the first endpoint that answers; the decoded reply."""
        payload = json.dumps(body).encode()
        last_error: Exception | None = None
        count = len(self._endpoints)
        for attempt in range(count):
            index = (self._preferred + attempt) % count
            try:
                connection = self._connection(index)
                connection.request("POST", f"/v3/{path}", payload, {"Content-Type": "application/json"})
                response = connection.getresponse()
                data = response.read()
                status = response.status
            except ssl.SSLError as exc:  # a certificate refused either way: waiting does not mend it
                self._drop(index)
                raise EtcdRequestError(f"TLS with etcd at {self.endpoints} failed: {exc}; allowed: the CA, "
                                       f"certificate and key the platform issues ({', '.join(TLS_ENVIRONMENT)})") from exc
            except (OSError, http.client.HTTPException) as exc:  # refused, reset, timed out, a cut reply
                self._drop(index)
                last_error = exc
                continue
            self._preferred = index
            if status == 200:
                return json.loads(data or b"{}")
            try:
                detail = json.loads(data)
            except ValueError:
                detail = {"message": data.decode(errors="replace")[:200]}
            message = detail.get("message") or detail.get("error") or str(detail)
            if status >= 500 or status == 429 or detail.get("code") in (4, 14):  # DeadlineExceeded, Unavailable
                raise EtcdUnavailable(f"etcd answered {status}: {message}")
            if detail.get("code") == 5:  # NotFound: a lease that expired; callers read it as "gone"
                return {"not_found": True, "message": message}
            raise EtcdRequestError(f"etcd refused /v3/{path} ({status}): {message}")
        raise EtcdUnavailable(f"etcd is unreachable at {self.endpoints}: {last_error}")

    @property
    def endpoints(self) -> str:
        return ",".join(f"{scheme}://{host}:{port}" for scheme, host, port in self._endpoints)

    def close(self) -> None:
        for index in list(getattr(self._local, "connections", {})):
            self._drop(index)

    # --- key-value ------------------------------------------------------------------------

    def get(self, key: str) -> KeyValue | None:
        found = _key_values(self.call("kv/range", op_range(key)["request_range"]))
        return found[0] if found else None

    def get_prefix(self, prefix: str) -> list[KeyValue]:
        return _key_values(self.call("kv/range", op_range(prefix, prefix=True)["request_range"]))

    def put(self, key: str, value: bytes | str, lease: int = 0) -> int:
        """Write ``key``; the store's revision after the write. LeaseNotFound when ``lease`` has ended."""
        reply = self.call("kv/put", op_put(key, value, lease)["request_put"])
        if reply.get("not_found"):
            raise LeaseNotFound(f"etcd refused {key!r} on lease {lease}: {reply.get('message')}")
        return int(reply["header"]["revision"])

    def delete(self, key: str, prefix: bool = False) -> int:
        """Delete ``key`` (or every key under it); how many were deleted."""
        return int(self.call("kv/deleterange", op_delete(key, prefix)["request_delete_range"]).get("deleted", 0))

    def txn(self, compare: list[dict[str, Any]], success: list[dict[str, Any]],
            failure: list[dict[str, Any]] = ()) -> tuple[bool, list[list[KeyValue]]]:
        """An atomic transaction; (whether ``compare`` held, the key-values each range op read)."""
        reply = self.call("kv/txn", {"compare": compare, "success": success, "failure": list(failure)})
        ranges = [_key_values(r["response_range"]) for r in reply.get("responses", []) if "response_range" in r]
        return bool(reply.get("succeeded")), ranges

    def read(self, ranges: list[dict[str, Any]]) -> Read:
        """Several range ops read together at one revision (a transaction without compares)."""
        reply = self.call("kv/txn", {"compare": [], "success": ranges, "failure": []})
        found = [r["response_range"] for r in reply.get("responses", []) if "response_range" in r]
        return Read([_key_values(r) for r in found], [int(r.get("count", 0)) for r in found],
                    int(reply.get("header", {}).get("revision", 0)))

    # --- leases ---------------------------------------------------------------------------

    def lease_grant(self, ttl_s: int) -> tuple[int, int]:
        """A new lease; (its id, the TTL etcd granted: never below etcd's minimum, see DESIGN)."""
        reply = self.call("lease/grant", {"TTL": str(ttl_s)})
        return int(reply["ID"]), int(reply["TTL"])

    def lease_keepalive(self, lease: int) -> int:
        """Renew ``lease``; its remaining TTL, 0 when it has expired or was revoked."""
        reply = self.call("lease/keepalive", {"ID": str(lease)})
        return int(reply.get("result", {}).get("TTL", 0))

    def lease_revoke(self, lease: int) -> None:
        """End ``lease`` and delete the keys attached to it (a lease already gone is no error)."""
        self.call("lease/revoke", {"ID": str(lease)})

