"""A Kubernetes client for the platform's EKS cluster, authenticated with an EKS token made by boto3.

No kubeconfig or aws CLI is needed: the endpoint and CA come from ``eks.describe_cluster``,
and the token is a presigned STS GetCallerIdentity URL bound to the cluster's name (what
``aws eks get-token`` produces). A kubeconfig context is used instead when one is given.
"""

from __future__ import annotations

import base64
import tempfile

TOKEN_PREFIX = "k8s-aws-v1."
CLUSTER_HEADER = "x-k8s-aws-id"
TOKEN_LIFETIME_S = 60


def eks_token(session, cluster_name: str, region: str) -> str:
    """``k8s-aws-v1.`` + base64url (no padding) of a presigned STS GetCallerIdentity URL for this cluster."""
    sts = session.client("sts", region_name=region,
                         endpoint_url=f"https://sts.{region}.amazonaws.com")

    def add_cluster_header(request, **_kwargs):
        request.headers[CLUSTER_HEADER] = cluster_name

    sts.meta.events.register("before-sign.sts.GetCallerIdentity", add_cluster_header)
    url = sts.generate_presigned_url("get_caller_identity", Params={}, ExpiresIn=TOKEN_LIFETIME_S,
                                     HttpMethod="GET")
    return TOKEN_PREFIX + base64.urlsafe_b64encode(url.encode()).decode().rstrip("=")


def api_client(session, cluster_name: str, region: str, context: str | None = None):
    """A kubernetes ApiClient for the cluster (or for ``context`` from the kubeconfig)."""
    from kubernetes import client

    from trainctl.errors import UserError

    if context:
        return _context_client(context)

    eks = session.client("eks", region_name=region)
    try:
        cluster = eks.describe_cluster(name=cluster_name)["cluster"]
    except eks.exceptions.ResourceNotFoundException:
        raise UserError(f"no EKS cluster {cluster_name!r} in {region}",
                        "deploy the platform (npx cdk deploy --all) or check `name_prefix` and `region`") from None
    configuration = client.Configuration()
    configuration.host = cluster["endpoint"]
    with tempfile.NamedTemporaryFile(prefix="eks-ca-", suffix=".crt", delete=False) as ca:
        ca.write(base64.b64decode(cluster["certificateAuthority"]["data"]))
    configuration.ssl_ca_cert = ca.name
    configuration.api_key = {"authorization": "Bearer " + eks_token(session, cluster_name, region)}
    return client.ApiClient(configuration)


def _context_client(context: str):
    """A client for a kubeconfig context, or one line naming what is missing."""
    import os

    from kubernetes import config as kubeconfig
    from kubernetes.config.config_exception import ConfigException

    from trainctl.errors import UserError

    where = os.environ.get("KUBECONFIG") or "~/.kube/config"
    try:
        contexts, _ = kubeconfig.list_kube_config_contexts()
    except ConfigException:
        raise UserError(f"--context {context}: no kubeconfig at {where}",
                        "run `aws eks update-kubeconfig --name <name_prefix> --region <region>`, or leave out "
                        "--context to use an EKS token") from None
    names = sorted(c["name"] for c in contexts)
    if context not in names:
        raise UserError(f"--context: got {context!r}, which {where} does not have", f"allowed: {', '.join(names)}")
    return kubeconfig.new_client_from_config(context=context)
