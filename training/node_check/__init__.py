"""The node check: an accelerated node's quick health checks before it may take a job (issue 50).

The platform's DaemonSet (k8s_charts/node_check.py) runs ``python -m training.node_check`` on every
new GPU and Trainium node, which joins with ``contract.NODE_CHECK_TAINT``. Passed: the taint goes.
Failed: the node keeps it, is labelled with the check that failed, gets an Event, and is kept for a
look or terminated (its Auto Scaling group replaces it), as the config says. Torch-free.
"""
