"""IAM roles for Kubernetes service accounts through EKS Pod Identity (no OIDC provider needed)."""

from __future__ import annotations

from aws_cdk import aws_eks_v2 as eks, aws_iam as iam
from constructs import Construct

POD_IDENTITY_PRINCIPAL = "pods.eks.amazonaws.com"


def pod_identity_role(scope: Construct, id: str, description: str) -> iam.Role:
    """A role only EKS Pod Identity can assume; associate it with a service account to use it."""
    role = iam.Role(scope, id, description=description, assumed_by=iam.ServicePrincipal(POD_IDENTITY_PRINCIPAL))
    # Pod Identity also tags the session with the pod's attributes.
    role.assume_role_policy.add_statements(iam.PolicyStatement(
        actions=["sts:TagSession"], principals=[iam.ServicePrincipal(POD_IDENTITY_PRINCIPAL)]))
    return role


def associate(scope: Construct, id: str, cluster_name: str, namespace: str, service_account: str,
              role: iam.IRole) -> eks.CfnPodIdentityAssociation:
    return eks.CfnPodIdentityAssociation(scope, id, cluster_name=cluster_name, namespace=namespace,
                                         service_account=service_account, role_arn=role.role_arn)


class PodIdentityRole(Construct):
    """``role`` is assumable only by pods of ``namespace/service_account`` in ``cluster``."""

    def __init__(self, scope: Construct, id: str, *, cluster: eks.ICluster, namespace: str,
                 service_account: str, description: str, associate_now: bool = True) -> None:
        """``associate_now=False`` when an EKS add-on creates the association itself."""
        super().__init__(scope, id)
        self.role = pod_identity_role(self, "Role", description)
        if associate_now:
            associate(self, "Association", cluster.cluster_name, namespace, service_account, self.role)
        self.namespace, self.service_account = namespace, service_account
