"""A CloudWatch dashboard of what a training platform spends money on, and alarms for its waste.

Metric names and dimensions are what Container Insights with enhanced observability and
accelerated compute metrics publishes (aws/amazon-cloudwatch-agent,
translator/translate/otel/exporter/awsemf/kubernetes.go: node_gpu_utilization,
node_neuroncore_utilization and node_efa_*_bytes with a ClusterName rollup;
namespace_number_of_running_pods; cluster_node_count) and FSx for Lustre's AWS/FSx metrics.

Job throughput comes from the trainer's own JSON lines: the add-on's Fluent Bit sends container
logs to /aws/containerinsights/<cluster>/application with the parsed JSON under
``log_processed`` (aws-observability/helm-charts, amazon-cloudwatch-observability values.yaml,
application-log.conf), and a metric filter turns rank 0's step lines into metrics.
"""

from __future__ import annotations

from dataclasses import dataclass

from aws_cdk import Duration, RemovalPolicy, aws_cloudwatch as cw, aws_cloudwatch_actions as cw_actions, aws_logs as logs
from aws_cdk import aws_sns as sns
from constructs import Construct

from training.contract import NODE_CHECK_EVENT

CONTAINER_INSIGHTS = "ContainerInsights"
TRAINER_NAMESPACE = "ElasticTraining"
PERIOD = Duration.minutes(5)
# An accelerated node with no training pod for this long costs money for nothing. Longer than
# cluster-autoscaler's scale-down delay (10 minutes unneeded) so that a finished job's nodes
# are not reported while they drain away.
IDLE_NODE_WINDOW = 6  # periods of PERIOD: 30 minutes
GPU_IDLE_PERCENT = 10
FSX_FREE_FRACTION = 0.10


@dataclass(frozen=True)
class TrainingDashboardProps:
    cluster_name: str
    jobs_namespace: str
    file_system_id: str
    file_system_capacity_gib: int
    log_retention: logs.RetentionDays
    gpu_groups: tuple[str, ...]  # node group names, for the titles
    neuron_groups: tuple[str, ...]
    alarm_topic_arn: str | None = None
    # Where the node check's pods run (k8s_charts/node_check.py); None: no node check, no graph of it.
    node_check_namespace: str | None = None


