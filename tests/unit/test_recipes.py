"""The training recipe held against the references it follows: BERT's masked-LM loss over all
masked tokens (transformers' BertForMaskedLM), no weight decay on biases and norms (Hugging Face's
Trainer), the learning-rate schedules (Hugging Face's get_*_schedule_with_warmup), label smoothing
(torch's cross_entropy, which torchvision's recipe uses), and the precision a device gets."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from training.config import load_train_config
from training.data.datasets import PAD_ID, attention_mask
from training.device import DeviceError, choose_precision
from training.loop.objective import global_loss_scale, learning_rate, per_sample_loss
from training.loop.optimizer import build_optimizer, load_optimizer_state, parameter_groups
from training.models import build_model


# --- the masked-LM loss -------------------------------------------------------------------------

def padded_rows(vocab: int, lengths: list[int], seq: int = 24, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``lengths`` real tokens then [PAD], each with about 15 % of its real tokens
    labelled: the counts differ from row to row, as padded shards make them."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1000, vocab, (len(lengths), seq), generator=generator)
    labels = torch.full_like(tokens, -100)
    for row, length in enumerate(lengths):
        tokens[row, length:] = PAD_ID
        count = max(1, round(0.15 * length))
        chosen = torch.randperm(length, generator=generator)[:count]
        labels[row, chosen] = tokens[row, chosen]
    return tokens, labels


def hugging_face_bert(ours):
    from transformers import BertConfig, BertForMaskedLM

    from tests.drills.test_models import hugging_face_names

    size = ours.size
    reference = BertForMaskedLM(BertConfig(num_hidden_layers=size.layers, hidden_size=size.hidden,
                                           num_attention_heads=size.heads, intermediate_size=size.intermediate))
    reference.load_state_dict(hugging_face_names(ours), strict=True)
    return reference.eval()


def trained_loss(model, tokens, labels, weight, split: list[int], max_predictions: int) -> torch.Tensor:
    """The step's loss as the trainer composes it, one process, micro-batches of ``split`` rows."""
    batches, start = [], 0
    for rows in split:
        part = slice(start, start + rows)
        batches.append(SimpleNamespace(inputs=tokens[part], target=labels[part], weight=weight[part]))
        start += rows
    scale = global_loss_scale(batches, int(weight.sum()), world_size=1)
    total = torch.zeros(())
    for batch in batches:
        losses = per_sample_loss(model, batch.inputs, batch.target, True, max_predictions,
                                 attention_mask(batch.inputs, batch.target))
        total = total + (losses * batch.weight).sum() * scale
    return total


def test_the_mlm_loss_is_bert_for_masked_lms_over_all_masked_tokens_however_the_batch_is_split():
    """Rows mask 1 to 4 tokens; the reference takes the mean over all of them (CrossEntropyLoss,
    ignore_index -100), which a mean of per-row means is not. A weight-0 padding row (a real
    sample, labelled) counts for nothing."""
    torch.manual_seed(0)
    ours = build_model("bert_tiny").eval()
    lengths = [24, 6, 12, 24, 9, 20, 24, 4]
    tokens, labels = padded_rows(ours.size.vocab, lengths)
    counts = (labels != -100).sum(1)
    assert len(set(counts.tolist())) >= 3
    with torch.no_grad():
        expected = hugging_face_bert(ours)(input_ids=tokens, attention_mask=(tokens != PAD_ID).long(),
                                           labels=labels).loss
        per_row = ours(tokens, attention_mask(tokens, labels), labels=labels, per_sample=True, max_predictions=4)
        assert abs(float((per_row / counts).mean()) - float(expected)) > 1e-3  # the old loss: another number
        padded = torch.cat([tokens, tokens[:1]]), torch.cat([labels, labels[:1]])
        weight = torch.tensor([1.0] * len(lengths) + [0.0])
        for split in ([9], [3, 3, 3], [1] * 9, [5, 4]):
            loss = trained_loss(ours, *padded, weight, split, max_predictions=4)
            assert float(loss) == pytest.approx(float(expected), rel=1e-5, abs=1e-6), split


def test_label_smoothing_reaches_the_masked_lm_loss_as_torch_smooths_it():
    torch.manual_seed(0)
    model = build_model("bert_tiny").eval()
    tokens, labels = padded_rows(model.size.vocab, [24, 10, 16])
    with torch.no_grad():
        logits = model(tokens, attention_mask(tokens, labels))
        expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), label_smoothing=0.2)
        mean = model(tokens, attention_mask(tokens, labels), labels=labels, max_predictions=4, label_smoothing=0.2)
    assert float(mean) == pytest.approx(float(expected), rel=1e-5)


