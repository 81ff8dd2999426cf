"""Lesson 09, MFU and attention kernels: the FLOPs per token of a GPT, the MFU of a measured step against the right
peak (the card's dense datasheet peak of the precision it ran in), and which attention backend a profile proves ran.

None of these checks times the learner's code: each compares what the learner's function returns with what torch
itself says (FlopCounterMode, the profiler under a forced backend), computed after the learner's function has
returned."""

import functools
import math
import numbers
import random
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import profile

from .. import datasheets, flops, text
from ..busy import activities
from ..check import Question, Wrong
from ..device import device_info, get_device, on_gpu, sync
from .on_paper import TensorOperations

# ----- q1: FLOPs per token of a GPT --------------------------------------------------------------------------------

# (n_layer, n_head, n_embd, seq_len, vocab_size): GPT-2 small; a long context on a small model (attention dominates);
# a tiny model with a padded vocabulary.
_CONFIGS = [(12, 12, 768, 1024, 50304), (4, 4, 256, 2048, 257), (2, 4, 128, 256, 320)]
TOLERANCE = 0.02  # the 6·N + 12·L·d·T rule, with N counted right, is within 2 % of the count for these models


@functools.lru_cache(maxsize=64)
def counted_flops_per_token(n_layer, n_head, n_embd, seq_len, vocab_size) -> float:
    """FlopCounterMode's count of a training step (forward and backward) of the lesson's GPT, per token: the model
    built on the meta device (no memory, no arithmetic), attention by the math backend (the model's FLOPs)."""
    cfg = text.GPTConfig(vocab_size=vocab_size, seq_len=seq_len, n_layer=n_layer, n_head=n_head, n_embd=n_embd,
                         attention="sdpa")
    with torch.device("meta"):
        model = text.GPT(cfg)
    idx = torch.zeros(1, seq_len, dtype=torch.long, device="meta")
    with sdpa_kernel(SDPBackend.MATH):
        return flops.training_flops(model, idx, idx).total / seq_len


def _params(n_layer, n_embd, vocab_size, seq_len=0) -> int:
    """The GPT's parameters (the head tied to the token embedding), plus the position embedding's when seq_len > 0."""
    per_block = 12 * n_embd**2 + 13 * n_embd  # q/k/v, projection and MLP weights and biases; two LayerNorms
    return n_layer * per_block + 2 * n_embd + vocab_size * n_embd + seq_len * n_embd


def _mistakes(n_layer, n_head, n_embd, seq_len, vocab_size) -> dict[str, float]:
    """Per-token FLOPs that plausible mistakes give, and what each gets wrong."""
    n = _params(n_layer, n_embd, vocab_size)
    attention = 12 * n_layer * n_embd * seq_len
    return {
        "6·N alone leaves out attention's scores and weighted sum: add 12·L·d·T per token": 6 * n,
        "that counts the forward pass only: training runs every matmul three times (forward, the inputs' gradients, "
        "the weights' gradients)": 2 * n + attention / 3,
        "that halves attention for the causal mask; the count (like PaLM's rule and FlopCounterMode) takes all T "
        "positions": 6 * n + attention / 2,
        "N includes the position embedding, which is a lookup, not a matmul: leave it out": 6 * (n + seq_len * n_embd)
        + attention,
        "the head is tied to the token embedding: its weights are the embedding's, counted once (and they are a "
        "matmul: leave them in)": 6 * (n + vocab_size * n_embd) + attention,
        "the head's matmul is missing: the tied embedding is used as the output layer, 2·d·V per token forward":
        6 * (n - vocab_size * n_embd) + attention,
        "the attention term is 12·L·d·T: heads split d, they do not multiply it": 6 * n + attention * n_head,
    }


