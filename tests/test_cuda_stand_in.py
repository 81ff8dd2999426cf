"""The CUDA stand-in behaves as the torch.cuda calls it plays do (their errors as aten/src/ATen/cuda/CUDAEvent.h and
c10/cuda/CUDACachingAllocator.cpp word them), answers as torch does on the architecture of the card it plays (bf16,
SDPA's backends, FP8: tests/stand_in_architecture.py), plays cards whose facts are their datasheets', and leaves torch
as it found it: a fake that does not behave as the real thing proves nothing."""

import math
import mmap
import re
import warnings
from pathlib import Path
from unittest import mock

import pynvml
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode

import gpulab.device
from gpulab import datasheets, nvml

from . import stand_in_architecture
from .cuda_stand_in import CARDS, NVML_CARDS, GpuOnly, installed

aten = torch.ops.aten


def test_events_time_on_the_host_clock_and_refuse_as_torch_does(cuda_stand_in):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with pytest.raises(RuntimeError, match="Both events must be recorded"):
        start.elapsed_time(end)
    start.record()
    end.record(torch.cuda.current_stream())
    assert start.elapsed_time(end) >= 0 and isinstance(start.elapsed_time(end), float)  # milliseconds
    untimed = torch.cuda.Event()
    untimed.record()
    with pytest.raises(RuntimeError, match="enable_timing=True"):
        start.elapsed_time(untimed)
    with pytest.raises(TypeError):
        start.record("not a stream")


def test_a_stream_context_sets_the_current_stream_and_restores_it(cuda_stand_in):
    default, side = torch.cuda.current_stream(), torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert torch.cuda.current_stream() is side
        side.wait_stream(default)
    assert torch.cuda.current_stream() is default is torch.cuda.default_stream()
    assert isinstance(side.record_event(), torch.cuda.Event)


def test_pinning_copies_into_memory_that_says_it_is_pinned(cuda_stand_in):
    pageable = torch.ones(4)
    pinned = pageable.pin_memory()
    assert pinned is not pageable and torch.equal(pinned, pageable)
    assert pinned.is_pinned() and not pageable.is_pinned() and pinned.pin_memory() is pinned
    assert torch.empty(3, pin_memory=True).is_pinned()


def test_the_allocator_counts_live_tensors_and_reserves_whole_segments(cuda_stand_in):
    before = torch.cuda.memory_allocated()
    x = torch.empty(2**20, dtype=torch.uint8)  # 1 MiB
    assert torch.cuda.memory_allocated() - before == 2**20
    assert torch.cuda.memory_reserved() % (2 * 2**20) == 0 and torch.cuda.memory_reserved() >= torch.cuda.memory_allocated()
    del x
    assert torch.cuda.memory_allocated() == before and torch.cuda.max_memory_allocated() >= before + 2**20
    torch.cuda.reset_peak_memory_stats()
    assert torch.cuda.max_memory_allocated() == before
    free, total = torch.cuda.mem_get_info()
    assert total == torch.cuda.get_device_properties(0).total_memory and free == total - torch.cuda.memory_reserved()


def test_a_memory_fraction_is_a_budget_beyond_which_an_allocation_is_out_of_memory(cuda_stand_in):
    torch.cuda.set_per_process_memory_fraction(2**20 / torch.cuda.get_device_properties(0).total_memory)
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(2 * 2**20, dtype=torch.uint8)
    with pytest.raises(ValueError, match="Allowed range"):
        torch.cuda.set_per_process_memory_fraction(1.5)


def test_a_device_context_still_places_what_the_factories_make():
    """The stand-in wraps torch.empty, zeros and ones (for pin_memory); `with torch.device("meta")` (a model sized
    without memory, as lesson 09 counts a GPT's FLOPs) must still reach them, during and after."""
    from torch.utils._device import _device_constructors

    _device_constructors.cache_clear()  # torch builds its set of factories at the first device context
    with installed("Tesla T4"), torch.device("meta"):
        made = [torch.zeros(2), torch.ones(2), torch.empty(2), torch.nn.Linear(2, 2).weight]
    with torch.device("meta"):
        made.append(torch.zeros(2))
    assert {t.device.type for t in made} == {"meta"}


@pytest.mark.parametrize("call", [lambda: torch.cuda.CUDAGraph(), lambda: torch.cuda.graph(None),
                                  lambda: torch.cuda.memory._record_memory_history()])
def test_what_only_a_gpu_can_do_is_refused_not_pretended(cuda_stand_in, call):
    with pytest.raises(GpuOnly, match="needs a real GPU"):
        call()


