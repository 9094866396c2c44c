"""The trainer images: pinned bases, the same pins as the tests use, no CDK inside."""

from __future__ import annotations

import ast
import re

import pytest
import yaml

from k8s_charts.job_charts import TRAINER_UID
from training.contract import LAUNCHER_PACKAGE, PLATFORM_APP_DIR
from tests.conftest import REPO

DOCKER = REPO / "training" / "docker"
PINS = dict(
    line.split("==") for line in (REPO / "training/requirements.txt").read_text().splitlines()
    if "==" in line and not line.startswith("#")
)


@pytest.mark.parametrize("name", ["Dockerfile.gpu", "Dockerfile.neuron", "Dockerfile.torchtitan", "Dockerfile.neuron-nxd"])
def test_base_images_are_pinned_to_a_version(name):
    text = (DOCKER / name).read_text()
    bases = re.findall(r"^ARG \w+_BASE=(\S+)$", text, re.MULTILINE)
    assert bases and all(re.search(r":\d[\w.-]*$|@sha256:[0-9a-f]{64}$", b) and "latest" not in b for b in bases)


@pytest.mark.parametrize("name", ["Dockerfile.gpu", "Dockerfile.neuron"])
def test_images_install_the_pinned_trainer_requirements_and_only_the_trainer(name):
    text = (DOCKER / name).read_text()
    assert "training/requirements.txt" in text
    copied = {path for line in re.findall(r"^COPY (.+)$", text, re.MULTILINE) for path in line.split()[:-1]}
    extra = {"training/requirements-gpu.txt"} if name == "Dockerfile.gpu" else set()
    assert copied == {"training/requirements.txt", "typed_config/", "training/"} | extra


def test_the_gpu_image_adds_the_torchvision_built_for_the_pinned_torch():
    gpu = (REPO / "training/requirements-gpu.txt").read_text().splitlines()
    assert "-r requirements.txt" in gpu and "torchvision" not in PINS  # CPU torch cannot load it
    (torchvision,) = [line.split("==")[1] for line in gpu if line.startswith("torchvision==")]
    torch_minor = int(PINS["torch"].split(".")[1])
    assert torchvision == f"0.{torch_minor + 15}.0"  # 0.28 goes with 2.13, 0.26 with 2.11 (each release pairs so)
    # torchvision 0.29 deprecates the decoders data.decode=device calls (training/data/decode.py), in
    # favour of TorchCodec: a torch that needs 0.29 or later needs that decoder moved first.
    assert int(torchvision.split(".")[1]) < 29, (
        "torchvision.io.decode_jpeg is deprecated from 0.29: move NvjpegDecoder to TorchCodec")
    assert "-r /tmp/requirements-gpu.txt" in (DOCKER / "Dockerfile.gpu").read_text()


def test_the_trainer_needs_no_etcd_client_package():
    # The rendezvous speaks etcd's v3 API with the standard library (training/launcher/etcd_v3.py), so the
    # launcher can run in an image that has torch and nothing of ours.
    assert not {"python-etcd", "etcd3gw", "etcd3", "dnspython"} & set(PINS)


def test_the_gpu_image_carries_efa_and_runs_as_a_user():
    text = (DOCKER / "Dockerfile.gpu").read_text()
    assert re.search(r"^ARG EFA_INSTALLER_VERSION=\d+\.\d+\.\d+$", text, re.MULTILINE)
    assert "--skip-kmod" in text and "ofi-nccl" in text
    assert re.search(rf"^USER {TRAINER_UID}$", text, re.MULTILINE)  # the user the pods run as


def test_the_neuron_image_runs_as_the_same_user():
    text = (DOCKER / "Dockerfile.neuron").read_text()
    assert re.search(rf"^RUN useradd --uid {TRAINER_UID} ", text, re.MULTILINE)
    assert re.search(rf"^USER {TRAINER_UID}$", text, re.MULTILINE)



@pytest.mark.parametrize("name", ["Dockerfile.gpu", "Dockerfile.neuron"])
def test_the_images_keep_the_launcher_where_the_init_containers_copy_it_from(name):
    # The launcher's init container (k8s_charts/job_charts.py launcher_container; on Batch, trainctl/backends/batch.py,
    # which has no working-directory setting) runs its copy in the image's WORKDIR: it must be PLATFORM_APP_DIR,
    # holding training/ whole.
    text = (DOCKER / name).read_text()
    assert re.findall(r"^WORKDIR (\S+)$", text, re.MULTILINE)[-1] == PLATFORM_APP_DIR
    assert re.search(r"^COPY training/ training/$", text, re.MULTILINE)
    assert all((REPO / path).exists() for path in LAUNCHER_PACKAGE)


