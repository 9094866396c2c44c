"""A two-layer perceptron over the flattened image: for smoke tests of the training harness itself."""

from __future__ import annotations

from torch import Tensor, nn


class MLPClassifier(nn.Module):
    def __init__(self, num_classes: int, image_size: int, hidden: int = 256):
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(), nn.Linear(3 * image_size * image_size, hidden), nn.ReLU(), nn.Linear(hidden, num_classes)
        )

    def forward(self, images: Tensor) -> Tensor:
        return self.net(images)
