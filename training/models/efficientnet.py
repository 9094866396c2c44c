"""EfficientNet-B0..B7 (Tan & Le 2019): one base network and the compound scaling rule."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
from torch import Tensor, nn

# B0's stages: (expand ratio, kernel, stride, input channels, output channels, layers).
B0_STAGES = (
    (1, 3, 1, 32, 16, 1),
    (6, 3, 2, 16, 24, 2),
    (6, 5, 2, 24, 40, 2),
    (6, 3, 2, 40, 80, 3),
    (6, 5, 1, 80, 112, 3),
    (6, 5, 2, 112, 192, 4),
    (6, 3, 1, 192, 320, 1),
)


@dataclass(frozen=True)
class Scaling:
    """The compound coefficients of one family member: width, depth, input resolution, dropout;
    and its batch norm's epsilon and momentum."""

    width: float
    depth: float
    resolution: int
    dropout: float
    norm_eps: float = 1e-5
    norm_momentum: float = 0.1


# torchvision builds B5-B7 with TensorFlow's batch norm settings (the reference implementation's
# 0.99 decay is momentum 0.01 here) and B0-B4 with torch's defaults: torchvision/models/
# efficientnet.py, efficientnet_b5..b7, v0.28.0. Same layers, different function: the eval
# outputs of B7 differed by 0.1 % of their size with torch's defaults.
TF_NORM = {"norm_eps": 1e-3, "norm_momentum": 0.01}


SCALINGS = {
    "efficientnet_b0": Scaling(1.0, 1.0, 224, 0.2),
    "efficientnet_b1": Scaling(1.0, 1.1, 240, 0.2),
    "efficientnet_b2": Scaling(1.1, 1.2, 260, 0.3),
    "efficientnet_b3": Scaling(1.2, 1.4, 300, 0.3),
    "efficientnet_b4": Scaling(1.4, 1.8, 380, 0.4),
    "efficientnet_b5": Scaling(1.6, 2.2, 456, 0.4, **TF_NORM),
    "efficientnet_b6": Scaling(1.8, 2.6, 528, 0.5, **TF_NORM),
    "efficientnet_b7": Scaling(2.0, 3.1, 600, 0.5, **TF_NORM),
}


def _round_channels(channels: float, divisor: int = 8) -> int:
    """Scale to a multiple of ``divisor``, never dropping more than 10 % (the reference rule)."""
    rounded = max(divisor, int(channels + divisor / 2) // divisor * divisor)
    return rounded + divisor if rounded < 0.9 * channels else rounded


Norm = Callable[[int], nn.Module]


def _conv_bn_act(cin: int, cout: int, kernel: int, norm: Norm, stride: int = 1, groups: int = 1,
                 act: bool = True) -> nn.Sequential:
    layers = [nn.Conv2d(cin, cout, kernel, stride, kernel // 2, groups=groups, bias=False), norm(cout)]
    return nn.Sequential(*layers, nn.SiLU(inplace=True)) if act else nn.Sequential(*layers)


class SqueezeExcite(nn.Module):
    def __init__(self, channels: int, squeezed: int):
        super().__init__()
        self.reduce = nn.Conv2d(channels, squeezed, 1)
        self.expand = nn.Conv2d(squeezed, channels, 1)

    def forward(self, x: Tensor) -> Tensor:
        scale = self.expand(nn.functional.silu(self.reduce(x.mean((2, 3), keepdim=True))))
        return x * scale.sigmoid()


class MBConv(nn.Module):
    """Inverted residual: expand 1x1, depthwise kxk, squeeze-excite, project 1x1."""

    def __init__(self, cin: int, cout: int, expand: int, kernel: int, stride: int, drop_path: float, norm: Norm):
        super().__init__()
        hidden = _round_channels(cin * expand)
        layers = [] if hidden == cin else [_conv_bn_act(cin, hidden, 1, norm)]
        layers += [
            _conv_bn_act(hidden, hidden, kernel, norm, stride, groups=hidden),
            SqueezeExcite(hidden, max(1, cin // 4)),
            _conv_bn_act(hidden, cout, 1, norm, act=False),
        ]
        self.body = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout
        self.drop_path = drop_path

    def forward(self, x: Tensor) -> Tensor:
        out = self.body(x)
        if not self.residual:
            return out
        if self.training and self.drop_path > 0:
            keep = 1 - self.drop_path
            mask = torch.empty(x.shape[0], 1, 1, 1, device=x.device, dtype=x.dtype).bernoulli_(keep)
            out = out * mask / keep
        return out + x


class EfficientNet(nn.Module):
    def __init__(self, scaling: Scaling, num_classes: int = 1000, stochastic_depth: float = 0.2):
        super().__init__()
        self.resolution = scaling.resolution
        stages = [
            (e, k, s, _round_channels(i * scaling.width), _round_channels(o * scaling.width), math.ceil(n * scaling.depth))
            for e, k, s, i, o, n in B0_STAGES
        ]
        total = sum(stage[-1] for stage in stages)
        norm = partial(nn.BatchNorm2d, eps=scaling.norm_eps, momentum=scaling.norm_momentum)
        self.stem = _conv_bn_act(3, stages[0][3], 3, norm, 2)
        blocks, index = [], 0
        for expand, kernel, stride, cin, cout, layers in stages:
            for j in range(layers):
                blocks.append(
                    MBConv(cin if j == 0 else cout, cout, expand, kernel, stride if j == 0 else 1,
                           stochastic_depth * index / total, norm)
                )
                index += 1
        self.blocks = nn.Sequential(*blocks)
        last = stages[-1][4]
        self.head = nn.Sequential(
            _conv_bn_act(last, 4 * last, 1, norm),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Dropout(scaling.dropout),
            nn.Linear(4 * last, num_classes),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.blocks(self.stem(x)))


def efficientnet(name: str, num_classes: int = 1000) -> EfficientNet:
    return EfficientNet(SCALINGS[name], num_classes)
