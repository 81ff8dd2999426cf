"""The vendors' dense peaks, the denominator of MFU: every GPU a learner meets, found by the name torch gives it."""

import pytest

from gpulab import datasheets, flops

# The names torch.cuda.get_device_name() returns on these cards, and the entry each must find.
TORCH_NAMES = {
    "Tesla T4": "T4", "NVIDIA L4": "L4", "NVIDIA A10": "A10", "NVIDIA A10G": "A10G", "NVIDIA L40S": "L40S",
    "NVIDIA A100-SXM4-40GB": "A100 SXM 40GB", "NVIDIA A100-SXM4-80GB": "A100 SXM 80GB",
    "NVIDIA A100-PCIE-40GB": "A100 PCIe 40GB", "NVIDIA A100 80GB PCIe": "A100 PCIe 80GB",
    "NVIDIA H100 80GB HBM3": "H100 SXM", "NVIDIA H100 PCIe": "H100 PCIe", "NVIDIA H100 NVL": "H100 NVL",
    "NVIDIA H200": "H200 SXM", "NVIDIA H200 NVL": "H200 NVL", "NVIDIA B200": "B200",
    "NVIDIA GeForce RTX 4090": "RTX 4090", "NVIDIA GeForce RTX 3090": "RTX 3090",
}


@pytest.mark.parametrize("torch_name, entry", TORCH_NAMES.items())
def test_every_card_a_learner_meets_is_found_by_its_torch_name(torch_name, entry):
    assert datasheets.find(torch_name).name == entry


def test_the_h200_has_its_own_row_not_the_h100s_by_accident():
    """Lesson 09 on the H200 fell back to the H100's figure for want of a row."""
    assert flops.datasheet("NVIDIA H200", "bf16") == 989.5 and datasheets.find("NVIDIA H200").name == "H200 SXM"
    assert "H200" in datasheets.find("NVIDIA H200").source


def test_figures_are_dense_and_only_for_native_precisions():
    for sheet in datasheets.SHEETS.values():
        t = sheet.tflops
        assert t["fp32"] > 0 and set(t) <= {"fp32", "tf32", "fp16", "bf16", "fp8"}, sheet.name
        if "bf16" in t:  # a tensor-core card: half precision twice TF32's rate, fp8 twice bf16's (dense figures)
            assert t["bf16"] == t["fp16"] == pytest.approx(2 * t["tf32"], rel=0.03), sheet.name  # B200: 2.25 vs 2.2 PF as printed
        if "fp8" in t:
            assert t["fp8"] == pytest.approx(2 * t["bf16"], rel=0.02), sheet.name
    assert datasheets.peak("Tesla T4", "bf16") is None and datasheets.peak("NVIDIA A100-SXM4-80GB", "fp8") is None
    assert datasheets.peak("NVIDIA H100 80GB HBM3", "bf16") == 989.5  # "with sparsity" would be 1979


def test_cpus_and_unknown_cards_have_no_peak():
    assert datasheets.find("AMD EPYC 7B13") is None and datasheets.peak("cpu", "fp32") is None
    assert datasheets.find("NVIDIA A10G").name != "A100 SXM 40GB"  # a word, not a prefix


def test_the_table_lists_every_card_with_its_source():
    table = datasheets.table()
    assert set(table.index) == set(datasheets.SHEETS) and table["source"].str.len().min() > 10