def _check_flops_per_token(flops_per_token) -> str:
    if not callable(flops_per_token):
        raise Wrong("pass your function itself: `q1.check(flops_per_token)`")
    rng = random.Random()
    heads = rng.choice([4, 6, 8])
    configs = _CONFIGS + [(rng.randint(2, 6), heads, heads * rng.choice([32, 48, 64]), rng.choice([512, 1024, 4096]),
                           rng.choice([257, 320, 1024]))]  # and one drawn at random each time
    for cfg in configs:
        with TensorOperations() as operations:
            got = flops_per_token(*cfg)
        call = "flops_per_token(n_layer={}, n_head={}, n_embd={}, seq_len={}, vocab_size={})".format(*cfg)
        if operations.ran:
            raise Wrong(f"{call} ran {operations.ran} tensor operations: work it out on paper, from the configuration "
                        "(no model, no FlopCounterMode: the check compares your formula with FlopCounterMode's count)")
        if isinstance(got, bool) or not isinstance(got, (numbers.Real, torch.Tensor)) or (
                isinstance(got, torch.Tensor) and got.numel() != 1):
            raise Wrong(f"{call} returned {got!r:.80}: return a number of FLOPs")
        got = float(got)
        expected = counted_flops_per_token(*cfg)
        if abs(got - expected) <= TOLERANCE * expected:
            continue
        hint = next((why for why, value in _mistakes(*cfg).items() if abs(got - value) <= 0.005 * value), "")
        if not hint and math.isclose(got, expected * cfg[3], rel_tol=TOLERANCE):
            hint = "that is per sequence: divide by the seq_len tokens"
        raise Wrong(f"{call} = {got:.4g}; FlopCounterMode counts {expected:.4g} FLOPs per token of a training step"
                    + (f": {hint}." if hint else "."))
    cfg = configs[0]
    return (f"within {TOLERANCE:.0%} of FlopCounterMode on {len(configs)} configurations; GPT-2 small at T = {cfg[3]} "
            f"trains at {counted_flops_per_token(*cfg) / 1e9:.3g} GFLOP per token.")


# ----- q2: the MFU of a measured step ---------------------------------------------------------------------------------

# (flops per step, seconds per step, autocast dtype, TF32 switch, card): each divided by that card's dense datasheet
# peak of the precision the step ran in. A bf16 step with TF32 on (bf16's peak, not TF32's), fp32 steps with TF32 on
# and off, an fp16 step on a T4, an fp32 step on a T4 with the TF32 switch on (a T4 has no TF32), a bf16 step on an L4.
_STEPS = [
    (3.0e14, 0.9, torch.bfloat16, True, "H100 SXM"),
    (3.0e14, 2.1, None, True, "H100 SXM"),
    (3.0e14, 40.0, None, False, "A100 SXM 80GB"),
    (1.2e13, 0.6, torch.float16, False, "T4"),
    (1.2e13, 4.0, None, True, "T4"),
    (1.2e13, 0.3, torch.bfloat16, True, "L4"),
]


def _precision(autocast_dtype, tf32: bool, peaks: dict) -> str:
    if autocast_dtype is not None and autocast_dtype != torch.float32:
        return {torch.bfloat16: "bf16", torch.float16: "fp16"}[autocast_dtype]
    return "tf32" if tf32 and "tf32" in peaks else "fp32"


def expected_mfu(flops_per_step, seconds_per_step, autocast_dtype, tf32, peaks_tflops) -> float:
    """The step's model FLOP/s over the card's dense peak of the precision its matmuls ran in."""
    precision = _precision(autocast_dtype, tf32, peaks_tflops)
    return flops_per_step / seconds_per_step / (peaks_tflops[precision] * 1e12)


def _mfu_hint(got: float, case, card: str) -> str:
    flops_per_step, seconds, autocast_dtype, tf32, peaks = case
    achieved = flops_per_step / seconds / 1e12
    right, precision = expected_mfu(*case), _precision(autocast_dtype, tf32, peaks)
    if math.isclose(got, 100 * right, rel_tol=1e-3):
        return "That is a percentage: return a fraction (0.41, not 41)."
    if math.isclose(got, right * 1e12, rel_tol=1e-3):
        return "The peaks are in TFLOP/s: multiply by 1e12 before dividing FLOP/s by them."
    sparse = ("a 'with sparsity' figure, twice the dense one (for 2:4 sparse matrices training does not use): MFU "
              "divides by the dense peak")
    for name, tflops in peaks.items():
        if name != precision and math.isclose(got, achieved / tflops, rel_tol=1e-3):
            if autocast_dtype is not None and name == "tf32":
                said = (f"That divides by the TF32 peak: under autocast the matmuls run in {precision}, whatever the "
                        "TF32 switch says (torchtitan #668).")
            elif name == max(peaks, key=peaks.get):
                said = "That divides by the fastest peak of all: divide by the peak of the precision the step ran in."
            else:
                said = f"That divides by the {name} peak; this step's matmuls ran in {precision}."
            twice = math.isclose(tflops, 2 * peaks[precision], rel_tol=1e-3)
            return said + (f" (Or by {sparse}: the two read the same here.)" if twice else "")
    if math.isclose(got, right / 2, rel_tol=1e-3):
        return f"That divides by {sparse}."
    for sheet in datasheets.SHEETS.values():
        other = sheet.tflops.get(precision)
        if sheet.name != card and other and other != peaks[precision] and math.isclose(got, achieved / other, rel_tol=1e-3):
            return (f"That divides by the {sheet.name}'s {precision} peak, another card's (nanoGPT's 104 % divided an "
                    f"H100 run by the A100's peak): divide by the peaks of the card the step ran on, the dict passed in.")
    return ""