@pytest.mark.parametrize("card, capability, native_bf16", [("NVIDIA H200", (9, 0), True), ("Tesla T4", (7, 5), False),
                                                            ("NVIDIA L4", (8, 9), True)])
def test_each_card_is_played_with_its_own_properties_and_torch_is_restored_after(card, capability, native_bf16):
    real = (torch.cuda.Event, torch.Tensor.pin_memory, F.scaled_dot_product_attention, torch._scaled_mm,
            torch.backends.cuda.can_use_flash_attention)
    with installed(card):
        assert gpulab.device.STAND_IN == card and torch.cuda.get_device_name() == card
        assert torch.cuda.get_device_capability() == capability
        assert torch.cuda.is_bf16_supported(including_emulation=False) is native_bf16
        assert gpulab.device_info().bf16_native is native_bf16
    assert gpulab.device.STAND_IN is None
    assert (torch.cuda.Event, torch.Tensor.pin_memory, F.scaled_dot_product_attention, torch._scaled_mm,
            torch.backends.cuda.can_use_flash_attention) == real


def test_the_device_generic_fixture_plays_the_cpu_an_h200_and_a_t4(course_device_and_t4):
    info = gpulab.device_info(course_device_and_t4)
    played = gpulab.device.STAND_IN
    assert gpulab.on_gpu(course_device_and_t4) is (played is not None)
    assert info.bf16_native is (played == "NVIDIA H200") and info.tensor_cores is (played is not None)
    assert info.name == (played or info.name) and info.sm_count in (None, 132, 40)


# ---- the cards: their datasheets' facts --------------------------------------------------------------------------

@pytest.mark.parametrize("name", CARDS)
def test_each_card_agrees_with_its_datasheet(name):
    """Architecture, SMs, memory (CUDA's total a little below the capacity the vendor states, the driver keeping
    some), memory bandwidth from the clock and bus CUDA reports, and NVML's power limit, PCIe link and GPM."""
    card, sheet = CARDS[name], datasheets.find(name)
    assert sheet is not None, f"no datasheet for {name}"
    assert (card.major, card.minor) == sheet.compute_capability and card.multi_processor_count == sheet.sms
    capacity = sheet.memory_gib * 2**30
    assert 0.9 * capacity <= card.total_memory <= capacity
    bandwidth_gbs = 2 * card.memory_clock_rate * 1e3 * card.memory_bus_width / 8 / 1e9  # as lesson 01 computes it
    assert bandwidth_gbs == pytest.approx(sheet.bandwidth_gbs, rel=0.01)
    played = NVML_CARDS[name]()
    assert played.name == name and played.power_limit_w == sheet.power_w and played.pcie_max == sheet.pcie
    assert played.memory_total_mib * 2**20 >= card.total_memory  # NVML's total includes the driver's reserve
    assert played.gpm is (card.major >= 9)  # GPM: Hopper and newer (nvml.h, nvmlGpmQueryDeviceSupport)


@pytest.mark.parametrize("name", CARDS)
def test_nvml_offers_gpm_only_on_hopper_and_newer_cards(name):
    with installed(name) as gpu, nvml.session() as nv:
        handle = nvml.handle_for(nv, 0)
        assert nv.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice == (gpu.card.major >= 9)
        assert (nvml.gpm_sample(nv, handle) is not None) == (gpu.card.major >= 9)
        if gpu.card.major < 9:
            sample = nv.nvmlGpmSampleAlloc()
            with pytest.raises(pynvml.NVMLError_NotSupported):
                nv.nvmlGpmSampleGet(handle, sample)
            nv.nvmlGpmSampleFree(sample)


# ---- bf16: what torch/cuda/__init__.py answers on the played architecture -----------------------------------------

@pytest.mark.parametrize("name", CARDS)
def test_is_bf16_supported_answers_as_torchs_own_function_does_on_the_card(name):
    """torch's is_bf16_supported itself, run on the played card with CUDA there: True from sm80; below it, False
    without emulation, else True (a bf16 tensor is made on any card torch runs on, a T4's included)."""
    torchs = torch.cuda.is_bf16_supported
    with installed(name), mock.patch.object(torch.cuda, "is_available", lambda: True), \
            mock.patch.object(torch.cuda, "_check_bf16_tensor_supported", lambda device: True):
        for emulation in (True, False):
            assert torch.cuda.is_bf16_supported(including_emulation=emulation) is torchs(including_emulation=emulation)
        assert torch.cuda.is_bf16_supported() is True


# ---- SDPA: the backend the card takes, or torch's refusal there -------------------------------------------------

def qkv(dtype=torch.float16, head_dim=16, requires_grad=True):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, 4, 32, head_dim, generator=g, dtype=dtype).requires_grad_(requires_grad) for _ in range(3)]


