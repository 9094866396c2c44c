"""ResNet-18/34/50/101/152 (He et al. 2015, v1.5: the stride sits in the 3x3 conv)."""

from __future__ import annotations

from torch import Tensor, nn


def _conv_bn(cin: int, cout: int, kernel: int, stride: int = 1) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, kernel, stride, padding=kernel // 2, bias=False), nn.BatchNorm2d(cout)]


class _Residual(nn.Module):
    expansion = 1

    def __init__(self, cin: int, width: int, stride: int, body: list[nn.Module]):
        super().__init__()
        cout = width * self.expansion
        self.body = nn.Sequential(*body)
        self.shortcut = nn.Sequential(*_conv_bn(cin, cout, 1, stride)) if stride != 1 or cin != cout else nn.Identity()
        # Zero-init the last BN so each block starts as identity (Goyal et al. 2017).
        nn.init.zeros_(self.body[-1].weight)

    def forward(self, x: Tensor) -> Tensor:
        return (self.body(x) + self.shortcut(x)).relu_()


class BasicBlock(_Residual):
    expansion = 1

    def __init__(self, cin: int, width: int, stride: int):
        super().__init__(cin, width, stride, [
            *_conv_bn(cin, width, 3, stride), nn.ReLU(inplace=True), *_conv_bn(width, width, 3),
        ])


class Bottleneck(_Residual):
    expansion = 4

    def __init__(self, cin: int, width: int, stride: int):
        super().__init__(cin, width, stride, [
            *_conv_bn(cin, width, 1), nn.ReLU(inplace=True),
            *_conv_bn(width, width, 3, stride), nn.ReLU(inplace=True),
            *_conv_bn(width, width * self.expansion, 1),
        ])


class ResNet(nn.Module):
    def __init__(self, block: type[_Residual], depths: tuple[int, ...], num_classes: int = 1000):
        super().__init__()
        self.stem = nn.Sequential(*_conv_bn(3, 64, 7, 2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1))
        stages, cin = [], 64
        for i, depth in enumerate(depths):
            width = 64 * 2**i
            for j in range(depth):
                stages.append(block(cin, width, stride=2 if j == 0 and i > 0 else 1))
                cin = width * block.expansion
        self.stages = nn.Sequential(*stages)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes))
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.stages(self.stem(x)))


RESNET_DEPTHS = {
    "resnet18": (BasicBlock, (2, 2, 2, 2)),
    "resnet34": (BasicBlock, (3, 4, 6, 3)),
    "resnet50": (Bottleneck, (3, 4, 6, 3)),
    "resnet101": (Bottleneck, (3, 4, 23, 3)),
    "resnet152": (Bottleneck, (3, 8, 36, 3)),
}


def resnet(name: str, num_classes: int = 1000) -> ResNet:
    block, depths = RESNET_DEPTHS[name]
    return ResNet(block, depths, num_classes)
