"""One run, one table: the trainer against a bare loop on the same device, side by side.

    python benchmarks/throughput.py [--sections resnet,jpeg,bert] [--cpus N] [--before OLD_CHECKOUT] [--json FILE]

Every figure is wall clock between synchronized points. The bare loop runs zero_grad, forward,
backward and step on one batch that already sits on the device; the trainer runs as users run
it (``python -m training train``, in its own process) and its rate is read from the timestamps
of its own step events, which follow a device sync. Sizes follow the device: ResNet-50 at
224 px, batch 256, bf16 on a GPU; ResNet-18 at 64 px, batch 16, fp32 on a CPU.

Sections:
  resnet  synthetic uint8 images through the loader, eager and torch.compile, against the bare loop
  jpeg    ImageNet-like JPEGs (500x375, ~100 KB) with 12 loader workers (2 on a CPU): decoded on the device
          (nvJPEG) and in the workers (Pillow), each against the compiled bare loop
  bert    BERT-base and BERT-large against the bare loop; the masked-only MLM head against every position
  bert_compiled  the same under torch.compile, and the compiled bare loop against the eager one (not by default)

The whole run (the bare loop, each trainer and its loader workers) is confined to ``--cpus``
CPUs, the share of the host one accelerator gets on a real node. By default on a GPU that is the
share per GPU of the catalog's node type for it: 12 vCPUs per A100 (p4d.24xlarge: 96 vCPUs, 8
GPUs; the job charts request a little less), 24 per H100 (p5.48xlarge). A vCPU is one of a
core's two threads, so the run takes whole cores: 12 vCPUs are 6 cores. On a host that shows
one thread per core the run gets the share's cores instead (6 for an A100): without their
second threads, a lower bound. A bigger benchmark machine would otherwise lend the input
pipeline cores that no training pod has.

``--before`` names a checkout of an older commit: its trainer runs the same rows, for before/after.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from config.catalog import CATALOG, Accelerator, InstanceType, lookup
from training.diagnostics.throughput import bare_loop, compare_mlm_heads
from training.config import load_train_config

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Sizes:
    model: str
    image_size: int
    batch: int
    precision: str
    workers: int
    warmup: int
    steps: int
    bert_batch: dict[str, int]
    seq_len: int


GPU = Sizes("resnet50", 224, 256, "bf16", 12, 20, 40, {"bert_base": 64, "bert_large": 32}, 128)
CPU = Sizes("resnet18", 64, 16, "fp32", 2, 5, 10, {"bert_base": 4}, 64)


def parse_cpu_list(text: str) -> set[int]:
    """The kernel's CPU list format (``0-3,8``)."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return cpus


def smt_siblings(cpu: int) -> set[int]:
    """The CPUs that are hardware threads of ``cpu``'s core, itself included, as the kernel reports
    them (a virtual machine reports what its hypervisor shows it)."""
    try:
        return parse_cpu_list(Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text())
    except OSError:
        return {cpu}


def cores_of(cpus: list[int], siblings: Callable[[int], set[int]]) -> list[list[int]]:
    """``cpus`` grouped by core, in the order of each core's lowest CPU."""
    cores, placed = [], set()
    for cpu in sorted(cpus):
        if cpu not in placed:
            core = sorted((siblings(cpu) & set(cpus)) | {cpu})
            cores.append(core)
            placed.update(core)
    return cores


def pick_cpus(allowed: list[int], count: int, siblings: Callable[[int], set[int]] = smt_siblings) -> list[int]:
    """``count`` of ``allowed``: whole cores first, the lowest-numbered first. On a host with two
    threads per core, 12 CPUs are then 6 cores, as a p4d's 12 vCPUs per A100 are; the first 12
    CPUs by number would often be 12 cores' first threads, twice the cores a pod has."""
    cores = cores_of(allowed, siblings)
    picked: list[int] = []
    for core in cores:
        if len(picked) + len(core) <= count:
            picked += core
    for core in cores:  # a count whole cores cannot make up: single threads of the cores left
        picked += [cpu for cpu in core if cpu not in picked][:max(0, count - len(picked))]
    return sorted(picked)


