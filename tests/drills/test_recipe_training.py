"""The trainer trains the reference recipes: its reported loss is the reference's loss of the
global batch (BERT over all masked tokens, whatever the split across ranks and micro-batches;
images with label smoothing), and its learning rate is Hugging Face's linear schedule."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from training.config import load_train_config
from training.data.datasets import PAD_ID, attention_mask
from training.data.decode import collate
from training.data.feed import move
from training.data.sampler import SampleKey, sample_seed
from trainctl.backends.local_cluster import free_port
from training.loop.trainer import Trainer

# untimed (tests/machine_turns.py): nothing a busy neighbour could break; under -n it runs beside other tests
pytestmark = [pytest.mark.untimed, pytest.mark.timeout(300)]
STEPS = 3


def records(path, event: str = "step") -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["event"] == event]


def first_global_batch(trainer: Trainer) -> list[tuple]:
    """The samples of step 0, read from the trainer's own dataset as any rank reads them."""
    seed = trainer.config.train.seed
    return [trainer.dataset[SampleKey(i, 1.0, sample_seed(seed, 0, i))]
            for i in trainer.plan.global_batch_indices(0, 0)]


# --- BERT: the mean over all masked tokens of the global batch ------------------------------------

def shards(root) -> str:
    """24 rows of 32 tokens, most padded, so that they mask 1 to 5 tokens each."""
    rows = np.random.default_rng(0).integers(1000, 30000, size=(24, 32))
    for row, length in enumerate([32, 8, 14, 20, 5, 32, 11, 26] * 3):
        rows[row, length:] = PAD_ID
    (root / "shards").mkdir(exist_ok=True)
    np.save(root / "shards" / "000.npy", rows.astype(np.int32))
    return str(root / "shards")


def bert_config(work, data: str, micro: int):
    return load_train_config(None, [
        "--model.name=bert_tiny", "--data.kind=mlm_shards", f"--data.path={data}", "--data.seq_len=32",
        "--data.num_workers=0", "--train.global_batch_size=8", f"--train.micro_batch_size={micro}",
        f"--train.max_steps={STEPS}", "--train.precision=fp32", "--train.device=cpu", "--train.log_every_steps=1",
        "--optim.lr=0.5", f"--checkpoint.dir={work}/ckpt", "--checkpoint.async_save=false",
        f"--metrics.jsonl_path={work}/m.jsonl",
    ])


def without_dropout(trainer: Trainer) -> Trainer:
    """Dropout draws differ with the split into micro-batches and ranks; the losses must not."""
    for module in trainer.module.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    for layer in trainer.module.layers:
        layer.attn_dropout = 0.0
    return trainer


