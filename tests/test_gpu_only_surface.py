"""What no CPU can run: the course's GPU-only surface, one entry per behaviour, with what it relies on in torch or NVML
and where that is defined. Everything around these calls runs in the CPU's tests (on the CPU, and on the CPU playing a
GPU: tests/cuda_stand_in.py, tests/fake_libnvml.py); these entries are what the next GPU run (`make verify-gpu`, the
README's "GPU verification in one command") must confirm.

The tests below keep the list in step with the code: every entry's calls are still made somewhere in the package or
the lessons (no stale entry), and every ``torch.cuda`` call the package and the lessons make is answered by the
stand-in, works without a GPU, or is named here (no unlisted GPU-only call).
"""

import re
from dataclasses import dataclass

import pytest

from .conftest import ROOT
from .cuda_stand_in import answered


@dataclass(frozen=True)
class GpuOnly:
    """One behaviour only a GPU shows."""

    behaviour: str
    calls: tuple[str, ...]  # how the code makes it: text found in the package, lessons or solutions
    relies_on: str  # what torch, CUDA or NVML does there, and where that is defined
    confirm: str  # what the next GPU run must see, and where


SURFACE = (
    GpuOnly("CUDA graph capture and replay of a whole training step",
            ("torch.cuda.CUDAGraph", "torch.cuda.graph("),
            "torch/cuda/graphs.py (CUDAGraph, graph): capture on a side stream after a warm-up there, static input "
            "and output buffers, the optimizer's lr in a tensor; torch's notes/cuda.rst, 'Whole-network capture'",
            "lesson 08 full mode: the 'whole step in a CUDA graph' step runs, trains the same losses as eager and is "
            "faster"),
    GpuOnly("A GradScaler's step and update captured in a CUDA graph (fp16 with fused SGD)",
            ("scaler.load_state_dict(saved_scale)",),
            "torch/amp/grad_scaler.py (step: an optimizer with _step_supports_amp_scaling, as fused SGD, is handed the "
            "scale and the overflow flag as tensors and no .item() is read; update: torch._amp_update_scale_ in place; "
            "load_state_dict fills the scale in place: torch 2.6 and 2.14); torch's notes/cuda.rst, 'Usage with "
            "torch.cuda.amp', covers only optimizers whose step syncs",
            "tests/test_lesson08_gpu_path.py::test_on_a_gpu_the_captured_fp16_step_replays_the_eager_losses_and_skips_"
            "an_overflowed_update (gpu-marked, any GPU: lesson 08's fp16 step captured with fused SGD replays the eager "
            "losses; at a scale every gradient overflows, a replay leaves the weights as they were and halves the "
            "scale); then lesson 08 full mode in fp16 (a T4, none lent so far): the captured step races, its losses "
            "within the race's tolerance"),
    GpuOnly("Lesson 08's check counting a captured step: the hooks' counting kernels recorded into the graph",
            ("is_current_stream_capturing",),
            "torch/cuda/graphs.py (graph): kernels launched during capture, the hooks' included, are replayed; backward "
            "and AccumulateGrad's post-hooks run on the capture stream (torch's notes/cuda.rst, 'Stream semantics of "
            "backward passes'; torch/csrc/autograd/engine.cpp)",
            "lesson 08's check of an answer that captures its step counts epochs × images"),
    GpuOnly("torch.compile(mode='reduce-overhead'): CUDA graph trees, their output reuse and gradient accumulation",
            ("reduce-overhead", "torch.compiler.cudagraph_mark_step_begin"),
            "torch/_inductor/cudagraph_trees.py: a new generation frees the last one's outputs (format_dealloc_msg; "
            "in 2.14 its gradient-output message advises stable, preallocated .grad buffers); AccumulateGrad adds "
            "into an existing .grad in place (torch/csrc/autograd/functions/accumulate_grad.h)",
            "lesson 10 full mode: the 'CUDA graphs' step with accumulation over several micro-batches runs, and its "
            "loss gap stays within the race's tolerance"),
    GpuOnly("Triton kernels: torch.compile's GPU code and triton.testing.do_bench",
            ("torch.compile(", "do_bench"),
            "torch/_inductor (Triton code generation for CUDA tensors; a CPU gets C++ instead); "
            "triton/testing.py do_bench (its own L2 flush and CUDA events)",
            "lessons 06, 10 and 11 full mode compile and run; `gpulab bench` agrees with do_bench"),
    GpuOnly("A CUDA C kernel built at run time, and CUDA_LAUNCH_BLOCKING in a fresh process",
            ("CUDA_LAUNCH_BLOCKING",),
            "torch/utils/cpp_extension.py (load_inline with nvcc); CUDA_LAUNCH_BLOCKING is read when the CUDA "
            "context is made (c10/cuda/CUDAFunctions.cpp)",
            "lesson 01 full mode: the vector-add kernel builds and runs; launches block under CUDA_LAUNCH_BLOCKING=1"),
    GpuOnly("Kernel timing between CUDA events, and what a synchronisation waits for",
            ("torch.cuda.Event(", "torch.cuda.synchronize"),
            "cudaEventRecord/cudaEventElapsedTime through torch/cuda/streams.py (Event): GPU-side timestamps about "
            "0.5 µs apart; the stand-in's events read the host clock",
            "lesson 01: launch overhead, warm and cold copies, the sync-in-a-loop demo"),
    GpuOnly("A queue held busy while an event is recorded (so an event times the work, not its launch)",
            ("torch.cuda._sleep",),
            "torch/cuda/__init__.py _sleep and aten/src/ATen/cuda/Sleep.cu spin_kernel (one thread spins on clock64 "
            "on the current stream); an event is stamped when the stream reaches it (torch/cuda/streams.py, Event); "
            "gpulab.timing queues both on the measured GPU under torch.cuda.stream(current_stream(device)), whose "
            "setStream makes that GPU current (torch/csrc/cuda/Module.cpp THCPModule_setStream_wrap)",
            "lesson 01: warm copies no slower than cold ones at every size; the sync in a loop's GPU time per step "
            "(gpulab.timing.queue_and_run) at most the loop's time per step transferring once; on a machine with two "
            "GPUs, bench(..., alone=True, device='cuda:1') with cuda:0 current holds cuda:1"),
    GpuOnly("Device memory's theoretical bandwidth, the vector add's ceiling",
            ("memory_clock_rate", "memory_bus_width"),
            "_CudaDeviceProperties (torch/csrc/cuda/Module.cpp): the memory clock and bus width (older torch lacks "
            "them: no ceiling is shown there)",
            "lesson 01: no share of the ceiling above 100 %"),
    GpuOnly("NVML's memory total against CUDA's: the driver's reserve",
            ("nvmlMemory_v2",),
            "nvml.h nvmlDeviceGetMemoryInfo_v2 and nvmlMemory_v2_t.reserved, against cudaDeviceProp.totalGlobalMem",
            "lesson 00: the gap between the two totals is the driver's reserve"),
    GpuOnly("Copies that overlap compute: pinned host memory, non_blocking copies, side streams",
            ("non_blocking=True", "torch.cuda.Stream(", "pin_memory"),
            "cudaMemcpyAsync from page-locked memory on a stream (torch/csrc/utils/tensor_new.cpp, "
            "aten/src/ATen/native/cuda/Copy.cu); torch's notes/cuda.rst 'CUDA streams' and 'Use pinned memory "
            "buffers'; the stand-in runs every operation at once and pins by copying",
            "lesson 02 full mode: pinned beats pageable, the copy hides behind compute on a side stream"),
    GpuOnly("The DataLoader's pinning thread",
            ("pin_memory=True",),
            "torch/utils/data/dataloader.py _BaseDataLoaderIter.__init__: pins batches only where "
            "torch.accelerator.is_available(); the stand-in leaves that as the machine has it (it warns, pins nothing)",
            "lesson 02 full mode: the pinned loader's batches are pinned and copy faster"),
    GpuOnly("Nsight Systems and Nsight Compute on real kernels",
            ('"nsys"', '"ncu"'),
            "NVIDIA's profilers, started as programs (lesson 06 looks for them on PATH); ncu replays one kernel with "
            "its hardware counters",
            "lesson 06 on a GPU machine that has them: the commands it prints run"),
    GpuOnly("The sync debug mode's warnings",
            ("torch.cuda.set_sync_debug_mode",),
            "c10/cuda/CUDAFunctions.h warn_or_error_on_sync: raised by CUDA operations that synchronise; a CPU "
            "operation never does",
            "lessons 01 and 06: the synchronising calls are named"),
    GpuOnly("GPU kernels in a profiler trace (CUPTI), and the busy share read from them",
            ("ProfilerActivity.CUDA",),
            "torch/profiler/profiler.py (profile, schedule: one cycle with repeat=1) and Kineto's CUPTI activity; "
            "HolisticTraceAnalysis reads the exported trace",
            "busy.measure in lessons 02, 08 and 10, and lesson 06's traces, hold kernels; kernel-busy below 100 %"),
    GpuOnly("Lesson 06's path read from a GPU's traces: the CPU's waits for the GPU, the copies and the kernels a "
            "fix shortens",
            ('"cudaStreamSynchronize"', "fix_path.FixPath("),
            ".item() and a copy without non_blocking=True wait in at::cuda::memcpy_and_sync, a cudaStreamSynchronize "
            "(aten/src/ATen/native/cuda/CUDAScalar.cu, Copy.cu); CUPTI's kernel and memcpy records; the CPU's tests "
            "read the 2026-11-28 H200's quick-mode traces (tests/data/lesson06/)",
            "lesson 06 full mode: each fix not kept names its part's milliseconds from that run's traces, the per-step "
            "sync among them; the path ends where the trace says the GPU is the bottleneck or says what holds it back"),
    GpuOnly("The caching allocator's real numbers: reserved memory, fragmentation, workspaces, the CUDA context",
            ("memory_reserved", "mem_get_info", "WorkspaceMeter"),
            "c10/cuda/CUDACachingAllocator.cpp (segments, caching, empty_cache); cudaMemGetInfo counts the CUDA "
            "context and other processes; cuBLAS and cuDNN workspaces",
            "lesson 05 full mode: the OOM demo inside its cap, the remedies' peaks, the fragmentation script's two "
            "processes in their planned budget beside the lesson's; lesson 03's workspace finding"),
    GpuOnly("Lesson 05's checkpointing on a GPU: its cut of the step's peak beside foreach Adam's temporaries, and its "
            "cost the recomputation",
            ('"checkpointing cuts the step\'s peak"',),
            "torch/optim/optimizer.py _default_to_fused_or_foreach (foreach for CUDA tensors only) and torch/optim/"
            "adam.py _multi_tensor_adam (exp_avg_sq_sqrt: a model-sized list of temporaries, 2.6-2.14; the 2026-11-28 "
            "H200 measured it: 1.04 MiB for quick mode's 1.03 MiB of weights); the stand-in's tensors are the CPU's, for "
            "which Adam loops: tests/test_lesson05_plan.py measures foreach Adam on the meta device instead, and the "
            "step's time is the plan's estimate",
            "lesson 05 full mode: one block at a time at least 40 % lower than no checkpointing; its speed near what "
            "one more forward of the blocks predicts, the plan's step time within a factor of 2"),
    GpuOnly("The allocator's history and snapshots",
            ("torch.cuda.memory._record_memory_history", "torch.cuda.memory._dump_snapshot", "torch.cuda.memory._snapshot"),
            "torch/cuda/memory.py (_record_memory_history, _snapshot, _dump_snapshot): the C++ allocator records "
            "each block with its stack",
            "lesson 05 full mode: the snapshot's timeline is drawn offline"),
    GpuOnly("NVML's real values: utilisation over its sample period, clocks, power, throttle reasons, GPM SM activity",
            ("nvmlDeviceGetUtilizationRates", "nvmlGpmMetricsGet", "nvmlDeviceGetCurrentClocksEventReasons"),
            "nvml.h (nvmlDeviceGetUtilizationRates: a sample period between 1 s and 1/6 s; GPM metrics, Hopper and "
            "newer); tests/fake_libnvml.py proves the calls through nvidia-ml-py's real wrappers, never the values",
            "the verification's monitor.csv; lesson 00's NVML cell and `gpulab doctor`; the caveats beside each "
            "result"),
    GpuOnly("The SDPA kernels that run, their speed and their memory",
            ("sdpa_kernel",),
            "torch/nn/attention/__init__.py (sdpa_kernel, SDPBackend); the backends' constraints in "
            "aten/src/ATen/native/transformers/cuda/sdp_utils.cpp. The stand-in plays which backend the card takes "
            "and torch's refusal where none can (tests/stand_in_architecture.py), then runs the CPU's own kernel: the "
            "GPU kernels (pytorch_flash, fmha_cutlass, cuDNN's) never run here",
            "lesson 09's attention rows: the fused kernels run, memory grows linearly with the sequence; on a T4 "
            "flash and cuDNN are refused and memory-efficient runs"),
    GpuOnly("PyTorch's choice of SDPA backend on an H100 or H200: cuDNN first where torch and its cuDNN prefer it",
            ('backend or "(PyTorch\'s choice)"',),
            "aten/src/ATen/native/transformers/cuda/sdp_utils.cpp check_prefer_cudnn_attention, read by priority_order "
            "at the first SDPA call: from torch 2.9 (pytorch/pytorch#162073) sm90/sm100 with cuDNN 9.9 built in, from "
            "2.10 (#171627) the loaded cuDNN newer than 9.15, unless TORCH_CUDNN_SDPA_DEPRIORITIZED=1; the stand-in "
            "plays it per version (tests/stand_in_architecture.py prefers_cudnn), read from those pull requests and "
            "torch's main branch, not at the tags",
            "lesson 09's backends table: '(PyTorch's choice)' calls aten::_scaled_dot_product_cudnn_attention on an "
            "H100 or H200 with torch 2.10 or newer and cuDNN 9.16 or newer (as the 2026-11-28 H200 run did: torch "
            "2.11, cuDNN 9.19), the flash operator with an older cuDNN or TORCH_CUDNN_SDPA_DEPRIORITIZED=1"),
    GpuOnly("Lesson 09's fp16 attention check on a T4 (T4 only: none within the project's reach)",
            ("tolerance = dict(atol=3e-2, rtol=3e-2)",),
            "attention written out in fp16 (cuBLAS's fp16 GEMMs, a softmax of fp16 scores) against SDPA's "
            "memory-efficient kernel (CUTLASS fmha: fp32 accumulation and softmax, aten/src/ATen/native/transformers/"
            "cuda/mem_eff_attention); as a T4 the stand-in compares the CPU's own fp16 kernels instead",
            "lesson 09 on a T4: torch.testing.assert_close(manual, sdpa, atol=3e-2, rtol=3e-2) passes in fp16"),
    GpuOnly("Lesson 10 on a T4: fp16 autocast with a GradScaler trains as fp32 did (T4 only: none within reach)",
            ("scaler = torch.amp.GradScaler(device.type, enabled=",),
            "torch/amp/grad_scaler.py (scale, unscale_ with inf checks, skipped steps, update); fp16's range on the "
            "GPT's activations and gradients; the race keeps a step whose loss gap is within 0.05 nats or 2 % "
            "(gpulab/step_races.py same_training). The stand-in runs the scaler on the CPU's fp16 kernels",
            "lesson 10 full mode on a T4: the 'autocast float16' step and those raced after it (fp16 with its "
            "GradScaler) within the race's loss gap, none refused for its losses"),
    GpuOnly("TF32 and FP8 numerics on tensor cores",
            ("set_float32_matmul_precision", "_scaled_mm"),
            "torch/backends/cuda/__init__.py (matmul precision: cuBLAS TF32); torch._scaled_mm (FP8, compute "
            "capability 8.9 and newer: aten/src/ATen/native/cuda/Blas.cpp; the stand-in plays its refusal below "
            "sm_89 and its layout checks, and multiplies on the CPU where torch has a CPU kernel, from 2.14)",
            "lessons 04 and 10: the TF32 step's loss gap within tolerance; lesson 11: FP8 close to bf16 on an L4 or H100"),
    GpuOnly("fp16 flushing to zero the gradients backward carries, in a GPU's own casts and fp16 products",
            ("layer_gradients(torch.float16",),
            "c10/util/Half-inl.h (Half(float): __float2half on the GPU, PTX cvt.rn.f16.f32, rounds to nearest and keeps "
            "fp16's subnormals, as the CPU's fp16_ieee_from_fp32_value and float2half_scalar do); the fp16 GEMMs of "
            "backward write fp16 outputs rounded by cuBLAS, closed source: the GPU run confirms. This CPU flushes "
            "3 % of lesson 04's quick-mode gradients without scaling and none scaled by 2^16 (tests/test_lesson04.py)",
            "lesson 04 on a GPU: 'became zero' above 1 % without scaling and under a hundredth of that with it"),
    GpuOnly("Lesson 04's MFU of its full-mode MLP, a step the plan predicts is the GPU's work, not launches",
            ("flops.StepMFU.measure",),
            "gpulab/plans/plan04.py prices the step's matmuls at the card's rate and the rest (AdamW, LayerNorm, GELU, "
            "casts) from the H100's shipped step times; the stand-in cannot time a GPU",
            "lesson 04 full mode: each precision's MFU printed beside its dense datasheet peak, the bf16 step's "
            "well above the quick toy's thousandths of a percent; the plan's step times within a factor of 2"),
    GpuOnly("Lesson 02's naive input pipeline starving the card's GPU, at the workload its plan chose",
            ('"the naive pipeline starves the GPU"',),
            "gpulab/plans/plan02.py predicts the card's training step from its FLOPs at the card's fp32 rate (TF32 for "
            "cuDNN's convolutions, on by default from sm_80: aten/src/ATen/Context.h allow_tf32_cudnn = true, 2.6 to "
            "2.14) times the share the H100's shipped ResNet-50 step reached, and an augmented image's cost from the "
            "H100's and H200's runs; the stand-in times neither a GPU nor a real host's cores",
            "lesson 02 full mode on each card: 'With num_workers=0 it trained ... the GPU waited for its data most of "
            "the time', the data-on-device rate within a factor of 2 of the plan's; on a 2-vCPU T4 the tuned loader "
            "short of that rate and the data set on the device faster than it"),
    GpuOnly("Lesson 03's sweep past each model's knee, and its searches ending at the card's cap, at the sizes its "
            "plan chose",
            ("the sweep goes past", "set_per_process_memory_fraction(plan.cap_gb"),
            "gpulab/plans/plan03.py predicts a step as a fixed cost plus per-sample work (FLOPs at the card's rate, "
            "the rest at its bandwidth) read from the H100's shipped rows (gpulab/reference/03_throughput); past "
            "total_memory × fraction the caching allocator raises its out-of-memory error (torch/cuda/memory.py, "
            "set_per_process_memory_fraction, 2.6 to 2.14); the stand-in plays the cap as a budget of its tensors, "
            "without cuDNN's workspaces",
            "lesson 03 full mode on each card: each model's knee printed below the sweep's largest batch, the steps "
            "within a factor of 2 of the plan's; the searches' failed trials 'out of memory' at the cap, the batch "
            "found within a factor of 2 of the plan's fill, and the whole card free again after them; accumulation's "
            "micro-batches below the knee printed (k=8 against k=1 'slower', beyond noise)"),
    GpuOnly("Lessons 09-11 sized by their plans: the GPT's step times and memory on the card",
            ("step_races.Limits.of(", '"the naive step leaves most of the card unused"'),
            "gpulab/plans/gpt.py prices the GPT's step from its FLOPs at the card's rate times the share the H200's full "
            "first run reached (fp32, 2026-11-28) or an estimate (TF32, 16-bit, fused attention), written-out "
            "attention's scores at the 85 bytes each the H200's sweep moved, its launches from the operators counted "
            "on meta; its memory from lesson 11's activation predictor; the stand-in times no GPU",
            "lessons 09 and 10 full mode: the first run's and the waterfall's measured steps within a factor of 2 of "
            "the plan's; every step of 10 raced within plan.budget_s or refused in one line; on a T4 (none lent so "
            "far) fp16 autocast with its GradScaler, SDPA memory-efficient, the CUDA graphs step accumulating its "
            "micro-batches, MFU over the dense fp16 peak"),
    GpuOnly("Lesson 11's FP8 crossover where the card has FP8",
            ('"FP8 beats bf16 within the crossover\'s sizes"',),
            "gpulab/plans/plan11.py predicts fp8's three training matmuls at the card's fp8 rate plus the scaling at 6 "
            "bytes an element (an estimate; the 2026-11-27 H200 run, contended, found the crossover at n = 16384); "
            "torch._scaled_mm's kernels (aten/src/ATen/native/cuda/Blas.cpp) run on sm_89 and newer only",
            "lesson 11 full mode on an L4 or H100: fp8 faster than bf16 at the crossover's largest n, its errors "
            "against bf16 a few per cent"),
    GpuOnly("cuDNN's algorithm search",
            ("cudnn.benchmark",),
            "torch/backends/cudnn/__init__.py (benchmark): cuDNN times its algorithms at the first call of each shape",
            "lessons 03 and 06: the first step is slower, later ones faster"),
    GpuOnly("NCCL collectives across two GPUs or more",
            ('"nccl"',),
            "torch/distributed (the NCCL backend; gloo processes run the same scripts on the CPU here, and under the "
            "stand-in their GPU branches: tests/test_lesson07_gpu_path.py)",
            "lesson 07 on a machine with two GPUs or more (none lent so far: never run): the collectives' bus bandwidth "
            "near the plan's link (gpulab/plans/plan07.py gpu_link: NVLink on SXM boards, else PCIe), DDP's step "
            "within a factor of 2 of the scaling model's, DataParallel slower than DDP, FSDP's bytes measured"),
    GpuOnly("Lesson 07's one-GPU DDP step at the width its plan chose: the card's work, not the host's",
            ('"the GPU\'s step is the card\'s work"',),
            "gpulab/plans/plan07.py prices the WideMLP's FLOPs (flops.training_flops) at the card's fp32 rate (the "
            "scripts leave TF32 off, torch's default for matmuls, 2.6 to 2.14) against the 1.64 ms a step the 2026-11-28 "
            "H200's host took at width 512; the stand-in's children run on the CPU",
            "lesson 07 full mode on one GPU: 'Compute a step on cuda, width W: measured X ms; the plan predicted Y ms' "
            "with X within a factor of 2 of Y and at least twice 1.64 ms"),
)