def _device_peaks() -> dict:
    """The dense datasheet peaks of this machine's GPU ({} for a CPU or a card gpulab.datasheets does not list)."""
    device = get_device()
    sheet = datasheets.find(device_info(device).name) if on_gpu(device) else None
    return dict(sheet.tflops) if sheet else {}


def _peaks_of_this_card(peaks_tflops) -> dict:
    """The learner's own step's peaks as numbers, checked against this card's datasheet; Wrong where they are not."""
    if not isinstance(peaks_tflops, dict):
        raise Wrong("pass this card's dense peaks as a dict of TFLOP/s, e.g. dict(gpulab.datasheets.find(name).tflops) "
                    "({} where the device has none)")
    for p, value in peaks_tflops.items():
        if isinstance(value, bool) or not isinstance(value, (numbers.Real, flops.Ceiling)) or not float(value) > 0:
            raise Wrong(f"peaks_tflops[{p!r}] is {value!r:.60}: the peaks are positive numbers of TFLOP/s")
    if any(isinstance(v, flops.Ceiling) for v in peaks_tflops.values()):
        raise Wrong("those are measured ceilings (flops.Ceiling): MFU divides by the vendor's dense datasheet peak; "
                    "the measured ceiling goes beside it, as 'of achievable'")
    given, sheet = {p: float(v) for p, v in peaks_tflops.items()}, _device_peaks()
    if given != sheet:
        if sheet and all(math.isclose(given.get(p, 0.0), 2 * t) for p, t in sheet.items() if p != "fp32"):
            raise Wrong("those are 'with sparsity' figures, twice the dense ones: pass this card's dense peaks")
        raise Wrong(f"those are not this card's dense datasheet peaks ({sheet or 'none: no datasheet lists this device'}): "
                    "MFU divides by the peak of the card the step ran on, from gpulab.datasheets")
    return given


def _check_mfu(step_mfu, flops_per_step=None, seconds_per_step=None, peaks_tflops=None) -> str:
    if not callable(step_mfu):
        raise Wrong("pass your function itself: `q2.check(step_mfu, flops_per_step, seconds_per_step, peaks_tflops)`")
    cases = [(f, s, dtype, tf32, dict(datasheets.SHEETS[card].tflops), card) for f, s, dtype, tf32, card in _STEPS]
    mine = _peaks_of_this_card(peaks_tflops) if flops_per_step is not None else {}
    if mine:  # the learner's own measured step, in fp32 with TF32 as it was set, on this card
        cases.append((float(flops_per_step), float(seconds_per_step), None, flops.tf32_enabled(), mine, "this card"))
    for *case, card in cases:
        flops_step, seconds, autocast_dtype, tf32, peaks = case
        dtype = str(autocast_dtype).removeprefix("torch.") if autocast_dtype is not None else None
        call = f"step_mfu({flops_step:.3g}, {seconds:.3g}, {dtype}, tf32={tf32}, <the {card}'s peaks>)"
        try:
            got = step_mfu(flops_step, seconds, autocast_dtype, tf32, dict(peaks))
        except KeyError as missing:
            if missing.args and missing.args[0] in flops.PRECISIONS and missing.args[0] not in peaks:
                raise Wrong(f"{call} looked up a {missing.args[0]!r} peak the {card} does not have: a GPU without TF32 "
                            "(before Ampere, as a T4) runs fp32 matmuls in fp32 whatever the TF32 switch says") from None
            raise
        if isinstance(got, bool) or not isinstance(got, (numbers.Real, torch.Tensor)):
            raise Wrong(f"{call} returned {got!r:.60}: return the MFU as a fraction")
        got, right = float(got), expected_mfu(*case)
        if not math.isclose(got, right, rel_tol=1e-3):
            raise Wrong(f"{call} = {got:.4g}; the MFU is {right:.4g}. " + _mfu_hint(got, case, card))
    if not mine:
        return ("right on every hand-made step. This device has no vendor's datasheet peak (no GPU, or one "
                "gpulab.datasheets does not list): your own step has no MFU here, only 'of achievable'.")
    return (f"right on the hand-made steps and on yours: {expected_mfu(*cases[-1][:5]):.2%} of this card's dense "
            f"{_precision(*cases[-1][2:5])} peak.")


# ----- q3: which attention backend ran ---------------------------------------------------------------------------------

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}

