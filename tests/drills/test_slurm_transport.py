"""trainctl's shell transports for Slurm: LocalShell on real processes, SsmShell through a loopback SSM
(tests/local_ssm.py) that runs what it is sent, with moto's EC2 holding the ParallelCluster head node."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import sys

import pytest

from tests.local_ssm import LocalSsm
from tests.unit import test_trainctl_aws
from tests.unit.test_trainctl_aws import REGION
from trainctl.errors import UserError
from trainctl.backends.slurm_transport import (
    CLUSTER_NAME_TAG, HEAD_NODE, NODE_TYPE_TAG, Completed, LocalShell, OutputTruncated, SsmShell,
)

# untimed (tests/machine_turns.py): nothing a busy neighbour could break; under -n it runs beside other tests
pytestmark = pytest.mark.untimed

# Prints what it got (its stdin as a digest); exits with its first argument.
aws = test_trainctl_aws.aws  # moto's AWS, the fixture test_trainctl_aws uses

ECHO = ("import hashlib, json, os, sys; data = sys.stdin.read(); "
        "print(json.dumps({'argv': sys.argv[2:], 'stdin': hashlib.sha256(data.encode()).hexdigest(), "
        "'user': os.environ.get('SHIM_TARGET_USER'), "
        "'cwd': os.getcwd()})); sys.stderr.write('note\\n'); sys.exit(int(sys.argv[1]))")
AWKWARD = ["two words", "it's", '"double"', "$HOME and ${PATH}", "line one\nline two", "*", "`id`", "a\\b", "",
           "ünïcode", "; rm -rf /"]
# An sbatch script of ~40 KB with everything a shell would interpret.
SCRIPT = "#!/bin/bash\n#SBATCH --job-name=x\n" + "".join(
    f"echo \"$SLURM_JOB_ID {i}\" 'quote' `date` \\ ${{VAR:-x}} ünï\n" for i in range(800))


def test_local_shell_passes_argv_stdin_and_exit_code_unchanged():
    done = LocalShell().run([sys.executable, "-c", ECHO, "3", *AWKWARD], input=SCRIPT)
    assert done.returncode == 3 and done.stderr == "note\n"
    seen = json.loads(done.stdout)
    assert seen["argv"] == AWKWARD and seen["stdin"] == hashlib.sha256(SCRIPT.encode()).hexdigest()


def test_local_shell_without_the_program_is_one_line():
    with pytest.raises(UserError, match="^sbatch-nowhere not found on this machine; fix: "):
        LocalShell().run(["sbatch-nowhere", "--parsable"])



def launch(session, cluster: str, node_type: str = HEAD_NODE) -> str:
    """An instance tagged as ParallelCluster tags its nodes (moto's EC2)."""
    ec2 = session.client("ec2")
    image = ec2.describe_images()["Images"][0]["ImageId"]
    tags = [{"Key": CLUSTER_NAME_TAG, "Value": cluster}, {"Key": NODE_TYPE_TAG, "Value": node_type}]
    return ec2.run_instances(ImageId=image, MinCount=1, MaxCount=1, InstanceType="c5.xlarge",
                             TagSpecifications=[{"ResourceType": "instance", "Tags": tags}])["Instances"][0]["InstanceId"]


@pytest.fixture
def head(aws, tmp_path, monkeypatch):
    """(session, head node id, the stand-in): SSM reaches the stand-in through AWS_ENDPOINT_URL_SSM."""
    launch(aws, "mltrain-slurm", "Compute")
    instance = launch(aws, "mltrain-slurm")
    # This machine has neither sudo nor a second user: a `sudo` on the stand-in's PATH checks the
    # options SsmShell passes and runs the rest as this user, saying for whom.
    bin_dir, home = tmp_path / "bin", tmp_path / "home"
    bin_dir.mkdir()
    home.mkdir()
    (bin_dir / "sudo").write_text('#!/bin/sh\n[ "$1" = -H ] && [ "$2" = -u ] && [ "$4" = -- ] || '
                                  '{ echo "sudo shim: unexpected $*" >&2; exit 90; }\n'
                                  'export SHIM_TARGET_USER="$3" HOME="$SHIM_HOME"\nshift 4\nexec "$@"\n')
    (bin_dir / "sudo").chmod(0o755)
    with LocalSsm({instance: "Online"}, env={"PATH": f"{bin_dir}:{os.environ['PATH']}",
                                             "SHIM_HOME": str(home)}) as ssm:
        monkeypatch.setenv("AWS_ENDPOINT_URL_SSM", ssm.url)
        yield aws, instance, ssm, home


def shell(session, **kwargs) -> SsmShell:
    return SsmShell(session, region=REGION, cluster_name=kwargs.pop("cluster_name", "mltrain-slurm"), poll_s=0.05,
                    **kwargs)


def test_ssm_runs_argv_unchanged_as_the_user_in_its_home_with_the_script_on_stdin(head):
    session, instance, ssm, home = head
    remote = shell(session)
    assert remote.where == f"head node {instance} of cluster mltrain-slurm (SSM)"
    done = remote.run([sys.executable, "-c", ECHO, "0", *AWKWARD], input=SCRIPT)
    assert (done.returncode, done.stderr) == (0, "note\n")
    seen = json.loads(done.stdout)
    assert seen["argv"] == AWKWARD and seen["stdin"] == hashlib.sha256(SCRIPT.encode()).hexdigest()
    assert seen["user"] == "ec2-user" and seen["cwd"] == str(home)
    assert len(SCRIPT) > 40_000 and len(ssm.sent[0]["Parameters"]["commands"][0]) < 48_000  # gzip'd
    assert [i["hidden"] for i in ssm.invocations.values()] == [0]  # read on through InvocationDoesNotExist


def test_input_too_large_for_ssm_is_one_line(head):
    noise = base64.b64encode(os.urandom(60_000)).decode()  # does not compress
    with pytest.raises(UserError, match=r"^the input for `sbatch` is too large to send through SSM \("):
        shell(head[0]).run(["sbatch"], input=noise)
    assert head[2].sent == []


def test_ssm_returns_the_exit_code_without_the_agents_failure_line(head):
    done = shell(head[0]).run([sys.executable, "-c", ECHO, "3", "x"])
    seen = {"argv": ["x"], "stdin": hashlib.sha256(b"").hexdigest(), "user": "ec2-user", "cwd": str(head[3])}
    assert done == Completed(3, json.dumps(seen) + "\n", "note\n")


@pytest.mark.parametrize(("stream", "size", "limit"), [("stdout", 30_000, "24,000"), ("stderr", 9_000, "8,000")])
def test_output_ssm_cut_short_is_named_not_returned(head, stream, size, limit):
    program = f"import sys; sys.{stream}.write('x' * {size})"
    with pytest.raises(OutputTruncated) as caught:
        shell(head[0]).run([sys.executable, "-c", program])
    assert caught.value.stream == stream
    assert f"the {stream} of `{sys.executable} -c" in caught.value.cause
    assert f"passed SSM's limit of {limit} characters and was cut" in caught.value.cause
    assert caught.value.fix.startswith("ask for less output")
    whole = shell(head[0]).run([sys.executable, "-c", f"import sys; sys.{stream}.write('x' * 20_000)"
                               if stream == "stdout" else f"import sys; sys.{stream}.write('x' * 7_000)"])
    assert getattr(whole, stream) == "x" * (20_000 if stream == "stdout" else 7_000)


def test_a_wrong_cluster_name_is_one_line_naming_the_clusters_there(head):
    launch(head[0], "other")
    with pytest.raises(UserError) as caught:
        shell(head[0], cluster_name="mltrain-slrum")
    assert str(caught.value) == ("no running head node of ParallelCluster cluster 'mltrain-slrum' in us-west-2; "
                                 "fix: clusters with a running head node there: mltrain-slurm, other; check the "
                                 "cluster name")


def test_a_stopped_head_node_is_one_line(head):
    session, instance = head[0], head[1]
    session.client("ec2").stop_instances(InstanceIds=[instance])
    with pytest.raises(UserError, match=f"^the head node {instance} of cluster 'mltrain-slurm' is stopped, not "
                                        "running; fix: start it"):
        shell(session)


def test_no_cluster_at_all_is_one_line(aws):
    with pytest.raises(UserError) as caught:
        SsmShell(aws, region=REGION, cluster_name="mltrain-slurm")
    assert str(caught.value) == ("no running head node of ParallelCluster cluster 'mltrain-slurm' in us-west-2; fix: "
                                 "deploy the Slurm stack (npx cdk deploy) or check the cluster name and region")


def test_a_head_node_ssm_does_not_know_is_one_line_with_the_policy(head):
    session, instance, ssm, _ = head
    del ssm.instances[instance]
    with pytest.raises(UserError) as caught:
        shell(session).run(["squeue"])
    assert caught.value.cause == f"the head node {instance} of cluster 'mltrain-slurm' is not registered with SSM"
    assert caught.value.fix.startswith("give the head node arn:aws:iam::aws:policy/AmazonSSMManagedInstanceCore "
                                       "(HeadNode.Iam.AdditionalIamPolicies)")


def test_a_head_node_whose_agent_lost_ssm_is_one_line(head):
    session, instance, ssm, _ = head
    ssm.instances[instance] = "ConnectionLost"
    with pytest.raises(UserError) as caught:
        shell(session, delivery_s=0.5).run(["squeue"], timeout=0.5)
    assert caught.value.cause == f"the head node {instance} of cluster 'mltrain-slurm' has SSM status ConnectionLost"
