"""The dashboard and waste alarms read metrics that really exist (issue 17, item 8).

Container Insights names and dimension sets: aws/amazon-cloudwatch-agent,
translator/translate/otel/exporter/awsemf/kubernetes.go (metric declarations for GPU, Neuron, EFA,
namespace and cluster metrics). A metric asked for with another dimension set is never published,
and its widget or alarm would stay empty.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.conftest import config_variant

# metric -> the dimension sets the agent publishes it with (the ones this platform may use).
PUBLISHED = {
    "node_gpu_utilization": [{"ClusterName"}, {"ClusterName", "NodeName", "InstanceId"}],
    "node_neuroncore_utilization": [{"ClusterName"}, {"ClusterName", "InstanceId", "NodeName"}],
    "node_efa_rx_bytes": [{"ClusterName"}, {"ClusterName", "NodeName", "InstanceId"}],
    "node_efa_tx_bytes": [{"ClusterName"}, {"ClusterName", "NodeName", "InstanceId"}],
    "cluster_node_count": [{"ClusterName"}],
    "namespace_number_of_running_pods": [{"ClusterName", "Namespace"}],
}


@pytest.fixture(scope="module")
def cluster_template(synth):
    result = synth(config_variant())
    return result.template(result.platform.cluster).to_json()


def resources(template, kind):
    return {k: v for k, v in template["Resources"].items() if v["Type"] == kind}


def dashboard_body(template) -> str:
    (dashboard,) = resources(template, "AWS::CloudWatch::Dashboard").values()
    parts = dashboard["Properties"]["DashboardBody"]["Fn::Join"][1]
    return "".join(p if isinstance(p, str) else "<token>" for p in parts)


def test_the_dashboard_shows_accelerators_efa_fsx_nodes_and_job_throughput(cluster_template):
    body = json.loads(dashboard_body(cluster_template).replace('"<token>"', '"x"').replace("<token>", "x"))
    titles = [w["properties"].get("title", "") for w in body["widgets"]]
    assert titles == ["Job throughput (rank 0's samples/s)", "Accelerator utilization %",
                      "Ranks' own step time (s: input wait and forward), median and slowest",
                      "Nodes: GPU (p4d), Neuron (trn1), all", "EFA traffic (bytes/s)",
                      "FSx for Lustre throughput (bytes/s)", "Waste alarms"]
    text = json.dumps(body)
    for needed in ("node_gpu_utilization", "node_neuroncore_utilization", "node_efa_rx_bytes", "node_efa_tx_bytes",
                   "DataReadBytes", "DataWriteBytes", "FreeDataStorageCapacity", "SamplesPerSecond",
                   "cluster_node_count", "SELECT COUNT(node_gpu_utilization)"):
        assert needed in text


def test_every_container_insights_metric_uses_a_published_dimension_set(cluster_template):
    body = json.loads(dashboard_body(cluster_template).replace('"<token>"', '"x"').replace("<token>", "x"))
    seen = []
    for widget in body["widgets"]:
        for row in widget["properties"].get("metrics", []):
            strings = [x for x in row if isinstance(x, str)]
            if strings[:1] == ["ContainerInsights"]:
                name, pairs = strings[1], strings[2:]
                seen.append(name)
                assert set(pairs[0::2]) in PUBLISHED[name], (name, pairs)
    for alarm in resources(cluster_template, "AWS::CloudWatch::Alarm").values():
        for query in alarm["Properties"].get("Metrics", []):
            stat = query.get("MetricStat")
            if stat and stat["Metric"]["Namespace"] == "ContainerInsights":
                name = stat["Metric"]["MetricName"]
                seen.append(name)
                assert {d["Name"] for d in stat["Metric"]["Dimensions"]} in PUBLISHED[name], name
    assert {"node_gpu_utilization", "namespace_number_of_running_pods", "cluster_node_count"} <= set(seen)
    # The per-node schema a Metrics Insights COUNT reads is a published one too.
    for schema in re.findall(r'SCHEMA\(\\?"ContainerInsights\\?", ([^)]*)\)', dashboard_body(cluster_template)):
        assert {d.strip() for d in schema.split(",")} in PUBLISHED["node_gpu_utilization"]


def test_job_throughput_comes_from_rank_0s_step_lines_in_the_application_log_group(cluster_template):
    (group,) = [g for g in resources(cluster_template, "AWS::Logs::LogGroup").values()
                if g["Properties"].get("LogGroupName") == "/aws/containerinsights/mltrain/application"]
    assert group["Properties"]["RetentionInDays"] == 30 and group["DeletionPolicy"] == "Retain"
    filters = {f["Properties"]["MetricTransformations"][0]["MetricName"]: f["Properties"]
               for f in resources(cluster_template, "AWS::Logs::MetricFilter").values()}
    assert set(filters) == {"SamplesPerSecond", "Loss", "RankStepSecondsMedian", "RankStepSecondsMax",
                            "StragglersNamed", "NodeChecksFailed"}
    # 1 per failed node check: the check's verdict lines in its own namespace (training/node_check).
    assert filters["NodeChecksFailed"]["FilterPattern"] == (
        '{ ($.kubernetes.namespace_name = "training-node-check") && ($.log_processed.event = "node_check") && '
        "($.log_processed.passed IS FALSE) }")
    # The spread of the ranks' own step times (the step line's rank_step_s), and 1 per straggler line.
    assert filters["RankStepSecondsMax"]["MetricTransformations"][0]["MetricValue"] == (
        "$.log_processed.rank_step_s.max")
    assert filters["StragglersNamed"]["MetricTransformations"][0]["MetricValue"] == "1"
    assert filters["StragglersNamed"]["FilterPattern"] == (
        '{ ($.kubernetes.namespace_name = "training") && ($.log_processed.event = "straggler") }')
    assert filters["SamplesPerSecond"]["FilterPattern"] == (
        '{ ($.kubernetes.namespace_name = "training") && ($.log_processed.event = "step") }')
    assert filters["SamplesPerSecond"]["MetricTransformations"][0]["MetricValue"] == "$.log_processed.samples_per_s"
    # Created before the add-on, whose Fluent Bit would otherwise create it without a retention.
    (addon,) = [a for a in resources(cluster_template, "AWS::EKS::Addon").values()
                if a["Properties"]["AddonName"] == "amazon-cloudwatch-observability"]
    (group_id,) = [k for k, g in resources(cluster_template, "AWS::Logs::LogGroup").items()
                   if g["Properties"].get("LogGroupName") == "/aws/containerinsights/mltrain/application"]
    assert group_id in addon["DependsOn"]


def test_alarms_for_the_failures_that_cost_money(cluster_template):
    alarms = {k: v["Properties"] for k, v in resources(cluster_template, "AWS::CloudWatch::Alarm").items()}
    by_name = {next(n for n in ("AcceleratedNodesWithoutTraining", "GpusIdle", "FileSystemNearlyFull") if n in k): a
               for k, a in alarms.items()}
    assert set(by_name) == {"AcceleratedNodesWithoutTraining", "GpusIdle", "FileSystemNearlyFull"}
    idle = by_name["AcceleratedNodesWithoutTraining"]
    assert idle["EvaluationPeriods"] == 6 and idle["TreatMissingData"] == "notBreaching"
    expression = next(m["Expression"] for m in idle["Metrics"] if "Expression" in m)
    assert expression == "IF((FILL(gpu, 0) + FILL(neuron, 0)) > 0 AND FILL(pods, 0) == 0, 1, 0)"
    pods = next(m for m in idle["Metrics"] if m["Id"] == "pods")["MetricStat"]["Metric"]
    assert {"Name": "Namespace", "Value": "training"} in pods["Dimensions"]
    full = by_name["FileSystemNearlyFull"]
    (free,) = [m["MetricStat"]["Metric"] for m in full["Metrics"]]
    assert free["MetricName"] == "FreeDataStorageCapacity" and full["Threshold"] == 1200 * 2**30 * 0.10
    assert all("AlarmActions" not in a for a in alarms.values())  # no topic configured


def test_alarms_notify_the_configured_topic(synth):
    arn = "arn:aws:sns:us-west-2:123456789012:ml-platform-alarms"
    result = synth(config_variant(**{"monitoring.alarm_topic_arn": arn}))
    template = result.template(result.platform.cluster).to_json()
    for alarm in resources(template, "AWS::CloudWatch::Alarm").values():
        assert alarm["Properties"]["AlarmActions"] == [arn]
