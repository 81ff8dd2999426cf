"""Lessons 00–04 on the GPU path, checked on a CPU: the TF32 switch the lessons use keeps PyTorch's legacy and new
readers consistent, lesson 02's on-device pipeline copies nothing from the host per batch, and lesson 04's text says
what gpulab.precision does."""

import ast
import json
import subprocess
import sys
import textwrap

import nbformat
import pytest
import torch
from torch.overrides import TorchFunctionMode
from torchvision.transforms import v2

from gpulab.data import MEAN, STD, SyntheticImages
from gpulab.questions.observe import observe

from .conftest import ROOT

LESSONS = sorted((ROOT / "notebooks").glob("0[0-4]_*.ipynb"))


def cells(lesson: str, kind: str = "code") -> list:
    path = next((ROOT / "notebooks").glob(f"{lesson}_*.ipynb"))
    return [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == kind]


def cell(lesson: str, cell_id: str) -> str:
    return next(c.source for c in cells(lesson) if c.get("id") == cell_id)


def function_source(lesson: str, name: str) -> str:
    """The source of the function ``name`` as a lesson's code cell defines it."""
    for source in (c.source for c in cells(lesson)):
        for node in ast.parse(source).body:
            if isinstance(node, ast.FunctionDef) and node.name == name:
                return ast.get_source_segment(source, node)
    raise LookupError(f"lesson {lesson} defines no function {name}")


# ---- TF32: set the lessons' way, read back by the legacy and the new API ---------------------------------------

def _assignments(source: str) -> list[str]:
    return [ast.unparse(target) for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Assign)
            for target in node.targets]


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name)
def test_lessons_switch_tf32_with_set_float32_matmul_precision_only(path):
    """The per-backend attribute (torch 2.9+) alone leaves the legacy readers raising; the legacy flag alone is the
    old API. torch.set_float32_matmul_precision sets both, in every torch the course allows."""
    code = [c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
    written = [t for source in code for t in _assignments(source) if "fp32_precision" in t or "allow_tf32" in t]
    assert not written, f"{path.name} sets TF32 by assignment ({written}): use torch.set_float32_matmul_precision"


def _flags_after(*steps: str) -> list[dict]:
    """Run each step in turn in one fresh Python (TF32 flags are process-wide), reading the switch back both ways
    after each: the legacy flag, the per-backend attribute (torch 2.9+), torch.get_float32_matmul_precision()."""
    read = textwrap.dedent("""
        new = getattr(torch.backends.cuda.matmul, "fp32_precision", None)
        print(json.dumps({"allow_tf32": torch.backends.cuda.matmul.allow_tf32, "fp32_precision": new,
                          "matmul_precision": torch.get_float32_matmul_precision()}))
    """)
    program = "import json, torch\n" + "".join(f"{step}\n{read}" for step in steps)
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=300)
    if done.returncode:
        raise RuntimeError(done.stderr.strip().splitlines()[-1])
    return [json.loads(line) for line in done.stdout.splitlines()[-len(steps):]]


def test_lesson_04s_tf32_switch_reads_back_both_ways_without_raising():
    switch = function_source("04", "tf32")
    assert "torch.set_float32_matmul_precision" in switch
    on, off = _flags_after(f"{switch}\ntf32('tf32')", "tf32('fp32')")  # on, then off again: the comparisons take turns
    assert on["allow_tf32"] is True and on["matmul_precision"] == "high" and on["fp32_precision"] in (None, "tf32")
    assert off["allow_tf32"] is False and off["matmul_precision"] == "highest"
    assert off["fp32_precision"] in (None, "ieee")


def test_every_tf32_statement_of_lesson_04_reads_back_both_ways():
    statements = sorted({ast.unparse(node) for source in (c.source for c in cells("04"))
                         for node in ast.walk(ast.parse(source))
                         if isinstance(node, ast.Expr) and "set_float32_matmul_precision" in ast.unparse(node)})
    assert statements
    steps = [(statement, p) for statement in statements for p in ("tf32", "fp16", "fp32")]
    for (statement, p), flags in zip(steps, _flags_after(*(f"p = {p!r}\n{statement}" for statement, p in steps))):
        assert flags["allow_tf32"] is (p == "tf32" and "'high'" in statement), (statement, p, flags)
        assert flags["fp32_precision"] in (None, "tf32" if flags["allow_tf32"] else "ieee"), (statement, p, flags)


def test_the_new_api_alone_makes_the_legacy_reader_raise_on_this_torch():
    """What the lesson's text warns about (seen on torch 2.14.1), and why the lessons do not set it that way."""
    if not hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        pytest.skip(f"torch {torch.__version__} has no torch.backends.cuda.matmul.fp32_precision (added in 2.9)")
    try:
        _flags_after("torch.backends.cuda.matmul.fp32_precision = 'tf32'")
    except RuntimeError as err:
        assert "mix of the legacy and new APIs" in str(err)
    else:
        pytest.skip(f"torch {torch.__version__} no longer raises when the legacy flag is read after the new one is set")


