"""Reference implementations some tests compare the trainer with, where they can be imported.

torchvision's PyPI wheels are built for CUDA torch and fail to load beside the CPU torch the
suite installs ("operator torchvision::nms does not exist"), so tests that need torchvision
(its decoders, transforms and models) run in the GPU image, or in an environment with a CUDA
build of torch, which also runs on a CPU (torch 2.14.1 with torchvision 0.29.1 was used so)."""

from __future__ import annotations

import pytest


def torchvision_importable() -> bool:
    try:
        import torchvision.io
        import torchvision.models  # noqa: F401 - imported to see whether it loads (with torchvision.io above)
    except Exception:  # noqa: BLE001 - not installed, or PyPI's wheel beside CPU torch
        return False
    return True


needs_torchvision = pytest.mark.skipif(
    not torchvision_importable(),
    reason="needs torchvision, which PyPI ships for CUDA torch only (the GPU image, or a CUDA torch on a CPU)")