# --- label smoothing for image classification ---------------------------------------------------

def test_image_losses_are_smoothed_as_torchvisions_criterion_smooths_them():
    """torchvision's recipe: nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    (references/classification/train.py); the per-sample losses average to its value."""
    torch.manual_seed(0)
    model = build_model("mlp", num_classes=10, image_size=16)
    images, target = torch.randn(6, 3, 16, 16), torch.randint(0, 10, (6,))
    losses = per_sample_loss(model, images, target, False, label_smoothing=0.1)
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=0.1)
    assert losses.shape == (6,)
    with torch.no_grad():
        assert float(losses.mean()) == pytest.approx(float(criterion(model(images), target)), rel=1e-6)
    assert not torch.allclose(losses, per_sample_loss(model, images, target, False))


def test_label_smoothing_defaults_to_the_models_recipe_and_an_explicit_value_wins():
    assert load_train_config(None).label_smoothing == 0.1  # ResNet-50, torchvision's --label-smoothing 0.1
    assert load_train_config(None, ["--model.name=bert_base"]).label_smoothing == 0.0
    assert load_train_config(None, ["--train.label_smoothing=0"]).label_smoothing == 0.0
    assert load_train_config(None, ["--model.name=bert_base", "--train.label_smoothing=0.05"]).label_smoothing == 0.05


# --- weight decay ---------------------------------------------------------------------------------

def decayed_names(model) -> set[str]:
    names = {id(p): n for n, p in model.named_parameters()}
    decayed, kept = parameter_groups(model, 0.01)
    assert kept["weight_decay"] == 0.0 and len(decayed["params"]) + len(kept["params"]) == len(names)
    return {names[id(p)] for p in decayed["params"]}


def test_bert_decays_the_parameters_hugging_faces_trainer_decays():
    """Trainer.get_decay_parameter_names (transformers 5.23): not LayerNorm, not a bias. The
    reference's names are mapped to ours by the tensor each one loads from."""
    from transformers import Trainer

    ours = build_model("bert_tiny")
    reference = hugging_face_bert(ours)
    hf_decayed = set(Trainer.get_decay_parameter_names(None, reference))
    storage = {p.untyped_storage().data_ptr(): name for name, p in ours.named_parameters()}
    from tests.drills.test_models import hugging_face_names

    ours_of = {name: storage[t.untyped_storage().data_ptr()] for name, t in hugging_face_names(ours).items()}
    mine = decayed_names(ours)
    theirs_names = [n for n, _ in reference.named_parameters(remove_duplicate=False)]
    assert set(theirs_names) <= set(ours_of)
    assert {n for n in theirs_names if ours_of[n] in mine} == {n for n in theirs_names if n in hf_decayed}
    assert "mlm_bias" not in mine and "embed_norm.weight" not in mine and "word.weight" in mine


def test_resnet_keeps_batch_norm_and_biases_out_of_weight_decay():
    """torchvision's split_normalization_params puts every BatchNorm parameter in the group its
    recipes give --norm-weight-decay 0.0; biases stay out too, as Hugging Face leaves them."""
    model = build_model("resnet18", num_classes=10)
    mine = decayed_names(model)
    norms = {f"{m}.{p}" for m, module in model.named_modules() if isinstance(module, torch.nn.BatchNorm2d)
             for p in ("weight", "bias")}
    convs = {f"{m}.weight" for m, module in model.named_modules() if isinstance(module, torch.nn.Conv2d)}
    assert norms and convs <= mine and not norms & mine
    assert "head.2.weight" in mine and "head.2.bias" not in mine  # the classifier
    assert all(p.ndim > 1 for n, p in model.named_parameters() if n in mine)


def test_the_optimizer_decays_weights_only_and_can_decay_all_again():
    torch.manual_seed(0)
    for name, extra in (("sgd", []), ("adamw", [])):
        model = build_model("mlp", num_classes=4, image_size=4)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        optimizer = build_optimizer(model, load_train_config(None, [f"--optim.name={name}", "--optim.lr=1",
                                                                    "--optim.weight_decay=0.1", *extra]).optim)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        optimizer.step()
        for n, p in model.named_parameters():
            shrunk = torch.allclose(p, before[n] * 0.9)
            assert shrunk == n.endswith("weight") and (shrunk or torch.equal(p, before[n])), (name, n)
    every = build_optimizer(model, load_train_config(None, ["--optim.decay_norms_and_biases=true"]).optim)
    assert [len(g["params"]) for g in every.param_groups] == [4]


