"""MFU's denominator: one table of peak FLOPS (training/device.py), found by the device's exact
name, covering every accelerator of the catalog (config/catalog.py) with its data sheet's figure."""

from __future__ import annotations

import logging

import pytest

from config.catalog import CATALOG
from training.device import ACCELERATORS, NEURON_FAMILIES, accelerator, neuron_device, peak_flops

# Dense bf16/fp16 tensor peaks of one device, no sparsity, from the vendors' data sheets.
DATA_SHEET_TFLOPS = {
    "V100": 125,  # Tesla V100 SXM2 data sheet: tensor performance 125 TFLOPS
    # The AWS A10G data sheet (NVIDIA_AWS_A10G_DataSheet_FINAL_02_17_2022.pdf): BF16 70 TFLOPS
    # dense, 140 with sparsity. Not the A10's 125: GA102 runs fp32-accumulated bf16 at half rate.
    "A10G": 70,
    "L4": 121,  # L4 data sheet: 242 with sparsity
    "L40S": 362.05,  # L40S data sheet: 733 with sparsity
    "A100": 312,  # A100 data sheet: 624 with sparsity
    "H100": 989,  # H100 SXM data sheet: 1,979 with sparsity
    "H200": 989,  # H200 SXM data sheet: 1,979 with sparsity
    "Trainium": 190,  # AWS Neuron docs, Trainium architecture: two NeuronCore-v2, 190 BF16 TFLOPS
    "Trainium2": 667,  # AWS Neuron docs, Trainium2 architecture: eight NeuronCore-v3, 667 BF16 TFLOPS dense
}

# What torch.cuda.get_device_name says on each catalog GPU type (the SXM parts AWS sells).
CUDA_NAMES = {
    "p3.8xlarge": "Tesla V100-SXM2-16GB",
    "p3dn.24xlarge": "Tesla V100-SXM2-32GB",
    "p4d.24xlarge": "NVIDIA A100-SXM4-40GB",
    "p4de.24xlarge": "NVIDIA A100-SXM4-80GB",
    "p5.48xlarge": "NVIDIA H100 80GB HBM3",
    "p5e.48xlarge": "NVIDIA H200",
    "p5en.48xlarge": "NVIDIA H200",
    "g5.xlarge": "NVIDIA A10G",
    "g5.12xlarge": "NVIDIA A10G",
    "g5.48xlarge": "NVIDIA A10G",
    "g6e.48xlarge": "NVIDIA L40S",
}


def test_every_catalog_accelerator_has_its_data_sheet_peak():
    accelerated = {name: t for name, t in CATALOG.items() if t.is_accelerated}
    for name, instance in accelerated.items():
        if instance.accelerator.value == "nvidia":
            device = CUDA_NAMES[name]  # a new GPU type in the catalog needs its device name here
        else:
            device = NEURON_FAMILIES[instance.family]
            # The processes torchrun starts there (the catalog's) share the chips' peak between them.
            _, per_process = neuron_device(name, None)
            assert per_process * instance.nproc_per_node == pytest.approx(
                ACCELERATORS[device].peak_flops * instance.accelerator_count), name
        found = ACCELERATORS[device]
        assert found.model == instance.accelerator_model, (name, device)
        assert found.peak_flops == pytest.approx(DATA_SHEET_TFLOPS[found.model] * 1e12), (name, device)
    # Every entry of the table has its figure checked here, the catalog's and any other (L4).
    assert {entry.model for entry in ACCELERATORS.values()} <= set(DATA_SHEET_TFLOPS)
    for entry in ACCELERATORS.values():
        assert entry.peak_flops == pytest.approx(DATA_SHEET_TFLOPS[entry.model] * 1e12)


def test_a_name_is_found_exactly_not_as_a_substring():
    assert peak_flops("NVIDIA L40S") == pytest.approx(362.05e12)  # not the L4's 121 ("L4" is in "L40S")
    assert peak_flops("NVIDIA L4") == pytest.approx(121e12)
    assert peak_flops(" nvidia  a10g ") == pytest.approx(70e12)  # spaces and case do not count


@pytest.mark.parametrize("name", ["NVIDIA H100 PCIe", "NVIDIA L40", "NVIDIA A100-PCIE-40GB", "Tesla T4"])
def test_an_unknown_device_has_no_peak_and_says_so_once(name, caplog):
    # Each of these holds a known model's name: a substring match gave them its figure.
    with caplog.at_level(logging.WARNING, logger="training.device"):
        assert peak_flops(name) is None
        assert accelerator(name) is None
    lines = [r.getMessage() for r in caplog.records if name in r.getMessage()]
    assert len(lines) == 1 and "no MFU is reported" in lines[0]


def test_a_neuron_process_gets_its_share_of_the_chip():
    # torchrun runs one process per logical NeuronCore: 2 per Trainium chip, 4 per Trainium2 at LNC=2.
    assert neuron_device("trn1.32xlarge", None) == ("Trainium", pytest.approx(95e12))
    assert neuron_device("trn1n.32xlarge", "2") == ("Trainium", pytest.approx(95e12))  # trn1 has LNC=1 only
    assert neuron_device("trn2.48xlarge", None) == ("Trainium2", pytest.approx(667e12 / 4))
    assert neuron_device("trn2.48xlarge", "1") == ("Trainium2", pytest.approx(667e12 / 8))
    name, peak = neuron_device("inf2.xlarge", None)
    assert peak is None and "inf2.xlarge" in name