def attend(backends=None, **inputs):
    """One forward and backward of SDPA (causal) with ``backends`` forced; its profile's event names and devices."""
    q, k, v = qkv(**inputs)
    with sdpa_kernel(backends) if backends else warnings.catch_warnings(), torch.profiler.profile() as prof:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    return [(e.key, e.device_type.name) for e in prof.key_averages()]


def refused(backends, **inputs) -> list[str]:
    """What torch warns (without where) before it raises that no kernel is available for ``attend(backends)``."""
    with pytest.warns(UserWarning) as caught, pytest.raises(RuntimeError, match=r"^No available kernel\. Aborting "
                                                                                 r"execution\.$"):
        attend(backends, **inputs)
    assert {w.filename for w in caught} == {__file__}  # warned where the code called SDPA, as torch warns
    return [str(w.message).removesuffix(stand_in_architecture.SOURCE) for w in caught]


@pytest.mark.parametrize("cuda_stand_in", ["Tesla T4"], indirect=True)
def test_a_t4_takes_memory_efficient_attention_and_the_cpu_runs_its_own_kernel_under_its_own_name(cuda_stand_in):
    events = attend()  # PyTorch's choice: flash refused on sm75, memory-efficient next in priority order
    assert cuda_stand_in.attention == {"efficient": 1}
    names = [name for name, _ in events]
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in names  # the CPU's kernel, named as the CPU's
    assert not any("efficient" in name or "fmha" in name for name in names)  # no GPU kernel's name pretended
    assert {device for _, device in events} == {"CPU"}
    attend(SDPBackend.EFFICIENT_ATTENTION)
    assert "aten::_scaled_dot_product_attention_math" in [name for name, _ in attend(SDPBackend.MATH)]
    assert cuda_stand_in.attention == {"efficient": 2, "math": 1}


@pytest.mark.parametrize("cuda_stand_in", ["Tesla T4"], indirect=True)
@pytest.mark.parametrize("backends", [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                                      [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION]])
def test_a_t4_refuses_flash_and_cudnn_attention_as_torch_does(cuda_stand_in, backends):
    """sdp_utils.cpp select_sdp_backend: each fused backend's first failed constraint warned, then the error."""
    said = refused(backends)
    assert said[0::2] == ["Memory efficient kernel not used because:", "Flash attention kernel not used because:",
                          f"{stand_in_architecture.CUDNN} attention kernel not used because:"]
    assert said[1] == "Memory Efficient attention has been runtime disabled."
    assert said[3].startswith("Flash attention") and said[5].startswith(("cuDNN", "CuDNN"))
    sm75 = [line for line in said if line.endswith("Attempting to run on a sm 7.5 gpu.")]
    assert len(sm75) == (2 if isinstance(backends, list) else 1)
    assert not cuda_stand_in.attention


@pytest.mark.parametrize("cuda_stand_in", ["Tesla T4"], indirect=True)
def test_a_t4s_memory_efficient_attention_refuses_bf16_as_torch_does_before_sm80(cuda_stand_in):
    assert refused(SDPBackend.EFFICIENT_ATTENTION, dtype=torch.bfloat16)[1] == (
        "Expected query, key and value to all be of dtype: {Half, Float}. Got Query dtype: c10::BFloat16, Key dtype: "
        "c10::BFloat16, and Value dtype: c10::BFloat16 instead.")


@pytest.mark.parametrize("cuda_stand_in", ["NVIDIA L4", "NVIDIA H200"], indirect=True)
def test_an_ampere_or_newer_card_runs_flash_attention_in_half_precision_only(cuda_stand_in):
    attend(SDPBackend.FLASH_ATTENTION, dtype=torch.bfloat16)
    assert cuda_stand_in.attention == {"flash": 1}
    assert "dtype: {Half, BFloat16}. Got Query dtype: float" in refused(SDPBackend.FLASH_ATTENTION, dtype=torch.float32)[3]
    attend(dtype=torch.float32)  # PyTorch's choice for fp32: memory-efficient
    assert cuda_stand_in.attention == {"flash": 1, "efficient": 1}


@pytest.mark.parametrize("cuda_stand_in, chosen", [("NVIDIA H200", "cudnn"), ("NVIDIA L4", "flash")],
                         indirect=["cuda_stand_in"])
