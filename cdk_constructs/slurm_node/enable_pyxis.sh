#!/bin/bash
# OnNodeConfigured custom action of the slurm stack's head node (argument "head") and compute nodes
# ("compute"): turns on the Pyxis SPANK plugin and Enroot that ParallelCluster's official AMIs ship
# disabled. Since ParallelCluster 3.11.0 the AMIs carry both; since 3.11.1 their configuration files
# wait under /opt/parallelcluster/examples/ (aws-parallelcluster-cookbook CHANGELOG 3.11.0 and 3.11.1,
# PR 2820) and are moved into place by the cluster's owner, as the User Guide's tutorial "Running
# containerized jobs with Pyxis" does: Enroot's runtime and data on tmpfs (/run), its cache and
# per-user config on local disk (/var/enroot), Pyxis's runtime in /run/pyxis.
#
# On the head node it also makes the shared file system's job folders (arguments after the role)
# writable by every cluster user (mode 1777, as /fsx itself): Pyxis runs a job's container as the user
# who submitted it, and each job makes its own folder inside them.
set -euo pipefail
role="${1:?head or compute}"
shift
examples=/opt/parallelcluster/examples

install -d -m 1777 /var/enroot /run/enroot /run/pyxis
install -m 0644 "$examples/enroot/enroot.conf" /etc/enroot/enroot.conf

# /opt/slurm is the head node's, shared over NFS with the compute nodes (aws-parallelcluster-cookbook,
# "Mount /opt/slurm over NFS"): only the head node writes its files, so a compute node booting while a
# job starts never rewrites a plugstack.conf another node is reading. The tutorial then restarts
# slurmctld; slurmstepd loads the SPANK plugins of plugstack.conf for each job step.
if [ "$role" = head ]; then
  install -d -m 0755 /opt/slurm/etc/plugstack.conf.d
  install -m 0644 "$examples/spank/plugstack.conf" /opt/slurm/etc/plugstack.conf
  install -m 0644 "$examples/pyxis/pyxis.conf" /opt/slurm/etc/plugstack.conf.d/pyxis.conf
  for folder in "$@"; do
    install -d -m 1777 "$folder"
  done
  systemctl restart slurmctld
fi
