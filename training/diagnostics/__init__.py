"""Measurements run in the image: the trainer's throughput against a bare loop, and the
all-reduce bandwidth sweep that checks NCCL runs over EFA."""