def test_lesson_04_says_what_the_tf32_error_is_and_which_api_it_uses():
    text = "\n".join(c.source for c in cells("04", "markdown"))
    assert 'torch.set_float32_matmul_precision("high")' in text
    assert "disagreeing" not in text  # the old, wrong explanation: the readers raise without any disagreement
    assert "mix of the legacy and new APIs" in text and "2.9" in text


def test_lesson_04_measures_its_peak_once_and_links_to_how_flops_ceiling_times_it():
    """The roofline's measured peak is flops.ceiling's, the ceiling section 3 divides by (one search per precision,
    not a second one by precision.matmul_peak); how it times (a second of the precision's own products first, then
    about 0.4 s per shape, flops.ceiling's full-mode defaults) is said once, on the measuring page, which the lesson
    links to."""
    import inspect

    from gpulab import flops

    sweep = next(source for source in (c.source for c in cells("04")) if "device copy" in source)
    assert "flops.ceiling(p, device)" in sweep and "measured_peak" not in sweep
    assert "full=0.4" in inspect.getsource(flops.ceiling).split("seconds = by_mode(")[1].split("\n")[0]
    assert "by_mode(full=1.0," in inspect.getsource(flops._measure_ceiling)
    text = "\n".join(c.source for c in cells("04", "markdown"))
    assert "(how_the_course_measures.ipynb#ceilings)" in text and "matmul_peak" not in text
    page = " ".join(c.source for c in nbformat.read(ROOT / "notebooks" / "how_the_course_measures.ipynb",
                                                    as_version=4).cells if c.cell_type == "markdown").split()
    assert "after a second of the precision's own untimed products" in " ".join(page)
    assert "for about 0.4 s" in " ".join(page)


# ---- lesson 02: constants made once per device, no copy from the host per batch ----------------------------------


class HostData(TorchFunctionMode):
    """Tensors made from host data (Python lists, CPU tensors) on another device: each a copy from the host, and on
    a GPU a wait for it. ``made`` names the call that made each."""

    def __init__(self):
        super().__init__()
        self.made = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        device = kwargs.get("device")
        if name in ("tensor", "as_tensor") and device is not None and torch.device(device).type != "cpu":
            data = args[0] if args else kwargs.get("data")
            if not (isinstance(data, torch.Tensor) and data.device.type != "cpu"):
                self.made.append(name)
        return func(*args, **kwargs)


def _host_copies(fn) -> list[str]:
    with observe() as seen, HostData() as made:
        fn()
    return made.made + [f"{c.method} from the host" for c in seen.copies if c.source == "cpu" and c.target != "cpu"]


@pytest.fixture
def on_device_pipeline():
    """Lesson 02's feeding cell, run with the "meta" device standing in for a GPU: the data set lives there."""
    trained = []
    scope = {"torch": torch, "v2": v2, "SyntheticImages": SyntheticImages, "MEAN": MEAN, "STD": STD,
             "device": torch.device("meta"), "batch_size": 4, "batches_per_epoch": 3, "image_size": 12, "crop": 8,
             "train_step": lambda x, y: trained.append((x, y))}
    exec(compile(cell("02", "3e2df3ff"), "<lesson 02, feeding the GPU>", "exec"), scope)
    n = scope["n_images"]
    scope["images_dev"] = torch.zeros(n, 3, 12, 12, dtype=torch.uint8, device="meta")
    scope["labels_dev"] = torch.zeros(n, dtype=torch.int64, device="meta")
    scope["trained"] = trained
    return scope


def test_the_on_device_pipeline_copies_nothing_from_the_host_per_batch(on_device_pipeline):
    scope = on_device_pipeline
    batches = scope["batches_on_device"]()
    for _ in range(2 * scope["batches_per_epoch"]):  # across an epoch boundary (a new shuffle)
        assert _host_copies(lambda: scope["train_on_uint8"](next(batches))) == []
    x, _ = scope["trained"][-1]
    assert x.device.type == "meta" and x.dtype == torch.float32 and tuple(x.shape) == (4, 3, 8, 8)
    assert scope["mean"].device.type == scope["std"].device.type == "meta"  # made once, on the device


def test_the_count_catches_v2_normalize_copying_its_constants_every_call(on_device_pipeline):
    """What the lesson did before: v2.Normalize(mean=[...], std=[...]) makes two device tensors from lists per call."""
    x = torch.zeros(4, 3, 8, 8, device="meta")
    assert _host_copies(lambda: v2.Normalize(mean=list(MEAN), std=list(STD))(x)) == ["as_tensor", "as_tensor"]
    assert _host_copies(lambda: (x - on_device_pipeline["mean"]) / on_device_pipeline["std"]) == []
    assert _host_copies(lambda: torch.zeros(2).to("meta")) == ["to from the host"]


# ---- lesson 00 on a GPU: the CUDA stand-in with the fake libnvidia-ml --------------------------------------------------