def layout(cpus: list[int], siblings: Callable[[int], set[int]] = smt_siblings) -> str:
    """How many cores ``cpus`` are, in words: ``6 cores × 2 threads``."""
    cores = cores_of(cpus, siblings)
    threads = {len(core) for core in cores}
    plural = "s" if len(cores) > 1 else ""
    if len(threads) == 1:
        each = threads.pop()
        return f"{len(cores)} core{plural} × {each} thread{'s' if each > 1 else ''}"
    return f"{len(cpus)} threads on {len(cores)} core{plural}"


def node_type_for(gpu_name: str) -> InstanceType:
    """The node type whose CPU share per GPU a run on ``gpu_name`` should get: of the catalog's
    types with that GPU and the most GPUs per node (the nodes distributed training runs on), the
    one with the fewest vCPUs per GPU. A GPU the catalog does not know gets p4d.24xlarge's."""
    words = set(re.split(r"[\s_-]+", gpu_name))
    same_gpu = [t for t in CATALOG.values() if t.accelerator is Accelerator.NVIDIA and t.accelerator_model in words]
    if not same_gpu:
        return lookup("p4d.24xlarge")
    most = max(t.accelerator_count for t in same_gpu)
    return min((t for t in same_gpu if t.accelerator_count == most),
               key=lambda t: (t.vcpus / t.accelerator_count, t.name))


def share_of(node: InstanceType, allowed: list[int],
             siblings: Callable[[int], set[int]] = smt_siblings) -> tuple[int, str]:
    """How many of ``allowed`` a run gets for one of ``node``'s GPUs, and the table's words for it.
    A host that shows two threads per core gives the share's vCPUs as whole cores. One that shows
    one thread per core (many virtual machines do, whatever the hardware underneath) gives the
    share's core count: those cores without their second threads, a lower bound."""
    vcpus, cores = node.vcpus // node.accelerator_count, node.cores // node.accelerator_count
    words = (f"a {node.name}'s share per {node.accelerator_model}: {vcpus} vCPUs, {cores} cores × "
             f"{node.threads_per_core} threads")
    if any(len(core) > 1 for core in cores_of(allowed, siblings)):
        return min(vcpus, len(allowed)), words
    count = min(cores, len(allowed))  # a smaller host gives what it has
    return count, f"{words}; this host shows one thread per core, so the run has {count} cores without their " \
                  "second threads (a lower bound)"


def confine(cpus: int | None) -> str:
    """Confine this process, and what it starts from now on, to ``cpus`` of the CPUs it may use,
    whole cores first (children inherit the mask). Returns the table's words for it."""
    allowed = sorted(os.sched_getaffinity(0))
    if cpus is None or cpus == len(allowed):
        return f"{len(allowed)} CPUs ({layout(allowed, smt_siblings)})"
    if not 1 <= cpus <= len(allowed):
        raise SystemExit(f"--cpus: got {cpus}; allowed: 1 to {len(allowed)} (the CPUs this process may use)")
    picked = pick_cpus(allowed, cpus, smt_siblings)
    os.sched_setaffinity(0, picked)
    # Children read the mask when they start; this process's own thread pool was sized at import.
    torch.set_num_threads(min(torch.get_num_threads(), cpus))
    return f"confined to {cpus} of {len(allowed)} CPUs ({layout(picked, smt_siblings)})"


