"""torch.compile where it pays, and eager when it fails (issue 16, item 3; the GPU speed-up
itself needs a GPU)."""

from __future__ import annotations

import logging

import pytest
import torch

from training.config import load_train_config
from training.loop.compile import compile_with_fallback, should_compile


@pytest.mark.parametrize(("overrides", "device", "expected"), [
    ([], "cuda", True),                                   # the default ResNet-50 on a GPU
    (["--model.name=bert_base"], "cuda", False),          # auto: image models only
    ([], "cpu", False),
    (["--model.compile=true"], "cpu", True),
    (["--model.compile=false"], "cuda", False),
])
def test_compile_by_default_only_for_image_models_on_a_gpu(overrides, device, expected):
    assert should_compile(load_train_config(None, overrides), device) is expected


@pytest.fixture
def dynamo():
    import torch._dynamo

    # dynamo's own patching: pytest's monkeypatch undoes this one with delattr, which leaves the
    # option hidden, and every later torch.compile in the session fails on reading it.
    with torch._dynamo.config.patch(suppress_errors=False):
        yield
    torch._dynamo.reset()


def test_a_compiler_failure_runs_eagerly_and_says_so_in_one_line(dynamo, caplog):
    def broken(graph, example_inputs):
        raise RuntimeError("the compiler cannot do this")

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    compiled = compile_with_fallback(model, backend=broken)
    inputs = torch.randn(3, 4)
    with caplog.at_level(logging.WARNING):
        assert torch.allclose(compiled(inputs), model(inputs))
        compiled(inputs).sum().backward()
        compiled(inputs)
    ours = [r.getMessage() for r in caplog.records if r.name == "training.loop.compile"]
    assert ours == ["torch.compile failed, so the model runs eagerly: backend='broken' raised: RuntimeError: the "
                    "compiler cannot do this"]
    assert not [r for r in caplog.records if r.getMessage().startswith("WON'T CONVERT")]
