"""trainctl: check an account before deploying, stage data, and run training jobs on the platform."""
