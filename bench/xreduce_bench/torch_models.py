"""The models of ``bench/torch_ddp.py``: an MLP of about 25 M parameters, and ResNet-50.

ResNet-50 is torchvision's ``resnet50()`` (v1.5: the stride on the 3x3 convolution of each bottleneck), built
here layer for layer because torchvision's wheels need a torch build other than the CPU one the project pins
(the parameters' shapes and order are checked against :data:`xreduce_bench.workloads.RESNET50_SHAPES`, which
was transcribed from torchvision). torchvision's own model is used instead when it imports.
"""

from __future__ import annotations

import torch
from torch import nn

MLP_WIDTHS = (1024, 4096, 4096, 1024)
"""The MLP's layer widths: 25,175,040 parameters (100.7 MB of float32 gradients, four DDP buckets)."""


def mlp() -> nn.Module:
    """An MLP of :data:`MLP_WIDTHS` with ReLUs between its layers.

    Example:
        >>> sum(p.numel() for p in mlp().parameters())
        25175040
    """
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(MLP_WIDTHS, MLP_WIDTHS[1:])):
        layers += [nn.ReLU()] if i else []
        layers.append(nn.Linear(a, b))
    return nn.Sequential(*layers)


class Bottleneck(nn.Module):
    """torchvision's ``Bottleneck``: 1x1, 3x3 (with the stride), 1x1 x4 convolutions, each batch-normed."""

    def __init__(self, inplanes: int, planes: int, stride: int = 1):
        super().__init__()
        width = planes
        self.conv1 = nn.Conv2d(inplanes, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, planes * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * 4)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or inplanes != planes * 4:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, planes * 4, 1, stride=stride, bias=False),
                                            nn.BatchNorm2d(planes * 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        return self.relu(self.bn3(self.conv3(out)) + identity)


class ResNet50(nn.Module):
    """torchvision's ``resnet50()``: a 7x7 stem, bottleneck stages of [3, 4, 6, 3] blocks, a 1000-way classifier.

    Example:
        >>> from xreduce_bench.workloads import RESNET50_SHAPES
        >>> tuple(tuple(p.shape) for p in ResNet50().parameters()) == RESNET50_SHAPES
        True
    """

    def __init__(self, num_classes: int = 1000):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        inplanes, stages = 64, []
        for planes, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            layer = [Bottleneck(inplanes, planes, stride)] + [Bottleneck(planes * 4, planes) for _ in range(blocks - 1)]
            stages.append(nn.Sequential(*layer))
            inplanes = planes * 4
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2048, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet50() -> nn.Module:
    """torchvision's ``resnet50()`` when torchvision imports, else :class:`ResNet50`.

    Example:
        >>> sum(p.numel() for p in resnet50().parameters())
        25557032
    """
    try:
        import torchvision
    except Exception:  # noqa: BLE001 - absent, or a build for another torch (it fails to load its operators)
        return ResNet50()
    return torchvision.models.resnet50()


MODELS = {"mlp": mlp, "resnet50": resnet50}
"""The models ``--model`` names."""