def trainer_rate(tree: Path, overrides: list[str], batch: int, warmup: int, steps: int,
                 env: dict[str, str] | None = None) -> tuple[float, float]:
    """Samples/s of ``python -m training train`` in ``tree``, between its step events at
    ``warmup`` and ``warmup + steps`` (each follows a device sync), and the share of that time
    it waited for input. ``steps`` is a multiple of ``warmup``: the last event is a regular one,
    in the loop, also in older trees that report once more after tearing the loader down."""
    if steps % warmup:
        raise ValueError(f"steps ({steps}) must be a multiple of warmup ({warmup})")
    with tempfile.TemporaryDirectory() as scratch:
        args = [*overrides, f"--train.max_steps={warmup + steps}", f"--train.log_every_steps={warmup}",
                f"--train.micro_batch_size={batch}", f"--train.global_batch_size={batch}",
                f"--checkpoint.dir={scratch}/ckpt", "--checkpoint.interval_steps=1000000",
                f"--metrics.jsonl_path={scratch}/metrics.jsonl", "--metrics.stdout=json"]
        if (tree / "training" / "loop" / "evaluate.py").is_file():  # no validation at the end: not measured
            args.append("--eval.enabled=false")
        done = subprocess.run([sys.executable, "-m", "training", "train", *args], cwd=tree, capture_output=True,
                              text=True, timeout=900, env={**os.environ, **(env or {})})
        if done.returncode:
            raise RuntimeError(f"trainer in {tree} exited {done.returncode}: {done.stderr.strip()[-600:]}")
        steps_seen = [r for r in map(json.loads, Path(f"{scratch}/metrics.jsonl").read_text().splitlines())
                      if r["event"] == "step"]
    first, last = steps_seen[0], steps_seen[-1]
    return (last["step"] - first["step"]) * batch / (last["time"] - first["time"]), last.get("data_wait_pct", 0.0)


def common(sizes: Sizes, device: str, model: str | None = None) -> list[str]:
    model = model or sizes.model
    return [f"--model.name={model}", f"--model.image_size={sizes.image_size}", "--model.num_classes=1000",
            f"--train.precision={sizes.precision}", f"--train.device={device}", "--optim.name=sgd"]


def bare_rate(overrides: list[str], batch: int, warmup: int, steps: int) -> float:
    config = load_train_config(None, [*overrides, f"--train.micro_batch_size={batch}",
                                      f"--train.global_batch_size={batch}"])
    rate = bare_loop(config, steps, warmup)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rate


class Table:
    def __init__(self, device_name: str, json_path: str | None):
        self.rows: list[dict] = []
        self.device_name, self.json_path = device_name, json_path

    def add(self, what: str, reference: str, reference_rate: float, rate: float, goal: float | None = None,
            **extra) -> None:
        row = {"what": what, "reference": reference, "reference_samples_per_s": round(reference_rate, 1),
               "samples_per_s": round(rate, 1), "ratio": round(rate / reference_rate, 3), "goal": goal, **extra}
        self.rows.append(row)
        print(json.dumps(row), flush=True)
        if self.json_path:
            Path(self.json_path).write_text(json.dumps({"device": self.device_name, "rows": self.rows}, indent=1))

    def render(self) -> str:
        today = datetime.date.today().isoformat()
        lines = [f"{self.device_name}, torch {torch.__version__}, {today}", "",
                 "| what | reference | reference samples/s | samples/s | ratio | goal |", "|---|---|---|---|---|---|"]
        for r in self.rows:
            goal = f"≥ {r['goal']}" if r["goal"] else ""
            lines.append(f"| {r['what']} | {r['reference']} | {r['reference_samples_per_s']:,.0f} | "
                         f"{r['samples_per_s']:,.0f} | {r['ratio']:.3f} | {goal} |")
        return "\n".join(lines)