def test_pytorchs_choice_in_bf16_is_cudnn_on_a_hopper_card_and_flash_on_an_l4(cuda_stand_in, chosen, monkeypatch):
    """sdp_utils.cpp check_prefer_cudnn_attention: cuDNN first on sm90 with a cuDNN newer than 9.15 (this torch loads
    9.24; the H200's run of 2026-11-28, torch 2.11, printed aten::_scaled_dot_product_cudnn_attention → cuDNN); not on
    sm89, nor where TORCH_CUDNN_SDPA_DEPRIORITIZED=1, nor before torch 2.9."""
    monkeypatch.delenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", raising=False)
    attend(dtype=torch.bfloat16)
    assert cuda_stand_in.attention == {chosen: 1}
    monkeypatch.setenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", "1")
    with mock.patch.object(stand_in_architecture, "TORCH", max(stand_in_architecture.TORCH, (2, 10))):
        attend(dtype=torch.bfloat16)
    monkeypatch.delenv("TORCH_CUDNN_SDPA_DEPRIORITIZED")
    with mock.patch.object(stand_in_architecture, "TORCH", (2, 8)):
        attend(dtype=torch.bfloat16)
    assert cuda_stand_in.attention == ({"cudnn": 1, "flash": 2} if chosen == "cudnn" else {"flash": 3})


@pytest.mark.parametrize("cuda_stand_in", ["NVIDIA H200"], indirect=True)
def test_a_priority_order_the_code_sets_is_the_one_tried(cuda_stand_in):
    """sdpa_kernel(..., set_priority=True) writes Context's order, which priority_order returns as it is."""
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION], set_priority=True):
        attend(dtype=torch.bfloat16)
    assert cuda_stand_in.attention == {"flash": 1}


@pytest.mark.parametrize("cuda_stand_in", ["NVIDIA H200"], indirect=True)
def test_the_card_chooses_for_the_dtype_autocast_casts_the_inputs_to(cuda_stand_in):
    """float32 inputs under bf16 autocast reach the kernel in bf16, which flash takes (float32 it refuses)."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        attend(SDPBackend.FLASH_ATTENTION, dtype=torch.float32)
    assert cuda_stand_in.attention == {"flash": 1}


@pytest.mark.parametrize("cuda_stand_in", ["NVIDIA L4"], indirect=True)
def test_an_l4_refuses_flash_attention_for_training_with_a_head_dim_over_192(cuda_stand_in):
    """check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89: sm86-sm89 only, training only."""
    assert "training with head_dim ∈ (192, 224]" in refused(SDPBackend.FLASH_ATTENTION, head_dim=200)[3]
    with torch.no_grad():
        F.scaled_dot_product_attention(*qkv(head_dim=200), is_causal=True)
    assert cuda_stand_in.attention == {"flash": 1}


def test_the_backends_checks_answer_for_the_card_played():
    q, k, v = qkv()
    params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, True, False)
    for name, flash in (("Tesla T4", False), ("NVIDIA L4", True)):
        with installed(name):
            assert torch.backends.cuda.can_use_flash_attention(params) is flash
            assert torch.backends.cuda.can_use_cudnn_attention(params) is flash
            assert torch.backends.cuda.can_use_efficient_attention(params) is True
    with installed("Tesla T4"), pytest.warns(UserWarning, match="sm 7.5"):
        torch.backends.cuda.can_use_flash_attention(params, debug=True)


def test_with_every_backend_disabled_no_backend_is_viable(cuda_stand_in):
    with sdpa_kernel(SDPBackend.MATH):
        torch.backends.cuda.enable_math_sdp(False)
        with pytest.raises(RuntimeError, match="No viable backend for scaled_dot_product_attention was found"):
            F.scaled_dot_product_attention(*qkv(), is_causal=True)


def test_torch_compile_traces_the_played_sdpa_as_one_operator():
    """Under torch.compile the card's checks are not traced (they would break the graph a GPU compiles whole)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    played = stand_in_architecture.attention(F.scaled_dot_product_attention, CARDS["Tesla T4"], chosen := {})
    torch._dynamo.reset()
    torch.compile(lambda q: played(q, q, q, is_causal=True).relu(), backend=backend, fullgraph=True)(qkv()[0])
    calls = [node.target for node in graphs[0].graph.nodes if node.op == "call_function"]
    assert len(graphs) == 1 and F.scaled_dot_product_attention in calls and not chosen


