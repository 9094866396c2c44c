"""The names of the trainer's models, without torch: the platform side validates a job's
trainer arguments against the trainer's config, and it does not install torch.

``training.models`` builds a model for each of these names (tests/drills/test_models.py keeps the two
in step).
"""

from __future__ import annotations

RESNETS = ("resnet18", "resnet34", "resnet50", "resnet101", "resnet152")
EFFICIENTNETS = tuple(f"efficientnet_b{i}" for i in range(8))
IMAGE_MODELS = (*RESNETS, *EFFICIENTNETS, "mlp")
MASKED_LM_MODELS = ("bert_tiny", "bert_base", "bert_large")
MODEL_NAMES = IMAGE_MODELS + MASKED_LM_MODELS