def resnet(table: Table, sizes: Sizes, device: str, before: Path | None, repeats: int,
           lean: bool = False) -> dict[str, float]:
    if not lean:
        loader_rate(table, sizes, [*common(sizes, device), f"--data.num_workers={sizes.workers}"],
                f"synthetic uint8 images, {sizes.workers} workers")
    bare_compiled = {}
    for compiled in (False, True) if device == "cuda" else (False,):  # inductor on a CPU: minutes, not the point
        mode = "compiled" if compiled else "eager"
        overrides = [*common(sizes, device), f"--model.compile={str(compiled).lower()}"]
        bare, trainer, old, wait = [], [], [], []
        for _ in range(repeats):  # alternating, so drift hits both alike
            bare.append(bare_rate(overrides, sizes.batch, sizes.warmup, sizes.steps))
            rate, waited = trainer_rate(REPO, [*overrides, f"--data.num_workers={sizes.workers}"], sizes.batch,
                                        sizes.warmup, sizes.steps)
            trainer.append(rate)
            wait.append(waited)
            if before:
                old.append(trainer_rate(before, [*overrides, f"--data.num_workers={sizes.workers}"], sizes.batch,
                                        sizes.warmup, sizes.steps)[0])
        bare_median = statistics.median(bare)
        bare_compiled[mode] = bare_median
        name = f"{sizes.model} {sizes.image_size}px b{sizes.batch} {sizes.precision}, synthetic, {mode}"
        if before:
            table.add(f"{name}: trainer before", f"bare loop, {mode}", bare_median, statistics.median(old),
                      runs=[round(x, 1) for x in old])
        table.add(f"{name}: trainer", f"bare loop, {mode}", bare_median, statistics.median(trainer), 0.97,
                  runs=[round(x, 1) for x in trainer], bare_runs=[round(x, 1) for x in bare], data_wait_pct=wait)
    return bare_compiled


def jpeg(table: Table, sizes: Sizes, device: str, before: Path | None, bare_compiled: float | None,
         images: int | None, lean: bool = False) -> None:
    from training.data.imagenet import write_sample_jpegs

    count = images or sizes.batch * (sizes.warmup + sizes.steps + 2)  # one epoch covers the measurement
    with tempfile.TemporaryDirectory() as root:
        megabytes = write_sample_jpegs(root, count, classes=100) / 2**20
        overrides = [*common(sizes, device), "--data.kind=imagefolder", f"--data.path={root}",
                     f"--data.num_workers={sizes.workers}"]
        mode = "compiled" if device == "cuda" else "eager"
        overrides.append(f"--model.compile={str(device == 'cuda').lower()}")
        if not lean or bare_compiled is None:
            # The reference computes on these JPEGs too (measured: within 0.5 % of synthetic images).
            bare_compiled = bare_rate(overrides, sizes.batch, sizes.warmup, sizes.steps)
        if not lean:
            decoder_rate(table, root, sizes, device)
            for decode in ("device", "loader"):
                loader_rate(table, sizes, [*overrides, f"--data.decode={decode}"], f"JPEGs, decode={decode}")
        where = f"{count} JPEGs ({megabytes / count * 1024:.0f} KiB avg), {sizes.workers} workers, {mode}"
        # An experiment: the GIL's switch interval at 1 ms instead of 5 (a sitecustomize sets it).
        switch = Path(root).parent / f"{Path(root).name}-switch"
        switch.mkdir()
        (switch / "sitecustomize.py").write_text("import sys\nsys.setswitchinterval(0.001)\n")
        fast_switch = {"PYTHONPATH": os.pathsep.join(filter(None, [str(switch), os.environ.get("PYTHONPATH")]))}
        variants = [("device", None, ""), ("loader", None, "")]
        if not lean:
            variants.insert(1, ("device", fast_switch, ", GIL switch 1 ms"))
        for decode, env, note in variants:
            rate, waited = trainer_rate(REPO, [*overrides, f"--data.decode={decode}"], sizes.batch, sizes.warmup,
                                        sizes.steps, env)
            # The goal is the input pipeline's, whichever process decodes.
            table.add(f"{sizes.model} on {where}: decode={decode}{note}", f"bare loop, {mode}", bare_compiled, rate,
                      0.9 if device == "cuda" else None, data_wait_pct=waited)
        if before:
            rate = trainer_rate(before, overrides, sizes.batch, sizes.warmup, sizes.steps)[0]
            table.add(f"{sizes.model} on {where}: trainer before (Pillow)", f"bare loop, {mode}", bare_compiled,
                      rate)