def test_a_checkpoint_written_with_one_group_resumes_into_the_groups():
    """A checkpoint from before the groups (or with decay_norms_and_biases) holds one group: its
    momentum buffers reach the same parameters, and the groups keep this job's weight decay."""
    torch.manual_seed(0)
    model = build_model("mlp", num_classes=4, image_size=4)
    old = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    old.step()
    grouped = build_optimizer(model, load_train_config(None).optim)
    load_optimizer_state(grouped, old.state_dict(), model)
    for p in model.parameters():
        assert torch.equal(grouped.state[p]["momentum_buffer"], old.state[p]["momentum_buffer"])
    assert [g["weight_decay"] for g in grouped.param_groups] == [1e-4, 0.0]
    back = build_optimizer(model, load_train_config(None, ["--optim.decay_norms_and_biases=true"]).optim)
    load_optimizer_state(back, grouped.state_dict(), model)  # and the other way
    for p in model.parameters():
        assert torch.equal(back.state[p]["momentum_buffer"], old.state[p]["momentum_buffer"])


# --- the learning-rate schedule -------------------------------------------------------------------

@pytest.mark.parametrize("schedule, warmup", [("linear", 10), ("linear", 0), ("cosine", 7), ("constant", 5)])
def test_each_schedule_is_hugging_faces_step_for_step(schedule, warmup):
    """transformers 5.23, optimization.py: get_{linear,cosine,constant}_schedule_with_warmup,
    read as the optimizer's rate at each of the run's steps."""
    from transformers import (
        get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup,
    )

    total = 100
    parameter = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([parameter], lr=0.4)
    reference = {"linear": lambda: get_linear_schedule_with_warmup(optimizer, warmup, total),
                 "cosine": lambda: get_cosine_schedule_with_warmup(optimizer, warmup, total),
                 "constant": lambda: get_constant_schedule_with_warmup(optimizer, warmup)}[schedule]()
    config = load_train_config(None, ["--optim.lr=0.4", f"--optim.schedule={schedule}",
                                      f"--optim.warmup_steps={warmup}"])
    for step in range(total):
        assert learning_rate(config, step / total, total, 1.0) == pytest.approx(
            optimizer.param_groups[0]["lr"], rel=1e-9, abs=1e-12), step
        optimizer.step()
        reference.step()


# --- precision --------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind, capability, chosen", [
    ("cuda", (7, 0), "fp16"),  # V100 (p3, p3dn): no bf16 tensor cores
    ("cuda", (7, 5), "fp16"),  # T4 (g4dn)
    ("cuda", (8, 0), "bf16"),  # A100
    ("cuda", (8, 6), "bf16"),  # A10G
    ("cuda", (9, 0), "bf16"),  # H100, H200
    ("cpu", None, "bf16"),
    ("neuron", None, "bf16"),
])
def test_auto_precision_is_bf16_where_the_device_has_it_else_fp16(kind, capability, chosen):
    assert choose_precision("auto", kind, "device", capability) == chosen


def test_an_explicit_precision_is_kept_and_bf16_without_bf16_is_one_line():
    assert choose_precision("fp32", "cuda", "Tesla V100-SXM2-32GB", (7, 0)) == "fp32"
    assert choose_precision("fp16", "cuda", "NVIDIA H100 80GB HBM3", (9, 0)) == "fp16"
    assert choose_precision("bf16", "cuda", "NVIDIA H100 80GB HBM3", (9, 0)) == "bf16"
    with pytest.raises(DeviceError) as caught:
        choose_precision("bf16", "cuda", "Tesla V100-SXM2-32GB", (7, 0))
    assert str(caught.value) == ('train.precision: got "bf16" but Tesla V100-SXM2-32GB (compute capability 7.0) '
                                 "has no bf16 tensor cores; allowed here: auto (fp16 with loss scaling here), "
                                 "fp16 or fp32")


def test_fp16_gets_a_working_grad_scaler_and_bf16_a_pass_through():
    from training.device import detect

    runtime = detect("cpu")
    assert runtime.grad_scaler(choose_precision("auto", "cuda", "V100", (7, 0))).is_enabled()
    assert not runtime.grad_scaler(runtime.precision("auto")).is_enabled()
