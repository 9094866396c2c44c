"""The launcher every training pod runs: torchrun's agent with the platform's rendezvous on
etcd, restart accounting and in-place regroups. Imports torch only when it runs."""