def decoder_rate(table: Table, root: str, sizes: Sizes, device: str, batches: int = 8) -> None:
    """Images/s of the device decoder alone (decode, crop, resize), against Pillow on one core."""
    import time

    from training.data.datasets import ImageFolder, Keyed
    from training.data.decode import PillowDecoder, build_decoder, collate
    from training.device import detect
    from training.data.sampler import SampleKey

    runtime = detect(device)
    dataset = Keyed(ImageFolder(root, sizes.image_size, encoded=True))
    batch = collate([dataset[SampleKey(i, 1.0, i)] for i in range(sizes.batch)])[0]
    rates = {}
    device_decoder = build_decoder("device", runtime.kind)
    if hasattr(device_decoder, "_decode_all"):  # nvJPEG alone, without the crops
        device_decoder._decode_all(batch.data, runtime.device)
        runtime.synchronize()
        started = time.perf_counter()
        for _ in range(batches):
            device_decoder._decode_all(batch.data, runtime.device)
        runtime.synchronize()
        table.add(f"nvJPEG decode alone, {len(batch)} JPEGs", "Pillow, one core", 1.0,
                  batches * len(batch) / (time.perf_counter() - started))
    for name, decoder in (("device", device_decoder), ("pillow", PillowDecoder())):
        rounds = batches if name == "device" else 1
        decoder(batch, sizes.image_size, runtime.device)  # warm-up: handles, kernels
        runtime.synchronize()
        started = time.perf_counter()
        for _ in range(rounds):
            decoder(batch, sizes.image_size, runtime.device)
        runtime.synchronize()
        rates[name] = rounds * len(batch) / (time.perf_counter() - started)
    table.add(f"decode + crop of {len(batch)} JPEGs: {type(build_decoder('device', runtime.kind)).__name__}",
              "Pillow, one core", rates["pillow"], rates["device"])


def loader_rate(table: Table, sizes: Sizes, overrides: list[str], label: str, batches: int = 40) -> None:
    """Batches/s of the DataLoader alone (workers, collation, pinning), no model: the input ceiling."""
    import time

    from training.data.datasets import build_dataset, build_loader
    from training.data.sampler import ElasticBatchPlan, Layout, MicroBatchSampler

    config = load_train_config(None, [*overrides, f"--train.micro_batch_size={sizes.batch}",
                                      f"--train.global_batch_size={sizes.batch}"])
    dataset = build_dataset(config, encoded=config.data.decode == "device")
    plan = ElasticBatchPlan(len(dataset), sizes.batch, 0)
    loader = build_loader(dataset, MicroBatchSampler(plan, 0, 0, 0, Layout(1, 1, sizes.batch)), config,
                          pin_memory=torch.cuda.is_available())
    batches = min(batches, len(loader) - 5)
    iterator = iter(loader)
    for _ in range(5):
        next(iterator)
    started = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    rate = batches * sizes.batch / (time.perf_counter() - started)
    del iterator, loader
    table.add(f"loader alone: {label}", "reference 1 sample/s", 1.0, rate)