def test_what_the_stand_in_warns_and_raises_is_worded_as_this_torchs_binary_words_it():
    """Each fixed text (to the first number) is in the installed torch's libtorch_cuda.so, as TORCH_WARN and TORCH_CHECK
    there write it: the stand-in follows the version (2.6: CuDNN and sm90; 2.14: cuDNN and sm121)."""
    library = Path(torch.__file__).parent / "lib" / "libtorch_cuda.so"
    if not library.exists():
        pytest.skip("this torch has no CUDA library to read its words from")
    texts = []
    with installed("Tesla T4"):
        for backends in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):
            with warnings.catch_warnings(record=True) as caught, pytest.raises(RuntimeError) as raised:
                warnings.simplefilter("always")
                attend(backends)
            texts += [str(w.message).removesuffix(stand_in_architecture.SOURCE) for w in caught] + [str(raised.value)]
        with pytest.raises(RuntimeError) as raised:
            torch._scaled_mm(*fp8_operands())
        texts.append(str(raised.value))
    with open(library, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as binary:
        missing = [text for text in dict.fromkeys(re.split(r"(?<=a sm )\d", t)[0] for t in texts)
                   if binary.find(text.encode()) < 0]
    assert not missing, f"not in {library.name} of torch {torch.__version__}: {missing}"


# ---- FP8: torch._scaled_mm from sm_89 -----------------------------------------------------------------------------

def fp8_operands(n: int = 32):
    """A row-major e4m3 matrix, a column-major one and their float32 scales, as _scaled_mm takes them."""
    a = torch.randn(n, n).to(torch.float8_e4m3fn)
    b = torch.randn(n, n).to(torch.float8_e4m3fn).t()
    return a, b, torch.tensor(1.0), torch.tensor(1.0)


@pytest.mark.parametrize("name", ["Tesla T4", "NVIDIA A100-SXM4-40GB"])
def test_fp8_matmuls_are_refused_below_sm89_as_torch_refuses_them(name):
    with installed(name), pytest.raises(RuntimeError, match=r"^torch\._scaled_mm is only supported on CUDA devices with "
                                                            r"compute capability >= 9\.0 or 8\.9, or ROCm MI300\+$"):
        torch._scaled_mm(*fp8_operands(), out_dtype=torch.bfloat16)


@pytest.mark.parametrize("name", ["NVIDIA L4", "NVIDIA GeForce RTX 4060 Laptop GPU", "NVIDIA H200"])
def test_fp8_matmuls_run_where_the_card_has_fp8_with_the_gpus_layout_checks(name):
    a, b, scale_a, scale_b = fp8_operands()
    with installed(name):
        with pytest.raises(RuntimeError, match="mat2 must be col_major"):
            torch._scaled_mm(a, b.contiguous(), scale_a, scale_b, out_dtype=torch.bfloat16)
        try:
            out = torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=torch.bfloat16)
        except GpuOnly as refused:  # torch before 2.14's CPU kernel: no FP8 matmul on a CPU
            assert "no CPU kernel" in str(refused)
            return
    expected = a.float() @ b.float()
    assert out.dtype == torch.bfloat16 and torch.allclose(out.float(), expected, rtol=1e-2, atol=math.inf)


class _Seen(TorchDispatchMode):
    """The operators that reach the CPU's kernels, with their first argument's dtype."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((func, next((a.dtype for a in args if isinstance(a, torch.Tensor)), None)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_products_and_convolutions_sum_in_fp32_and_round_once_as_tensor_cores_do(dtype):
    a, b, c = (torch.randn(32, 32, dtype=dtype) for _ in range(3))
    x, w = torch.randn(2, 3, 8, 8, dtype=dtype, requires_grad=True), torch.randn(4, 3, 3, 3, dtype=dtype)
    with _Seen() as seen, stand_in_architecture.TensorCoreTracker():
        product, added, into = a @ b, torch.addmm(c, a, b), torch.empty(32, 32, dtype=dtype)
        torch.mm(a, b, out=into)
        F.conv2d(x, w).sum().backward()
        elementwise = a + b
    wide = (a.float() @ b.float()).to(dtype)
    assert torch.equal(product, wide) and torch.equal(into, wide) and product.dtype == into.dtype == dtype
    assert torch.equal(added, torch.addmm(c.float(), a.float(), b.float()).to(dtype))
    assert x.grad.dtype == dtype and elementwise.dtype == dtype
    products = {aten.mm.default, aten.addmm.default, aten.convolution.default, aten.convolution_backward.default}
    assert {d for f, d in seen.calls if f in products} == {torch.float32}  # the CPU's 16-bit kernels never ran
    assert (aten.add.Tensor, dtype) in seen.calls  # everything else runs as it is


def test_the_allocator_counts_a_16_bit_product_not_its_fp32_working_copies(cuda_stand_in):
    a, b = torch.randn(256, 256, dtype=torch.float16), torch.randn(256, 256, dtype=torch.float16)
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    product = a @ b
    assert torch.cuda.memory_allocated() - before == product.nbytes == 256 * 256 * 2
    assert torch.cuda.max_memory_allocated() == before + product.nbytes