# torch.cuda names that answer without a GPU, as the code uses them (no stand-in needed)
WITHOUT_A_GPU = {"is_available", "OutOfMemoryError", "amp", "nvtx.range", "profiler.start"}


def code_text() -> str:
    """The package's source, and the code cells of the lessons and solutions."""
    import nbformat

    parts = [p.read_text() for p in (ROOT / "gpulab").rglob("*.py")]
    for folder in ("notebooks", "solutions"):
        for path in sorted((ROOT / folder).glob("*.ipynb")):
            parts += [c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
    return "\n".join(parts)


@pytest.fixture(scope="module")
def code() -> str:
    return code_text()


@pytest.mark.parametrize("entry", SURFACE, ids=lambda e: e.behaviour[:40])
def test_every_entry_names_calls_the_code_still_makes(entry, code):
    missing = [call for call in entry.calls if call not in code]
    assert not missing, f"{entry.behaviour}: no code makes {missing} any more: update or remove the entry"


def test_every_torch_cuda_call_is_answered_by_the_stand_in_or_listed_as_gpu_only(code):
    listed = {call.removeprefix("torch.cuda.").rstrip("(") for entry in SURFACE for call in entry.calls}
    used = set(re.findall(r"torch\.cuda\.([A-Za-z_][\w.]*[A-Za-z_])", code))
    unlisted = sorted(name for name in used
                      if name.split(".")[0] not in answered() and name not in WITHOUT_A_GPU | listed)
    assert not unlisted, f"torch.cuda calls neither answered by tests/cuda_stand_in.py nor listed here: {unlisted}"


def test_the_readme_points_to_this_list():
    assert "tests/test_gpu_only_surface.py" in (ROOT / "README.md").read_text()


# Device checks that are not the question "does this work run on a GPU?", each with why it asks something else.
OTHER_QUESTIONS = {
    ("gpulab/flops.py", 'if device.type == "cpu":'): "where the tensors live: the CPU's own matmul kernel",
    ("gpulab/flops.py", 'if precision not in here and not (device.type == "cpu" and precision == "fp16"):'):
        "where the tensors live: fp16 matmuls a CPU emulates",
    ("gpulab/results.py", 'on_cpu = ~frame["device"].astype(str).str.startswith("cuda")'): "a column of shipped rows",
    ("gpulab/doctor.py", 'itself (``torch.cuda.is_available()``) is what doctor is for, so it is not the course\'s '
                         'choice of device'): "a docstring",
    ("gpulab/doctor.py", 'return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")'):
        "the machine's own CUDA runtime is what doctor examines",
    ("gpulab/doctor.py", "if not torch.backends.cudnn.is_available():"): "whether this torch bundles cuDNN",
    ("gpulab/__init__.py", "if not torch.cuda.is_available():"): "Kineto's own log, where CUDA finds no GPU",
    ("gpulab/commands/record.py", "if not torch.cuda.is_available():"):
        "shipped reference results come only from a real GPU, never a stand-in",
    ("gpulab/commands/verify.py", 'gpu = args.gpu or (torch.cuda.get_device_name(0) if torch.cuda.is_available() '
                                  'else H100)'): "the real GPU a verification plan is for",
    ("gpulab/questions/lesson04.py", "if torch.cuda.is_available():"): "its probe makes real CUDA tensors",
    ("notebooks/00_setup_and_diagnostics.ipynb", 'print("CUDA available:", torch.cuda.is_available())'):
        "the lesson shows what the CUDA runtime answers",
    ("notebooks/00_setup_and_diagnostics.ipynb", '"cuDNN": torch.backends.cudnn.version() if '
                                                 'torch.backends.cudnn.is_available() else "not available",'):
        "whether this torch bundles cuDNN",
    ("notebooks/00_setup_and_diagnostics.ipynb", 'other = device if device.type != "cpu" else torch.device("meta")'):
        "where the tensors live: a second device for the mismatch demo",
    ("notebooks/01_cuda_basics.ipynb", 'if device.type == "cpu":'): "where the tensors live: Triton's interpreter",
    ("notebooks/01_cuda_basics.ipynb", "elif not torch.cuda.is_available():"):
        "a CUDA runtime for nvcc's build to run on (the stand-in has none)",
}
# The checks' own simulated GPU (gpulab/questions/stand_in.py, observe.py): a learner's code is run on the meta
# device where there is no real GPU; these modules ask where a learner's tensors went, and whether a real GPU exists.
LEARNER_DEVICE_MODULES = {"gpulab/questions/stand_in.py", "gpulab/questions/observe.py", "gpulab/questions/lesson00.py",
                          "gpulab/questions/lesson01.py", "gpulab/questions/lesson02.py"}
DEVICE_CHECK = re.compile(r'\.type [!=]= "(cuda|cpu)"|is_available\(\)|startswith\("cuda"\)')


def device_checks() -> list[tuple[str, str]]:
    """(file, line) of every device check in the package but gpulab/device.py, and in the lessons and solutions."""
    import nbformat

    found = []
    for path in sorted((ROOT / "gpulab").rglob("*.py")):
        name = str(path.relative_to(ROOT))
        if name != "gpulab/device.py" and name not in LEARNER_DEVICE_MODULES:
            found += [(name, _code(line)) for line in path.read_text().splitlines() if DEVICE_CHECK.search(line)]
    for folder in ("notebooks", "solutions"):
        for path in sorted((ROOT / folder).glob("*.ipynb")):
            for c in nbformat.read(path, as_version=4).cells:
                if c.cell_type == "code":
                    found += [(f"{folder}/{path.name}", _code(line)) for line in c.source.splitlines()
                              if DEVICE_CHECK.search(line)]
    return found


def _code(line: str) -> str:
    """A line without its indentation and its comment."""
    return line.split("  #")[0].strip()


def test_the_package_and_the_lessons_ask_one_device_predicate():
    """A GPU branch asks gpulab.on_gpu (which the CUDA stand-in can switch), so that a test runs it on a CPU; any
    other device check asks another question, named above."""
    stray = [check for check in device_checks() if check not in OTHER_QUESTIONS]
    assert not stray, f"ask gpulab.on_gpu(device) instead, or name the other question in OTHER_QUESTIONS: {stray}"
    stale = set(OTHER_QUESTIONS) - set(device_checks())
    assert not stale, f"these device checks are gone: remove them from OTHER_QUESTIONS: {sorted(stale)}"