def feed_overhead(table: Table, sizes: Sizes, device: str, steps: int = 40, rounds: int = 2) -> None:
    """Where the trainer's input costs time: the bare loop's step on one model, fed three ways,
    alternately: one batch already on the device; fresh pinned batches through DeviceFeed (the
    copy, normalization and feed thread); the real DataLoader through DeviceFeed."""
    import itertools
    import time

    from training.diagnostics.throughput import _single_batch, reference_optimizer
    from training.data.datasets import build_dataset, build_loader
    from training.data.feed import DeviceFeed, move
    from training.device import detect
    from training.models import build_model
    from training.data.sampler import ElasticBatchPlan, Layout, MicroBatchSampler
    from training.loop.compile import compile_with_fallback
    from training.loop.objective import per_sample_loss

    config = load_train_config(None, [*common(sizes, device), f"--data.num_workers={sizes.workers}",
                                      f"--train.micro_batch_size={sizes.batch}", f"--train.global_batch_size={sizes.batch}"])
    runtime = detect(device)
    model = build_model(config.model.name, 1000, sizes.image_size).to(runtime.device).to(memory_format=torch.channels_last)
    # The bare loop's optimizer, at learning rate 0: the fixed batch would otherwise be learnt.
    optimizer = reference_optimizer(model, config)
    if device == "cuda":
        model = compile_with_fallback(model)
    host_inputs, host_target = _single_batch(config)
    fixed = move((host_inputs, host_target), runtime, True)
    pinned = [(host_inputs.roll(i, 0).pin_memory() if device == "cuda" else host_inputs.roll(i, 0), host_target,
               torch.arange(sizes.batch), torch.ones(sizes.batch), [""] * sizes.batch) for i in range(8)]
    dataset = build_dataset(config)
    plan = ElasticBatchPlan(len(dataset), sizes.batch, 0)

    def step(inputs, target):
        optimizer.zero_grad(set_to_none=True)
        with runtime.autocast(sizes.precision):
            loss = per_sample_loss(model, inputs, target, False).mean()
        loss.backward()
        optimizer.step()

    def timed(next_batch) -> float:
        for i in range(sizes.warmup + steps):
            if i == sizes.warmup:
                runtime.synchronize()
                started = time.perf_counter()
            step(*next_batch())
        runtime.synchronize()
        return steps * sizes.batch / (time.perf_counter() - started)

    def through(feed: DeviceFeed):
        def next_batch():
            batch = feed.take()
            feed.ahead()
            return batch.inputs, batch.target
        return next_batch

    def loader_variant(pin_in_loader: bool, pin_in_feed: bool, switch_interval: float | None = None):
        def run() -> float:
            default = sys.getswitchinterval()
            if switch_interval:
                sys.setswitchinterval(switch_interval)
            loader = build_loader(dataset, MicroBatchSampler(plan, 0, 0, 0, Layout(1, 1, sizes.batch)), config,
                                  pin_memory=pin_in_loader and device == "cuda")
            feed = DeviceFeed(loader, runtime, True, pin=pin_in_feed and device == "cuda")
            try:
                return timed(through(feed))
            finally:
                feed.close()
                sys.setswitchinterval(default)
        return run

    def fresh() -> float:
        feed = DeviceFeed(itertools.cycle(pinned), runtime, True)
        try:
            return timed(through(feed))
        finally:
            feed.close()

    variants = {
        "one batch on the device": lambda: timed(lambda: fixed),
        "fresh pinned batches via DeviceFeed": fresh,
        "DataLoader (pins) + DeviceFeed": loader_variant(True, False),
        "DataLoader + DeviceFeed (pins)": loader_variant(False, True),
        "DataLoader + DeviceFeed, pageable copy": loader_variant(False, False),
        "DataLoader (pins) + DeviceFeed, GIL switch 1 ms": loader_variant(True, False, 0.001),
    }
    rates: dict[str, list[float]] = {label: [] for label in variants}
    for _ in range(rounds):
        for label, run in variants.items():
            rates[label].append(run())
    reference = statistics.median(rates["one batch on the device"])
    for label, values in rates.items():
        table.add(f"bare step, {label}", "one batch on the device", reference, statistics.median(values),
                  runs=[round(v, 1) for v in values])


