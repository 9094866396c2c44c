"""Volcano v1.15.1's job controller and job webhooks, reduced to the rules that decide a job's fate.

Read at tag v1.15.1 of volcano-sh/volcano; each rule names where it lives. Go cannot run here,
so the tests drive this model with the rendered Job's own spec: what it does with a pod that
fails, is deleted, or exits with one of the launcher's statuses.

- webhooks/admission/jobs/mutate/mutate_job.go patchDefaultMaxRetry: maxRetry 0 becomes 3.
- webhooks/admission/jobs/validate/util.go validatePolicies: an event or an exit code, not
  both; exit code 0 refused; no event or exit code twice; allowed events and actions.
- controllers/job/job_controller_util.go applyPolicies: the first policy in list order whose
  event matches, or whose exit code equals the first container's; no match is SyncJob.
- controllers/job/job_controller_handler.go: a pod turning Failed raises PodFailed with its exit
  code (updatePod); any deletion not made by the controller raises PodEvicted (deletePod).
- controllers/job/state/running.go: RestartJob and RestartTask/Pod/Partition add one to
  RetryCount and move to Restarting; Abort, Terminate and Complete do not count; anything
  else is SyncJob, which recreates missing pods (job_controller_actions.go syncJob) and
  completes the job once minSuccess pods succeeded.
- controllers/job/state/restarting.go: Failed once RetryCount >= maxRetry.
- controllers/job/job_controller_actions.go killPods: a RestartPod deletes the pod, runs every
  plugin's OnJobDelete and deletes the job's PodGroup.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ALLOWED_EVENTS = {"*", "PodFailed", "PodEvicted", "PodPending", "Unknown", "TaskCompleted", "TaskFailed",
                  "JobUpdated"}
ALLOWED_ACTIONS = {"AbortJob", "RestartJob", "RestartTask", "RestartPod", "RestartPartition", "TerminateJob",
                   "CompleteJob", "ResumeJob"}
COUNTED = {"RestartJob", "RestartTask", "RestartPod", "RestartPartition"}


def mutate(spec: dict) -> dict:
    """What the mutating webhook makes of a Job's spec (the fields modelled here)."""
    return {**spec, "maxRetry": spec.get("maxRetry") or 3}


def policy_problems(policies: list[dict]) -> list[str]:
    """validatePolicies' refusals."""
    problems, events, codes = [], set(), set()
    for policy in policies:
        names = [*policy.get("events", []), *([policy["event"]] if "event" in policy else [])]
        if names and "exitCode" in policy:
            problems.append("must not specify event and exitCode simultaneously")
        elif not names and "exitCode" not in policy:
            problems.append("either event and exitCode should be specified")
        elif names:
            for name in names:
                if name not in ALLOWED_EVENTS or policy["action"] not in ALLOWED_ACTIONS:
                    problems.append(f"invalid policy event or action: {name} {policy['action']}")
                if name in events:
                    problems.append(f"duplicate event {name} across different policy")
                events.add(name)
        elif policy["exitCode"] == 0:
            problems.append("0 is not a valid error code")
        elif policy["exitCode"] in codes:
            problems.append(f"duplicate exitCode {policy['exitCode']}")
        else:
            codes.add(policy["exitCode"])
    if "*" in events and len(events) > 1:
        problems.append("if there's * here, no other policy should be here")
    return problems


def action_for(policies: list[dict], event: str, exit_code: int | None = None) -> str:
    for policy in policies:
        if event in [*policy.get("events", []), *([policy["event"]] if "event" in policy else [])]:
            return policy["action"]
        if exit_code and policy.get("exitCode") == exit_code:
            return policy["action"]
    return "SyncJob"


@dataclass
class ControlledJob:
    """One Volcano Job as its controller keeps it: phase, RetryCount, version, pods, PodGroup."""

    spec: dict
    phase: str = "Running"
    retry_count: int = 0
    version: int = 0
    podgroup_deletions: int = 0
    plugin_deletions: int = 0
    pods: dict[int, str] = field(default_factory=dict)  # index -> Running / Failed / Succeeded
    actions: list[str] = field(default_factory=list)

    @classmethod
    def admitted(cls, spec: dict) -> "ControlledJob":
        problems = policy_problems(spec.get("policies", []))
        if problems:
            raise ValueError(f"the admission webhook refuses the job: {problems}")
        spec = mutate(spec)
        replicas = sum(task["replicas"] for task in spec["tasks"])
        return cls(spec, pods={i: "Running" for i in range(replicas)})

    @property
    def finished(self) -> bool:
        return self.phase in ("Failed", "Terminated", "Completed", "Aborted")

    def pod_exits(self, index: int, exit_code: int) -> None:
        """The pod's container ended with ``exit_code`` (nonzero: the pod is Failed)."""
        self.pods[index] = "Failed"
        self._execute(action_for(self.spec.get("policies", []), "PodFailed", exit_code), index)

    def pod_deleted(self, index: int) -> None:
        """Someone other than the controller deleted the pod (a drain, a lost node's garbage collection)."""
        self.pods.pop(index, None)
        self._execute(action_for(self.spec.get("policies", []), "PodEvicted"), index)

    def drained(self, index: int) -> None:
        """A drain: the eviction deletes the pod, its agent exits on SIGTERM, the object goes."""
        from training.contract import EXIT_STOPPED

        self.pod_exits(index, EXIT_STOPPED)
        if not self.finished:
            self.pod_deleted(index)

    def _execute(self, action: str, index: int) -> None:
        if self.finished:
            return
        self.actions.append(action)
        if action in COUNTED:
            self.retry_count += 1
            self.phase = "Restarting"
            self.plugin_deletions += len(self.spec.get("plugins", {}))
            self.podgroup_deletions += 1
            if action == "RestartJob":
                self.version += 1
                self.pods = {i: "Running" for i in self.pods}
            else:
                self.pods[index] = "Running"  # deleted; recreated once the PodGroup is back
            if self.retry_count >= self.spec["maxRetry"]:
                self.phase = "Failed"
                return
            self.phase = "Running"
        elif action == "TerminateJob":
            self.phase = "Terminated"
        elif action == "AbortJob":
            self.phase = "Aborted"
        elif action == "CompleteJob":
            self.phase = "Completed"
        else:  # SyncJob (and ResumeJob, which the Running state treats as a sync)
            replicas = sum(task["replicas"] for task in self.spec["tasks"])
            for i in range(replicas):
                self.pods.setdefault(i, "Running")  # a missing pod is created again
            if sum(state == "Succeeded" for state in self.pods.values()) >= self.spec.get("minSuccess", replicas):
                self.phase = "Completed"