def _bert_worker(rank: int, world: int, port: int, work: str, data: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    without_dropout(Trainer(bert_config(work, data, micro=2))).run()


def bert_run(work, data: str, micro: int = 2, world: int = 1) -> dict:
    work.mkdir()
    if world > 1:
        mp.spawn(_bert_worker, args=(world, free_port(), str(work), data), nprocs=world, join=True)
        initial = batch = None
    else:
        trainer = without_dropout(Trainer(bert_config(work, data, micro)))
        assert trainer.layout.accumulation == 8 // micro
        initial, batch = {n: t.clone() for n, t in trainer.module.state_dict().items()}, first_global_batch(trainer)
        trainer.run()
    weights = torch.load(sorted((work / "ckpt").glob("step-*.pt"))[-1], weights_only=True)["model"]
    return {"losses": [r["loss"] for r in records(work / "m.jsonl")], "weights": weights, "initial": initial,
            "batch": batch}


def test_bert_trains_on_bert_for_masked_lms_loss_of_the_global_batch_however_it_is_split(tmp_path):
    """Step 0's loss is transformers' BertForMaskedLM's loss (CrossEntropyLoss over every token
    labelled, ignore_index -100) of the same weights on the same 8 rows, whose masked counts
    differ. One process with 4 or 1 micro-batches and two ranks of 2 make the same steps."""
    from transformers import BertConfig, BertForMaskedLM

    from tests.drills.test_models import hugging_face_names
    from training.models import build_model

    data = shards(tmp_path)
    alone = bert_run(tmp_path / "micro2", data, micro=2)
    inputs = torch.stack([sample[0] for sample in alone["batch"]])
    labels = torch.stack([sample[1] for sample in alone["batch"]])
    assert len(set((labels != -100).sum(1).tolist())) >= 3
    ours = build_model("bert_tiny")
    ours.load_state_dict(alone["initial"])
    size = ours.size
    reference = BertForMaskedLM(BertConfig(num_hidden_layers=size.layers, hidden_size=size.hidden,
                                           num_attention_heads=size.heads, intermediate_size=size.intermediate))
    reference.load_state_dict(hugging_face_names(ours), strict=True)
    mask = attention_mask(inputs, labels)
    with torch.no_grad():
        expected = reference.eval()(input_ids=inputs, labels=labels,
                                    attention_mask=None if mask is None else mask.long()).loss
    assert alone["losses"][0] == pytest.approx(float(expected), rel=1e-5)

    for other in (bert_run(tmp_path / "micro8", data, micro=8), bert_run(tmp_path / "two-ranks", data, world=2)):
        assert other["losses"] == pytest.approx(alone["losses"], rel=1e-5)
        for name, tensor in alone["weights"].items():
            assert torch.allclose(other["weights"][name], tensor, atol=1e-6), name
    assert not torch.allclose(alone["weights"]["mlm_bias"], alone["initial"]["mlm_bias"], atol=1e-4)  # it trained


# --- images: label smoothing, precision -----------------------------------------------------------

def image_config(work, *extra: str):
    return load_train_config(None, [
        "--model.name=mlp", "--model.image_size=16", "--model.num_classes=5", "--data.synthetic_samples=64",
        "--data.num_workers=0", "--train.global_batch_size=16", "--train.micro_batch_size=8",
        "--train.device=cpu", "--train.log_every_steps=1", f"--checkpoint.dir={work}/ckpt",
        f"--metrics.jsonl_path={work}/m.jsonl", *extra,
    ])


def test_an_image_models_loss_is_smoothed_as_torchvisions_recipe_smooths_it(tmp_path):
    trainer = Trainer(image_config(tmp_path, "--train.max_steps=1", "--train.precision=fp32"))
    model = trainer.module
    images, target, *_ = collate([(*sample, 0, 1.0, "") for sample in first_global_batch(trainer)])
    with torch.no_grad():
        logits = model(move(images, trainer.runtime, channels_last=False))
        smoothed = torch.nn.functional.cross_entropy(logits, target, label_smoothing=0.1)
        plain = torch.nn.functional.cross_entropy(logits, target)
    trainer.run()
    loss = records(tmp_path / "m.jsonl")[0]["loss"]
    assert loss == pytest.approx(float(smoothed), rel=1e-5) and abs(loss - float(plain)) > 1e-3


def test_the_default_precision_is_the_devices_and_the_rendezvous_names_it(tmp_path):
    trainer = Trainer(image_config(tmp_path, "--train.max_steps=1"))
    assert trainer.precision == "bf16" and not trainer.scaler.is_enabled()  # a CPU computes bf16
    trainer.run()
    assert records(tmp_path / "m.jsonl", "rendezvous")[0]["precision"] == "bf16"


# --- the linear schedule ----------------------------------------------------------------------------

def test_the_trainer_follows_hugging_faces_linear_schedule_by_samples(tmp_path):
    """Three epochs of 4 steps, positioned by samples trained: the logged rate of each step is
    get_linear_schedule_with_warmup's (transformers 5.23) for that step."""
    from transformers import get_linear_schedule_with_warmup

    Trainer(image_config(tmp_path, "--train.epochs=3", "--optim.schedule=linear", "--optim.warmup_steps=3",
                         "--optim.lr=0.2", "--train.precision=fp32")).run()
    logged = [r["lr"] for r in records(tmp_path / "m.jsonl")]
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.2)
    schedule = get_linear_schedule_with_warmup(optimizer, 3, 12)
    expected = []
    for _ in range(12):
        expected.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert logged == pytest.approx(expected, rel=1e-9, abs=1e-12)