def bert(table: Table, sizes: Sizes, device: str, before: Path | None, repeats: int, compiled: bool = False) -> None:
    """BERT-base and -large: the trainer against the bare loop, and the MLM head's saving. With
    ``compiled`` (section ``bert_compiled``), both run under torch.compile, and the compiled bare
    loop is set against the eager one: whether compiling BERT by default would pay."""
    for name, batch in sizes.bert_batch.items():
        overrides = [f"--model.name={name}", f"--data.seq_len={sizes.seq_len}", f"--train.precision={sizes.precision}",
                     f"--train.device={device}", "--optim.name=sgd", f"--model.compile={str(compiled).lower()}"]
        # Token batches are cheap: four workers keep up; on a small CPU, no more workers than it has for them.
        workers = f"--data.num_workers={min(4, sizes.workers)}"
        bare, trainer, old, eager = [], [], [], []
        for _ in range(repeats):
            bare.append(bare_rate(overrides, batch, sizes.warmup, sizes.steps))
            trainer.append(trainer_rate(REPO, [*overrides, workers], batch, sizes.warmup,
                                        sizes.steps)[0])
            if compiled:
                eager.append(bare_rate([*overrides, "--model.compile=false"], batch, sizes.warmup, sizes.steps))
            elif before:
                old.append(trainer_rate(before, [*overrides, workers], batch, sizes.warmup,
                                        sizes.steps)[0])
        label = f"{name} b{batch}x{sizes.seq_len} {sizes.precision}{', compiled' if compiled else ''}"
        if old:
            table.add(f"{label}: trainer before", "bare loop", statistics.median(bare), statistics.median(old))
        table.add(f"{label}: trainer", "bare loop", statistics.median(bare), statistics.median(trainer), 0.97)
        if compiled:
            table.add(f"{label}: bare loop", "bare loop, eager", statistics.median(eager), statistics.median(bare),
                      runs=[round(x, 1) for x in bare], eager_runs=[round(x, 1) for x in eager])
            continue
        heads = compare_mlm_heads(name, batch, sizes.seq_len, 5, torch.device(device), sizes.precision)
        table.add(f"{label}: MLM head at masked positions", "head at every position",
                  batch / heads["every position"], batch / heads["masked only"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default="resnet,jpeg,bert")
    parser.add_argument("--before", type=Path, help="a checkout of an older commit, run the same way")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--images", type=int, help="JPEGs to write (default: one epoch covers the measurement)")
    parser.add_argument("--cpus", type=int,
                        help="CPUs the run may use (default with a GPU: the share per GPU of the node type that "
                             "carries it, e.g. 12 vCPUs per A100 on a p4d.24xlarge, 24 per H100 on a p5.48xlarge, "
                             "as whole cores, or that share's cores on a host that shows one thread per core; "
                             "without a GPU, every CPU)")
    parser.add_argument("--json", help="write the rows here as they come")
    parser.add_argument("--lean", action="store_true",
                        help="only the trainer-against-bare rows (no loader, decoder or variant diagnostics)")
    args = parser.parse_args()
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    cuda = torch.cuda.is_available()
    device, sizes = ("cuda", GPU) if cuda else ("cpu", CPU)
    if cuda:
        gpu = torch.cuda.get_device_name(0)
        # A host with fewer CPUs than the share runs on what it has (the table says how many).
        default, share = share_of(node_type_for(gpu), sorted(os.sched_getaffinity(0)))
        cpus = confine(default if args.cpus is None else args.cpus)
        table = Table(f"{gpu}, {cpus}; {share}", args.json)
    else:
        table = Table(f"CPU, {confine(args.cpus)}", args.json)
    sections = args.sections.split(",")
    bare_compiled = None
    if "resnet" in sections:
        bare_rates = resnet(table, sizes, device, args.before, args.repeats, args.lean)
        bare_compiled = bare_rates.get("compiled", bare_rates.get("eager"))
    if "feed" in sections:
        feed_overhead(table, sizes, device)
    if "jpeg" in sections:
        jpeg(table, sizes, device, args.before, bare_compiled, args.images, args.lean)
    if "bert" in sections:
        bert(table, sizes, device, args.before, args.repeats)
    if "bert_compiled" in sections:
        bert(table, sizes, device, None, args.repeats, compiled=True)
    print(table.render())


if __name__ == "__main__":
    main()