# --- images for a job's own program (docs/llm-training.md): the example jobs run them -------------

EXAMPLES = REPO / "k8s_charts" / "examples"
TITAN_PINS = dict(
    line.split("==") for line in (DOCKER / "torchtitan" / "requirements.txt").read_text().splitlines()
    if "==" in line and not line.startswith("#")
)


def example_program(name: str) -> dict:
    return yaml.safe_load((EXAMPLES / name).read_text())["program"]


@pytest.mark.parametrize("name", ["Dockerfile.torchtitan", "Dockerfile.neuron-nxd"])
def test_program_images_run_as_the_pods_user_and_carry_nothing_of_the_platform(name):
    text = (DOCKER / name).read_text()
    assert re.search(rf"^RUN useradd --uid {TRAINER_UID} ", text, re.MULTILINE)
    assert re.search(rf"^USER {TRAINER_UID}$", text, re.MULTILINE)
    copied = {path for line in re.findall(r"^COPY (.+)$", text, re.MULTILINE) for path in line.split()[:-1]}
    # The launcher reaches the pods from the platform's image (an init container), never from these.
    assert not {p for p in copied if p.startswith(("training/", "typed_config/")) and "/docker/" not in p}


def test_the_torchtitan_image_pins_the_torchtitan_the_cpu_drill_runs_and_a_torch_it_can_call():
    drilled = dict(line.split("==") for line in (REPO / "tests/requirements-torchtitan.txt").read_text().splitlines()
                   if "==" in line and not line.startswith("#"))
    assert TITAN_PINS["torchtitan"] == drilled["torchtitan"] == "0.3.0"
    # torchtitan 0.3.0 calls torch.distributed.set_timeout (torchtitan/distributed/utils.py:595), new in torch 2.14.
    assert tuple(int(n) for n in TITAN_PINS["torch"].split(".")[:2]) >= (2, 14)
    shared = set(TITAN_PINS) & set(drilled) - {"torch"}
    assert shared and all(TITAN_PINS[p] == drilled[p] for p in shared)
    assert "torchtitan/requirements.txt" in (DOCKER / "Dockerfile.torchtitan").read_text()


def test_the_torchtitan_example_names_the_config_module_the_image_carries():
    text = (DOCKER / "Dockerfile.torchtitan").read_text()
    (workdir,) = re.findall(r"^WORKDIR (\S+)$", text, re.MULTILINE)
    assert re.search(r"^COPY training/docker/torchtitan/platform_llama3.py platform_llama3.py$", text, re.MULTILINE)
    program = example_program("llama3-8b-torchtitan-p5.yaml")
    args = program["args"]
    assert program["module"] == "torchtitan.train" and workdir == "/workspace"  # python -m: the workdir is on sys.path
    module, config = args[args.index("--module") + 1], args[args.index("--config") + 1]
    source = (DOCKER / "torchtitan" / f"{module}.py").read_text()
    assert config in {node.name for node in ast.parse(source).body if isinstance(node, ast.FunctionDef)}


def test_the_nxd_image_is_the_platforms_neuron_base_with_the_example_at_the_same_sdk_release():
    nxd, platform = (DOCKER / "Dockerfile.neuron-nxd").read_text(), (DOCKER / "Dockerfile.neuron").read_text()
    base = re.compile(r"^ARG NEURON_BASE=(\S+)$", re.MULTILINE)
    assert base.findall(nxd) == base.findall(platform)
    (sdk,) = re.findall(r"-sdk(\d+\.\d+\.\d+)-", base.findall(nxd)[0])
    assert re.search(rf"^ARG NXD_EXAMPLES_TAG=v{re.escape(sdk)}$", nxd, re.MULTILINE)
    assert re.search(r"^ARG NXD_VERSION=\d+\.\d+\.\d+$", nxd, re.MULTILINE)
    # The example job's script lies in the folder the image unpacks the examples into.
    assert example_program("llama-nxd-trn1.yaml")["script"].startswith("/workspace/llama/tp_zero1_llama_hf_pretrain/")
    assert "examples/training/llama" in nxd and re.search(r"^WORKDIR /workspace$", nxd, re.MULTILINE)


def test_the_torchtitan_config_module_spells_the_contracts_names_as_the_contract_does():
    """It runs in the user's image, where training.contract cannot be imported: its copies must agree."""
    from training import contract

    source = (DOCKER / "torchtitan" / "platform_llama3.py").read_text()
    constants = {node.targets[0].id: node.value.value for node in ast.parse(source).body
                 if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)}
    assert constants == {"CHECKPOINT_DIR_ENV": contract.CHECKPOINT_DIR_ENV, "EXIT_CONFIG": contract.EXIT_CONFIG}
