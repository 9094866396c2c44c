"""The trainer's models held against the reference implementations (their parameter counts, and
their outputs for the same weights) and against the published sizes."""

from __future__ import annotations

import pytest
import torch

from training.models import MODEL_NAMES, build_model, parameter_count
from training.models.efficientnet import SCALINGS
from tests.reference_libraries import needs_torchvision

# untimed (tests/machine_turns.py): nothing a busy neighbour could break; under -n it runs beside other tests
pytestmark = pytest.mark.untimed

# Exact counts of the reference implementations (torchvision for the CNNs, Hugging Face
# BertForMaskedLM for BERT): equal counts mean the same layers with the same shapes.
REFERENCE_COUNTS = {
    "resnet18": 11_689_512,
    "resnet50": 25_557_032,
    "efficientnet_b0": 5_288_548,
    "efficientnet_b7": 66_347_960,
    "bert_base": 109_514_298,
    "bert_large": 335_174_458,
}

# Sizes as the papers publish them, rounded. BERT-large's "340M" is 1.4 % above what its
# own layer sizes add up to (BertForMaskedLM, pooler and NSP head excluded; with them
# 336.2M, still 1.1 % short), so it is held against its exact count above instead.
PUBLISHED_MILLIONS = {
    "resnet18": 11.7,
    "resnet50": 25.6,
    "efficientnet_b0": 5.3,
    "efficientnet_b7": 66.0,
    "bert_base": 110.0,
}


@pytest.mark.parametrize("name", sorted(REFERENCE_COUNTS))
def test_parameter_count_matches_the_reference_implementation(name):
    assert parameter_count(build_model(name)) == REFERENCE_COUNTS[name]


@pytest.mark.parametrize("name", sorted(PUBLISHED_MILLIONS))
def test_parameter_count_within_one_percent_of_the_published_figure(name):
    millions = parameter_count(build_model(name)) / 1e6
    assert abs(millions - PUBLISHED_MILLIONS[name]) / PUBLISHED_MILLIONS[name] <= 0.01


def test_efficientnet_scaling_rule_grows_every_member():
    sizes = [parameter_count(build_model(name)) for name in sorted(SCALINGS)]
    assert sizes == sorted(sizes) and len(set(sizes)) == 8
    assert build_model("efficientnet_b7").resolution == 600


# Batch norm (eps, momentum) as torchvision builds each model (torchvision/models/efficientnet.py,
# v0.28.0): torch's defaults, except TensorFlow's for the EfficientNets ported from it.
REFERENCE_NORMS = {name: (1e-5, 0.1) for name in ("resnet18", "resnet50", *(f"efficientnet_b{i}" for i in range(5)))}
REFERENCE_NORMS.update({f"efficientnet_b{i}": (1e-3, 0.01) for i in (5, 6, 7)})


@pytest.mark.parametrize("name", sorted(REFERENCE_NORMS))
def test_batch_norm_settings_are_the_reference_implementations(name):
    norms = {(m.eps, m.momentum) for m in build_model(name).modules() if isinstance(m, torch.nn.BatchNorm2d)}
    assert norms == {REFERENCE_NORMS[name]}