# Names from profiles of one forward and backward of F.scaled_dot_product_attention under each forced backend: the
# operators and, on a GPU, the kernels (shortened where they run long).
_GPU_PROFILES = {
    "flash": ["aten::scaled_dot_product_attention", "aten::_scaled_dot_product_flash_attention",
              "aten::_flash_attention_forward",
              "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, "
              "cutlass::bfloat16_t>, false, true, false, false, true, true, false, false>(pytorch_flash::Flash_fwd_params)",
              "aten::_scaled_dot_product_flash_attention_backward", "aten::_flash_attention_backward",
              "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<64, 128, 128, 8>>"
              "(pytorch_flash::Flash_bwd_params)", "void pytorch_flash::flash_bwd_convert_dq_kernel<...>"],
    "efficient": ["aten::scaled_dot_product_attention", "aten::_scaled_dot_product_efficient_attention",
                  "aten::_efficient_attention_forward",
                  "fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::bfloat16_t, "
                  "cutlass::arch::Sm80, true, 64, 64, 64, true, true>::Params)",
                  "aten::_scaled_dot_product_efficient_attention_backward", "aten::_efficient_attention_backward",
                  "fmha_cutlassB_bf16_aligned_64x64_k64_sm80(PyTorchMemEffAttention::AttentionBackwardKernel<...>::Params)"],
    "cudnn": ["aten::scaled_dot_product_attention", "aten::_scaled_dot_product_cudnn_attention",
              "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_kernel0_0",
              "aten::_scaled_dot_product_cudnn_attention_backward",
              "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_5_64x128x128_4x2x1_kernel0_0"],
    "math": ["aten::scaled_dot_product_attention", "aten::_scaled_dot_product_attention_math", "aten::matmul",
             "aten::bmm", "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_"
             "segment_k_off_kernel__5x_cublas", "aten::_safe_softmax", "aten::_softmax",
             "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, c10::BFloat16, float, c10::BFloat16>",
             "aten::_softmax_backward_data", "aten::masked_fill"],
}
_CPU_PROFILES = {
    "flash": ["aten::scaled_dot_product_attention", "aten::_scaled_dot_product_flash_attention_for_cpu",
              "aten::empty_like", "aten::_scaled_dot_product_flash_attention_for_cpu_backward", "aten::zeros"],
    "math": ["aten::scaled_dot_product_attention", "aten::_scaled_dot_product_attention_math", "aten::matmul",
             "aten::bmm", "aten::_safe_softmax", "aten::softmax", "aten::_softmax", "aten::_softmax_backward_data"],
}


