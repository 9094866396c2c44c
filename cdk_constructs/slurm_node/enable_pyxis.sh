#!/bin/bash
# OnNodeConfigured custom action of the slurm stack's head node (argument "head") and compute nodes
# ("compute"): turns on the Pyxis SPANK plugin and Enroot that ParallelCluster's official AMIs ship
# disabled. Since ParallelCluster 3.11.0 the AMIs carry both; since 3.11.1 their configuration files
# wait under /opt/parallelcluster/examples/ (aws-parallelcluster-cookbook CHANGELOG 3.11.0 and 3.11.1,
# PR 2820) and are moved into place by the cluster's owner, as the User Guide's tutorial "Running
# containerized jobs with Pyxis" does: Enroot's runtime and data on tmpfs (/run), its cache and
# per-user config on local disk (/var/enroot), Pyxis's runtime in /run/pyxis.
set -euo pipefail
role="${1:?head or compute}"
examples=/opt/parallelcluster/examples

install -d -m 1777 /var/enroot /run/enroot /run/pyxis
install -m 0644 "$examples/enroot/enroot.conf" /etc/enroot/enroot.conf
install -d -m 0755 /opt/slurm/etc/plugstack.conf.d
install -m 0644 "$examples/spank/plugstack.conf" /opt/slurm/etc/plugstack.conf
install -m 0644 "$examples/pyxis/pyxis.conf" /opt/slurm/etc/plugstack.conf.d/pyxis.conf

# The tutorial restarts slurmctld on the head node once the files are in place. Compute nodes need no
# restart: slurmstepd loads the SPANK plugins of plugstack.conf for each job step.
if [ "$role" = head ]; then
  systemctl restart slurmctld
fi
