"""Models written in plain torch (no torchvision), looked up by name."""

from __future__ import annotations

from torch import nn

from training.model_names import IMAGE_MODELS, MASKED_LM_MODELS, MODEL_NAMES
from training.models.bert import BERT_SIZES, bert
from training.models.efficientnet import SCALINGS, efficientnet
from training.models.mlp import MLPClassifier
from training.models.resnet import RESNET_DEPTHS, resnet

__all__ = ["IMAGE_MODELS", "MASKED_LM_MODELS", "MODEL_NAMES", "build_model", "parameter_count"]


def build_model(name: str, num_classes: int = 1000, image_size: int = 224) -> nn.Module:
    """An image classifier (``num_classes`` outputs) or a masked-LM encoder, by name.

    ``image_size`` matters only to ``mlp``, whose input layer is sized for it.
    """
    if name in RESNET_DEPTHS:
        return resnet(name, num_classes)
    if name in SCALINGS:
        return efficientnet(name, num_classes)
    if name in BERT_SIZES:
        return bert(name)
    if name == "mlp":
        return MLPClassifier(num_classes, image_size)
    raise ValueError(f"model: got {name!r}; allowed: {', '.join(MODEL_NAMES)}")


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
