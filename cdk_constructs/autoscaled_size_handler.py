"""Custom resource handler: the desired size a node group's template should carry right now.

A managed node group must be created with a desired size, and CloudFormation sends the
template's desired size again whenever the group's scaling config is updated, which resets the
number of nodes cluster-autoscaler chose (EKS API reference, NodegroupScalingConfig). This
handler reads the group's current desired size, clamped to the new min and max, so an update
keeps what the autoscaler chose; before the group exists it answers the initial size.

It runs in Lambda with only the standard library and boto3, and in the tests against moto.
"""

from __future__ import annotations

import json
import urllib.request


def current_desired_size(eks, cluster: str, label_key: str, label_value: str, minimum: int, maximum: int,
                         initial: int) -> int:
    """The desired size of the cluster's node group labelled ``label_key=label_value``, clamped."""
    for page in eks.get_paginator("list_nodegroups").paginate(clusterName=cluster):
        for name in page["nodegroups"]:
            group = eks.describe_nodegroup(clusterName=cluster, nodegroupName=name)["nodegroup"]
            if (group.get("labels") or {}).get(label_key) == label_value:
                return max(minimum, min(maximum, int(group["scalingConfig"]["desiredSize"])))
    return max(minimum, min(maximum, initial))


def handler(event, context, eks=None):
    props = event["ResourceProperties"]
    response = {
        "StackId": event["StackId"], "RequestId": event["RequestId"],
        "LogicalResourceId": event["LogicalResourceId"],
        "PhysicalResourceId": event.get("PhysicalResourceId") or f"{props['ClusterName']}/{props['LabelValue']}",
        "Status": "SUCCESS", "Data": {},
    }
    try:
        if event["RequestType"] in ("Create", "Update"):
            if eks is None:
                import boto3

                eks = boto3.client("eks")
            size = current_desired_size(eks, props["ClusterName"], props["LabelKey"], props["LabelValue"],
                                        int(props["MinSize"]), int(props["MaxSize"]), int(props["InitialSize"]))
            response["Data"] = {"DesiredSize": size}
    except Exception as exc:  # noqa: BLE001 - CloudFormation must always get an answer
        response.update(Status="FAILED", Reason=f"{type(exc).__name__}: {exc}"[:1000])
    body = json.dumps(response).encode()
    request = urllib.request.Request(event["ResponseURL"], data=body, method="PUT",
                                     headers={"Content-Type": "", "Content-Length": str(len(body))})
    urllib.request.urlopen(request, timeout=30).read()  # noqa: S310 - CloudFormation's pre-signed S3 URL
    return response