class TrainingDashboard(Construct):
    """``application_logs`` is the log group where pods' logs stay after the pods are gone."""

    def __init__(self, scope: Construct, id: str, props: TrainingDashboardProps) -> None:
        super().__init__(scope, id)
        self._props = props
        # Created here, not by Fluent Bit on first write, so that it has a retention and the
        # metric filter has something to attach to (the add-on waits for it).
        self.application_logs = logs.LogGroup(
            self, "ApplicationLogs", log_group_name=f"/aws/containerinsights/{props.cluster_name}/application",
            retention=props.log_retention, removal_policy=RemovalPolicy.RETAIN)
        self.samples_per_s = self._from_trainer_logs("SamplesPerSecond", "samples_per_s")
        self.loss = self._from_trainer_logs("Loss", "loss")
        # Every rank's own step time (input wait and forward passes, training/loop/stragglers.py): the
        # median and the slowest; a gap between them that stays is a straggler, which is also counted.
        self.rank_step_median = self._from_trainer_logs("RankStepSecondsMedian", "rank_step_s.median")
        self.rank_step_max = self._from_trainer_logs("RankStepSecondsMax", "rank_step_s.max")
        self.stragglers = self._from_trainer_logs("StragglersNamed", None, event="straggler")
        # Accelerated nodes that failed their node check (training/node_check prints one line per verdict).
        self.failed_node_checks = None if props.node_check_namespace is None else self._from_trainer_logs(
            "NodeChecksFailed", None, event=NODE_CHECK_EVENT, namespace=props.node_check_namespace,
            condition=logs.FilterPattern.boolean_value("$.log_processed.passed", False))

        gpu_util = self._insights("node_gpu_utilization", "Average", "GPU utilization (mean)")
        neuron_util = self._insights("node_neuroncore_utilization", "Average", "NeuronCore utilization (mean)")
        gpu_nodes = self._nodes_reporting("node_gpu_utilization", "GPU nodes")
        neuron_nodes = self._nodes_reporting("node_neuroncore_utilization", "Neuron nodes")
        free = cw.Metric(namespace="AWS/FSx", metric_name="FreeDataStorageCapacity",
                         dimensions_map={"FileSystemId": props.file_system_id}, statistic="Minimum", period=PERIOD,
                         label="free bytes")

        self.dashboard = cw.Dashboard(self, "Dashboard", dashboard_name=f"{props.cluster_name}-training",
                                      default_interval=Duration.hours(6))
        self.dashboard.add_widgets(
            cw.GraphWidget(title="Job throughput (rank 0's samples/s)", left=[self.samples_per_s],
                           right=[self.loss], width=12),
            cw.GraphWidget(title="Accelerator utilization %", left=[gpu_util, neuron_util],
                           left_y_axis=cw.YAxisProps(min=0, max=100), width=12),
        )
        self.dashboard.add_widgets(
            cw.GraphWidget(title="Ranks' own step time (s: input wait and forward), median and slowest",
                           left=[self.rank_step_median.with_(label="median rank"),
                                 self.rank_step_max.with_(label="slowest rank")],
                           right=[self.stragglers.with_(statistic="Sum", label="stragglers named"),
                                  *([self.failed_node_checks.with_(statistic="Sum", label="nodes that failed their check")]
                                    if self.failed_node_checks else [])], width=24),
        )
        self.dashboard.add_widgets(
            cw.GraphWidget(title="Nodes: " + ", ".join(
                [f"GPU ({', '.join(props.gpu_groups)})"] * bool(props.gpu_groups)
                + [f"Neuron ({', '.join(props.neuron_groups)})"] * bool(props.neuron_groups) + ["all"]),
                left=[gpu_nodes, neuron_nodes, self._insights("cluster_node_count", "Maximum", "all nodes")],
                width=8),
            cw.GraphWidget(title="EFA traffic (bytes/s)", left=[
                self._per_second(self._insights("node_efa_rx_bytes", "Sum"), "received"),
                self._per_second(self._insights("node_efa_tx_bytes", "Sum"), "sent")], width=8),
            cw.GraphWidget(title="FSx for Lustre throughput (bytes/s)", left=[
                self._per_second(self._fsx("DataReadBytes"), "read"),
                self._per_second(self._fsx("DataWriteBytes"), "written")], right=[free], width=8),
        )
        self.alarms = self._alarms(gpu_util, free)

    # --- metrics ---------------------------------------------------------------------------

    def _insights(self, name: str, statistic: str, label: str | None = None, **dimensions: str) -> cw.Metric:
        return cw.Metric(namespace=CONTAINER_INSIGHTS, metric_name=name, statistic=statistic, period=PERIOD,
                         dimensions_map={"ClusterName": self._props.cluster_name, **dimensions}, label=label)

    def _nodes_reporting(self, metric: str, label: str) -> cw.MathExpression:
        """How many nodes report the metric now: one time series per node in its per-node schema."""
        return cw.MathExpression(
            expression=(f'SELECT COUNT({metric}) FROM SCHEMA("{CONTAINER_INSIGHTS}", ClusterName, InstanceId, '
                        f"NodeName) WHERE ClusterName = '{self._props.cluster_name}'"),
            label=label, period=PERIOD, using_metrics={})

    def _fsx(self, name: str) -> cw.Metric:
        return cw.Metric(namespace="AWS/FSx", metric_name=name, statistic="Sum", period=PERIOD,
                         dimensions_map={"FileSystemId": self._props.file_system_id})

    @staticmethod
    def _per_second(total: cw.Metric, label: str) -> cw.MathExpression:
        name = label.replace(" ", "_")  # ids must differ between the expressions of one graph
        return cw.MathExpression(expression=f"{name} / PERIOD({name})", using_metrics={name: total}, label=label,
                                 period=PERIOD)

    def _from_trainer_logs(self, name: str, field: str | None, event: str = "step", namespace: str | None = None,
                           condition: logs.JsonPattern | None = None) -> cw.Metric:
        """A metric from ``event`` lines (rank 0's, in the jobs namespace unless ``namespace`` names another;
        see the module docstring) that meet ``condition``: ``field``'s value, or 1 per line when ``field`` is None."""
        logs.MetricFilter(
            self, f"{name}Filter", log_group=self.application_logs, metric_namespace=TRAINER_NAMESPACE,
            metric_name=name, metric_value=f"$.log_processed.{field}" if field else "1",
            filter_pattern=logs.FilterPattern.all(
                logs.FilterPattern.string_value("$.kubernetes.namespace_name", "=",
                                                namespace or self._props.jobs_namespace),
                logs.FilterPattern.string_value("$.log_processed.event", "=", event),
                *([condition] if condition else [])))
        return cw.Metric(namespace=TRAINER_NAMESPACE, metric_name=name, statistic="Average", period=PERIOD)

    # --- alarms ----------------------------------------------------------------------------

    def _alarms(self, gpu_util: cw.Metric, free: cw.Metric) -> list[cw.Alarm]:
        props = self._props
        # Accelerators up: any GPU or NeuronCore sample in the period (their ClusterName rollups).
        gpu_samples = self._insights("node_gpu_utilization", "SampleCount")
        neuron_samples = self._insights("node_neuroncore_utilization", "SampleCount")
        training_pods = self._insights("namespace_number_of_running_pods", "Maximum", Namespace=props.jobs_namespace)
        idle_nodes = cw.MathExpression(
            expression="IF((FILL(gpu, 0) + FILL(neuron, 0)) > 0 AND FILL(pods, 0) == 0, 1, 0)",
            using_metrics={"gpu": gpu_samples, "neuron": neuron_samples, "pods": training_pods},
            label="accelerated nodes up, no training pod", period=PERIOD)
        gpus_idle = cw.MathExpression(
            expression=f"IF(FILL(n, 0) > 0 AND u < {GPU_IDLE_PERCENT}, 1, 0)",
            using_metrics={"u": gpu_util, "n": gpu_samples}, label="GPUs up but idle", period=PERIOD)
        capacity = props.file_system_capacity_gib * 2**30
        alarms = [
            cw.Alarm(self, "AcceleratedNodesWithoutTraining", metric=idle_nodes, threshold=1,
                     comparison_operator=cw.ComparisonOperator.GREATER_THAN_OR_EQUAL_TO_THRESHOLD,
                     evaluation_periods=IDLE_NODE_WINDOW, treat_missing_data=cw.TreatMissingData.NOT_BREACHING,
                     alarm_description="Accelerated nodes have run for 30 minutes with no pod in the jobs namespace: "
                                       "check for a stuck scale-down (cluster-autoscaler logs) or a node group's "
                                       "min_size above 0."),
            cw.Alarm(self, "GpusIdle", metric=gpus_idle, threshold=1,
                     comparison_operator=cw.ComparisonOperator.GREATER_THAN_OR_EQUAL_TO_THRESHOLD,
                     evaluation_periods=IDLE_NODE_WINDOW, treat_missing_data=cw.TreatMissingData.NOT_BREACHING,
                     alarm_description=f"GPUs have averaged under {GPU_IDLE_PERCENT} % for 30 minutes while up: a job "
                                       "waiting on data or peers, or hung; see `trainctl status`."),
            cw.Alarm(self, "FileSystemNearlyFull", metric=free, threshold=capacity * FSX_FREE_FRACTION,
                     comparison_operator=cw.ComparisonOperator.LESS_THAN_THRESHOLD, evaluation_periods=1,
                     treat_missing_data=cw.TreatMissingData.NOT_BREACHING,
                     alarm_description=f"FSx for Lustre has under {FSX_FREE_FRACTION:.0%} free: checkpoints will fail "
                                       "to save; raise fsx.storage_capacity_gib or lower checkpoint.keep_last."),
        ]
        if props.alarm_topic_arn:
            topic = sns.Topic.from_topic_arn(self, "AlarmTopic", props.alarm_topic_arn)
            for alarm in alarms:
                alarm.add_alarm_action(cw_actions.SnsAction(topic))
        self.dashboard.add_widgets(cw.AlarmStatusWidget(title="Waste alarms", alarms=alarms, width=24))
        return alarms