def profile_names(backend: str | None, device=None, dtype=None) -> list[str] | None:
    """The operator (and kernel) names of a profile of one forward and backward of ``F.scaled_dot_product_attention``
    on ``device``, under ``backend`` forced with ``sdpa_kernel`` (None: PyTorch's choice); None where that backend
    cannot run here."""
    device = get_device(device)
    if dtype is None:  # flash and cuDNN attention need 16-bit inputs; bf16 where the GPU has it natively
        dtype = torch.float32 if not on_gpu(device) else (
            torch.bfloat16 if torch.cuda.get_device_capability(device) >= (8, 0) else torch.float16)
    q, k, v = (torch.randn(2, 4, 128, 64, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Flash attention kernel not used because ...": the reason, as a warning
            with sdpa_kernel(BACKENDS[backend]) if backend else _nothing(), profile(activities=activities(device)) as prof:
                F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
                sync(device)
    except RuntimeError:
        return None
    return list(dict.fromkeys(e.name for e in prof.events()))


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_OPERATORS = {"flash_attention": "flash", "efficient_attention": "efficient", "cudnn_attention": "cudnn",
              "attention_math": "math"}


def backend_that_ran(names: list[str]) -> str | None:
    """The backend a profile's attention ran in: the operator ``scaled_dot_product_attention`` dispatched to (None
    when the profile holds none). The check's reference, applied only once the learner's function has answered."""
    for name in names:
        if name.startswith("aten::_scaled_dot_product_"):
            operator = name.removeprefix("aten::_scaled_dot_product_").removesuffix("_backward")
            operator = operator.removesuffix("_for_cpu").removesuffix("_for_mps")
            if operator in _OPERATORS:
                return _OPERATORS[operator]
    return None


def _machine_profiles() -> list[list[str]]:
    """Profiles taken now, on this machine, with each backend that runs here forced."""
    return [names for names in map(profile_names, BACKENDS) if names is not None]


def _check_backend(attention_backend) -> str:
    if not callable(attention_backend):
        raise Wrong("pass your function itself: `q4.check(attention_backend)`")
    profiles = [("a GPU profile", names) for names in _GPU_PROFILES.values()]
    profiles += [("a CPU profile", names) for names in _CPU_PROFILES.values()]
    profiles += [("your machine's profile", names) for names in _machine_profiles()]
    for where, names in profiles:  # no label in reach of the learner's function: the answer is worked out after it
        got = attention_backend(list(names))
        ran = backend_that_ran(names)
        if got != ran:
            hint = {
                "cudnn": " cuDNN's attention kernels have 'flash' in their names too (…sdpa_sm90_flash_fprop…): look for "
                         "the cuDNN operator or kernel first." if got == "flash" else
                         " Its operator is _scaled_dot_product_cudnn_attention, its kernels cudnn…sdpa….",
                "efficient": " Memory-efficient attention's operator is _scaled_dot_product_efficient_attention, its "
                             "kernels CUTLASS's fmha_cutlassF/B.",
                "flash": " Flash attention's operator is _scaled_dot_product_flash_attention (…_for_cpu on a CPU), its "
                         "kernels pytorch_flash's.",
                "math": " Every profile holds aten::scaled_dot_product_attention, whichever backend ran: the backend "
                        "is the operator it called (_scaled_dot_product_attention_math: the math backend).",
            }[ran]
            raise Wrong(f"for {where} under the {ran} backend your function says {got!r}; the backend that ran is "
                        f"{ran!r}.{hint}")
    here = [b for b in BACKENDS if b in {backend_that_ran(n) for w, n in profiles if w.startswith("your")}]
    return f"right on GPU and CPU profiles of every backend, and on your machine's ({', '.join(here)})."


# ----- the questions ------------------------------------------------------------------------------------------------

q1 = Question(
    lesson="09", number=1, title="FLOPs per token of a GPT", checker=_check_flops_per_token,
    hint_text="Count the matmul weights: per block 3·d² (q, k, v), d² (projection) and 2·4·d² (the MLP), and the head "
              "d·V (tied to the embedding: counted once). A training step costs 6 FLOPs per weight per token (2 "
              "forward, 4 backward). Attention's two matmuls over T positions add 4·T·d per layer forward, 12·L·T·d for "
              "training. The 6·N + 12·L·d·T rule, with N all parameters except the position embedding, is close enough.",
    solution_text="""
def flops_per_token(n_layer, n_head, n_embd, seq_len, vocab_size):
    weights = n_layer * 12 * n_embd**2 + n_embd * vocab_size   # q/k/v, projection, MLP; the (tied) head
    attention = 4 * n_layer * seq_len * n_embd                 # scores and weighted sum, forward
    return 3 * (2 * weights + attention)                       # forward + backward = 3 × forward
""",
)

q2 = Question(
    lesson="09", number=2, title="MFU against the right peak", checker=_check_mfu,
    hint_text="MFU divides by the card's dense datasheet peak of the precision the step's matmuls ran in. Under "
              "autocast they run in its dtype (bf16 or fp16), whatever the TF32 switch says; without autocast in TF32 "
              "when the switch is on and the card has TF32 (its peaks have a 'tf32' entry), else in fp32. MFU = "
              "flops_per_step / seconds_per_step / (that peak × 1e12), a fraction.",
    solution_text="""
def step_mfu(flops_per_step, seconds_per_step, autocast_dtype, tf32, peaks_tflops):
    if autocast_dtype == torch.bfloat16:
        precision = "bf16"
    elif autocast_dtype == torch.float16:
        precision = "fp16"
    else:
        precision = "tf32" if tf32 and "tf32" in peaks_tflops else "fp32"
    return flops_per_step / seconds_per_step / (peaks_tflops[precision] * 1e12)
""",
)

q3 = Question(
    lesson="09", number=3, title="prove which attention backend ran", checker=_check_backend,
    hint_text="Every profile has aten::scaled_dot_product_attention; what tells the backends apart is what it called: "
              "an operator with 'cudnn_attention' or a cudnn…sdpa kernel (check it first: its kernels say 'flash' too), "
              "'flash_attention' or pytorch_flash kernels, 'efficient_attention' or fmha_cutlass kernels, else "
              "_scaled_dot_product_attention_math (bmm and softmax).",
    solution_text="""
def attention_backend(names):
    joined = " ".join(names).lower()
    if "cudnn_attention" in joined or ("cudnn" in joined and "sdpa" in joined):
        return "cudnn"
    if "flash_attention" in joined or "pytorch_flash" in joined:
        return "flash"
    if "efficient_attention" in joined or "fmha_cutlass" in joined:
        return "efficient"
    return "math"
""",
)