def lesson_00_nvml_cell(capsys) -> str:
    """Lesson 00's NVML cell (section 4) on the CPU playing an H200, as it runs after section 3 found NVML."""
    import gpulab
    from gpulab import nvml

    scope = {"__name__": "__main__", "gpulab": gpulab, "torch": torch, "nvml": nvml, "device": torch.device("cpu"),
             "ok": True, "driver": "580.159.04"}
    exec(compile(cell("00", "1fc5d308"), "<lesson 00, NVML>", "exec"), scope)
    return capsys.readouterr().out


# The H200 of 2026-11-28: NVML's total 143,771 MiB (150.75 GB), torch's total_memory 150.1 GB (the stand-in's card).
H200_GAP_MIB = round((143_771 * 2**20 - 150_110_000_000) / 2**20)


def test_lesson_00_names_the_driver_reserve_between_nvmls_and_cudas_memory_totals(cuda_stand_in, capsys):
    """On the H200 section 1 printed 150.1 GB and section 4 150.8 GB, side by side, with no word on why: NVML counts
    the card's whole memory, CUDA leaves out what the driver reserves (NVML's memory query version 2 names it)."""
    from . import fake_libnvml

    with fake_libnvml.installed(fake_libnvml.h200(memory_used_bytes=3 * 10**9, reserved_mib=H200_GAP_MIB)):
        out = lesson_00_nvml_cell(capsys)
    assert "memory used 3.00 of 150.8 GB (and 0.64 GB reserved by the driver)" in out
    assert f"Two totals for one card: NVML's 150.75 GB, CUDA's 150.11 GB (section 1): NVML counts 0.64 GB " \
           f"({H200_GAP_MIB} MiB) more." in out
    assert f"That gap is the driver's reserve, 0.64 GB ({H200_GAP_MIB} MiB)" in out


def test_lesson_00_says_what_the_reserve_leaves_unexplained(cuda_stand_in, capsys):
    from . import fake_libnvml

    with fake_libnvml.installed(fake_libnvml.h200(reserved_mib=H200_GAP_MIB // 2)):
        out = lesson_00_nvml_cell(capsys)
    assert f"The driver reserves 0.32 GB ({H200_GAP_MIB // 2} MiB) of the gap; the other 0.32 GB" in out


def test_lesson_00_without_memory_info_v2_reads_version_1_and_says_the_gap_is_unnamed(cuda_stand_in, capsys):
    """A driver without nvmlDeviceGetMemoryInfo_v2: version 1's `used` includes the reserve, and the cell does not
    guess the gap's cause."""
    from . import fake_libnvml

    card = fake_libnvml.h200(memory_used_bytes=3 * 10**9 - H200_GAP_MIB * 2**20, reserved_mib=H200_GAP_MIB)
    with fake_libnvml.installed(card, missing=("nvmlDeviceGetMemoryInfo_v2",)):
        out = lesson_00_nvml_cell(capsys)
    assert "memory used 3.00 of 150.8 GB (the driver's reserve included)" in out
    assert "NVML counts 0.64 GB" in out and "cannot be named from here" in out


def test_lesson_00_runs_its_gpu_branches_on_the_stand_in(cuda_stand_in, fake_nvml_card, monkeypatch, results_dir,
                                                       capsys):
    """Every code cell of lesson 00 in order, on the CPU playing an H200 with NVML answering (the audit of 2026-11-28
    listed cells 11, 25 and 29 as run by no test): the version matrix from NVML, the memory totals, doctor's GPU
    checks, the CPU-vs-GPU matmul sizes and their crossover. The comparisons are timed for 10 ms each."""
    import matplotlib.pyplot as plt

    import gpulab

    monkeypatch.setenv("GPULAB_QUICK", "1")
    monkeypatch.setattr(plt, "show", lambda *args, **kwargs: None)
    compare = gpulab.compare
    monkeypatch.setattr(gpulab, "compare", lambda *args, **kwargs: compare(*args, **{**kwargs, "min_time": 0.01}))
    scope = {"__name__": "__main__", "display": print}
    before = torch.get_float32_matmul_precision()
    try:
        for index, source in enumerate(c.source for c in cells("00")):
            exec(compile(source, f"<lesson 00, code cell {index}>", "exec"), scope)
    finally:
        torch.set_float32_matmul_precision(before)
        plt.close("all")
    out = capsys.readouterr().out
    assert "newest CUDA the driver supports" in str(scope["matrix"]) and scope["driver_cuda"] == (13, 0)
    assert "Two totals for one card: NVML's 150.75 GB, CUDA's 150.11 GB" in out
    assert "[ok  ] tensor on GPU: computed on cpu (NVIDIA H200)" in out
    assert set(scope["results"]["on"]) == {"cpu", "cuda"} and len(scope["gpu_vs_cpu"]) == 6
    assert "NVIDIA H200: " in out and "for fp32 matmuls up to n = 512" in out