@needs_torchvision
@pytest.mark.parametrize("name", ["resnet18", "resnet50", "efficientnet_b0", "efficientnet_b7"])
def test_the_cnn_computes_torchvisions_function(name):
    """torchvision's model and ours, given the same weights and running statistics, agree in
    training and evaluation mode and update their statistics alike: equal parameter counts
    leave a stride, a residual or a batch norm setting unchecked."""
    import torchvision

    torch.manual_seed(0)
    ours, theirs = build_model(name).double(), getattr(torchvision.models, name)().double()
    state = theirs.state_dict()
    for key, value in state.items():  # away from the initial values, where a difference could hide
        if "running_var" in key:
            value.uniform_(0.5, 1.5)
        elif "running_mean" in key or "bias" in key:
            value.normal_(0, 0.05)
        elif key.endswith("weight") and value.dim() == 1:
            value.uniform_(0.8, 1.2)
    theirs.load_state_dict(state)
    assert [v.shape for v in ours.state_dict().values()] == [v.shape for v in state.values()]
    ours.load_state_dict(dict(zip(ours.state_dict(), state.values(), strict=True)))
    images = torch.randn(4, 3, 64, 64, dtype=torch.float64)
    for mode in ("eval", "train"):  # train: batch statistics, stochastic depth and dropout drawn alike
        ours.train(mode == "train"), theirs.train(mode == "train")
        with torch.no_grad():
            torch.manual_seed(1)
            mine = ours(images)
            torch.manual_seed(1)
            reference = theirs(images)
        torch.testing.assert_close(mine, reference, rtol=1e-9, atol=1e-9, msg=f"{name} in {mode} mode")
    for mine, reference in zip(ours.state_dict().values(), theirs.state_dict().values(), strict=True):
        torch.testing.assert_close(mine, reference, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("name", ["resnet18", "efficientnet_b0"])
def test_image_models_classify_and_train(name):
    model = build_model(name, num_classes=10)
    images = torch.randn(2, 3, 64, 64).contiguous(memory_format=torch.channels_last)
    loss = torch.nn.functional.cross_entropy(model(images), torch.tensor([1, 7]))
    loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def hugging_face_names(model) -> dict[str, torch.Tensor]:
    """The trainer's BERT weights under transformers' BertForMaskedLM names."""
    ours, theirs = model.state_dict(), {}
    embeddings = "bert.embeddings."
    for mine, name in [("word", "word_embeddings"), ("position", "position_embeddings"),
                       ("token_type", "token_type_embeddings")]:
        theirs[f"{embeddings}{name}.weight"] = ours[f"{mine}.weight"]
    pairs = {"embed_norm": f"{embeddings}LayerNorm", "mlm_transform.0": "cls.predictions.transform.dense",
             "mlm_transform.2": "cls.predictions.transform.LayerNorm"}
    for i in range(len(model.layers)):
        layer, mine = f"bert.encoder.layer.{i}.", f"layers.{i}."
        for which, name in enumerate(("query", "key", "value")):  # our fused projection's thirds
            for kind in ("weight", "bias"):
                theirs[f"{layer}attention.self.{name}.{kind}"] = ours[f"{mine}qkv.{kind}"].chunk(3)[which]
        pairs |= {f"{mine}proj": f"{layer}attention.output.dense", f"{mine}norm1": f"{layer}attention.output.LayerNorm",
                  f"{mine}ffn.0": f"{layer}intermediate.dense", f"{mine}ffn.2": f"{layer}output.dense",
                  f"{mine}norm2": f"{layer}output.LayerNorm"}
    for mine, name in pairs.items():
        for kind in ("weight", "bias"):
            theirs[f"{name}.{kind}"] = ours[f"{mine}.{kind}"]
    theirs["cls.predictions.bias"] = theirs["cls.predictions.decoder.bias"] = ours["mlm_bias"]
    theirs["cls.predictions.decoder.weight"] = ours["word.weight"]  # tied to the word embeddings in both
    return theirs


@pytest.mark.parametrize("name, sizes", [
    ("bert_tiny", {"num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 2, "intermediate_size": 512}),
    ("bert_base", {}),  # transformers' BertConfig defaults are BERT-base's
])
def test_bert_computes_hugging_faces_bert_for_masked_lm(name, sizes):
    """Same weights, same logits and loss as transformers' BertForMaskedLM, padding included:
    the layer order, the erf GELU, LayerNorm's epsilon, the attention's scaling and mask."""
    from transformers import BertConfig
    from transformers import BertForMaskedLM as Reference

    torch.manual_seed(0)
    ours = build_model(name).double().eval()
    for parameter in ours.parameters():  # biases and norms away from 0 and 1 too
        torch.nn.init.normal_(parameter, std=0.05)
    reference = Reference(BertConfig(**sizes)).double().eval()
    reference.load_state_dict(hugging_face_names(ours), strict=True)
    tokens = torch.randint(0, 30522, (3, 32))
    attention_mask = torch.ones(3, 32, dtype=torch.long)
    attention_mask[1, 20:], attention_mask[2, 5:] = 0, 0
    labels = torch.full((3, 32), -100)
    labels[:, 2], labels[0, 10], labels[1, 15] = tokens[:, 2], 7, 9
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens, attention_mask),
                                   reference(input_ids=tokens, attention_mask=attention_mask).logits, rtol=1e-9, atol=1e-9)
        loss = ours(tokens, attention_mask, labels=labels, max_predictions=5)  # cross-entropy in float32, as in training
        expected = reference(input_ids=tokens, attention_mask=attention_mask, labels=labels).loss
    assert abs(float(loss) - float(expected)) < 1e-5


def test_masked_lm_loss_counts_only_masked_positions():
    torch.manual_seed(0)
    model = build_model("bert_tiny").eval()
    tokens = torch.randint(0, 30522, (2, 16))
    labels = torch.full_like(tokens, -100)
    labels[:, 3] = tokens[:, 3]
    logits = model(tokens)
    expected = torch.nn.functional.cross_entropy(logits[:, 3], tokens[:, 3])
    assert torch.allclose(model(tokens, labels=labels), expected)
    # Padding is masked out of attention: changing padded tokens leaves real positions alone.
    mask = torch.ones_like(tokens)
    mask[:, 12:] = 0
    other = tokens.clone()
    other[:, 12:] = 5
    assert torch.allclose(model(tokens, mask)[:, :12], model(other, mask)[:, :12], atol=1e-5)


def test_unknown_model_is_one_clear_line():
    with pytest.raises(ValueError, match=r"model: got 'resnet51'; allowed: resnet18, .*bert_large"):
        build_model("resnet51")
    assert "efficientnet_b7" in MODEL_NAMES


def test_the_torch_free_names_are_exactly_the_models_that_build():
    from training.models.bert import BERT_SIZES
    from training.models.efficientnet import SCALINGS
    from training.models.resnet import RESNET_DEPTHS

    assert set(MODEL_NAMES) == {*RESNET_DEPTHS, *SCALINGS, *BERT_SIZES, "mlp"}
    assert len(MODEL_NAMES) == len(set(MODEL_NAMES))


def masked_batch(vocab: int, batch: int = 4, seq: int = 64, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq), generator=generator)
    labels = torch.full_like(tokens, -100)
    chosen = torch.rand(batch, seq, generator=generator) < 0.15
    chosen[:, 0] = True
    labels[chosen] = tokens[chosen]
    return tokens, labels


