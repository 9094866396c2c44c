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
JOBS ?= $(wildcard k8s_charts/examples/*.yaml)

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
XLA_VENV := .venv-xla
XLA_STAMP := $(XLA_VENV)/.installed
NODE_STAMP := node_modules/.installed
DEB_PACKAGES := etcd-server

.PHONY: synth test test-fast test-xla setup-deploy setup-test system-packages benchmark lock clean

# Synthesize into a staging folder and swap it in only on success: a bad config leaves
# the previous cdk.out as it was, and a removed stack leaves no stale template behind.
synth: setup-deploy
	rm -rf $(OUT).staging
	cdk synth --quiet --output $(OUT).staging -c config=$(CONFIG)
	rm -rf $(OUT) && mv $(OUT).staging $(OUT)
	@echo "CloudFormation templates: $$(ls $(OUT)/*.template.json | tr '\n' ' ')"
	$(PY) -m k8s_charts --config $(CONFIG) $(foreach job,$(JOBS),--job $(job)) --out $(DIST)

test: setup-test
	$(PY) -m pytest

# The trainer's Neuron path (train.device=neuron: torch_xla, the xla process group) on torch-xla's
# CPU device, in an environment of its own with the Neuron image's torch (requirements-xla.txt).
# tests/conftest.py is left out: it imports the deploy side (CDK), which this environment has not.
test-xla: $(XLA_STAMP)
	PJRT_DEVICE=CPU $(XLA_VENV)/bin/python -m pytest --noconftest -m xla tests/test_xla_training.py

# The unit tests, the snapshots and the lint, without real agents, etcd clusters or training
# runs: under two minutes on 2 cores. `make test` still runs everything.
test-fast: setup-test
	$(PY) -m pytest -m "not slow"

benchmark: setup-test
	$(PY) benchmarks/synth_time.py

setup-deploy: $(DEPLOY_STAMP) $(NODE_STAMP)
setup-test: $(TEST_STAMP) $(CHECKOV_STAMP) $(NODE_STAMP) system-packages

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

$(XLA_STAMP): requirements-xla.txt constraints.txt
	$(PYTHON) -m venv $(XLA_VENV)
	$(REGISTRY_ONLY) $(XLA_VENV)/bin/python -m pip install --quiet -r requirements-xla.txt -c constraints.txt
	touch $@

$(NODE_STAMP): package.json package-lock.json
	npm ci --no-audit --no-fund --loglevel=error
	touch $@

# Debian packages for the tests (a real etcd for rendezvous tests). Installed only when missing.
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