def test_the_mlm_head_projects_only_the_masked_positions_with_the_same_loss_and_gradients():
    torch.manual_seed(0)
    model = build_model("bert_tiny").eval()
    tokens, labels = masked_batch(model.size.vocab)
    most = int((labels != -100).sum(1).max())  # rows have different counts: the others are padded
    seen = []
    original = model.mlm_logits
    model.mlm_logits = lambda hidden: seen.append(tuple(hidden.shape[:2])) or original(hidden)
    per_sample = model(tokens, labels=labels, per_sample=True, max_predictions=most)
    assert seen == [(4, most)] and most < 20  # ~15 % of each row's 64 positions, not all of them
    per_sample.sum().backward()
    fast = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.mlm_logits = original
    logits = model(tokens)  # every position, the way it was computed before
    token_loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100,
                                                   reduction="none")
    chosen = (labels != -100).float()
    reference = (token_loss * chosen).sum(1)  # each row's sum: the trainer divides by the global batch's count
    assert torch.allclose(per_sample, reference, atol=1e-5)
    assert torch.allclose(model(tokens, labels=labels, per_sample=True), reference, atol=1e-5)  # all positions
    reference.sum().backward()
    for name, parameter in model.named_parameters():
        assert torch.allclose(fast[name], parameter.grad, atol=1e-5), name
    assert model(tokens, labels=labels, max_predictions=most).item() == pytest.approx(
        torch.nn.functional.cross_entropy(logits.reshape(-1, model.size.vocab), labels.reshape(-1)).item(), rel=1e-5)


def test_padding_changes_nothing_for_the_real_tokens_with_the_attention_mask():
    """Reference BERT's input_mask: a row padded to a longer batch has the loss it has alone.
    Without the mask its real tokens attend to the padding too."""
    from training.data.datasets import PAD_ID, attention_mask

    torch.manual_seed(0)
    model = build_model("bert_tiny").eval()
    tokens, labels = masked_batch(model.size.vocab, batch=2, seq=16)
    padded_tokens = torch.cat([tokens, torch.full_like(tokens, PAD_ID)], dim=1)
    padded_labels = torch.cat([labels, torch.full_like(labels, -100)], dim=1)
    mask = attention_mask(padded_tokens, padded_labels)
    alone = model(tokens, labels=labels, per_sample=True, max_predictions=16)
    masked = model(padded_tokens, attention_mask=mask, labels=padded_labels, per_sample=True, max_predictions=16)
    unmasked = model(padded_tokens, labels=padded_labels, per_sample=True, max_predictions=16)
    assert torch.allclose(masked, alone, atol=1e-5)
    assert not torch.allclose(unmasked, alone, atol=1e-3)
    placeholder = torch.full((1, 32), PAD_ID)  # a bad sample, weight 0: its loss must stay finite
    rows = torch.cat([padded_tokens, placeholder]), torch.cat([padded_labels, torch.full_like(placeholder, -100)])
    losses = model(rows[0], attention_mask=attention_mask(*rows), labels=rows[1], per_sample=True, max_predictions=16)
    assert torch.isfinite(losses).all() and losses[2] == 0


def test_the_mlm_loss_has_shapes_that_do_not_depend_on_the_labels():
    """The meta device has no values, so it runs only what needs none: had the head selected
    positions by value, the host would wait for the GPU every step to learn their number."""
    with torch.device("meta"):
        model = build_model("bert_tiny")
        tokens = torch.zeros(4, 64, dtype=torch.long)
        labels = torch.zeros(4, 64, dtype=torch.long)
    losses = model(tokens, labels=labels, per_sample=True, max_predictions=10)
    assert losses.shape == (4,) and losses.device.type == "meta"
    losses.sum().backward()
    assert model.word.weight.grad.shape == model.word.weight.shape


def test_torch_compile_sees_the_mlm_loss_as_one_graph():
    """Selecting by value broke it into 4 graphs at each nonzero (dynamic shapes)."""
    torch.manual_seed(0)
    model = build_model("bert_tiny")
    tokens, labels = masked_batch(model.size.vocab)
    explained = torch._dynamo.explain(
        lambda tokens, labels: model(tokens, labels=labels, per_sample=True, max_predictions=16))(tokens, labels)
    torch._dynamo.reset()
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_mlm_head_makes_no_host_sync_on_cuda():
    """The head alone (the encoder's embedding backward has syncs of its own in ATen)."""
    torch.manual_seed(0)
    model = build_model("bert_tiny").cuda()
    tokens, labels = (t.cuda() for t in masked_batch(model.size.vocab))
    most = int((labels != -100).sum(1).max())
    hidden = model.encode(tokens).detach().requires_grad_()
    model.encode = lambda tokens, attention_mask=None: hidden
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        model(tokens, labels=labels, per_sample=True, max_predictions=most).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert hidden.grad is not None
