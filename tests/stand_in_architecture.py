"""What torch answers on the architecture the CUDA stand-in plays (tests/cuda_stand_in.py), where cards differ: whether
bf16 is supported, which SDPA backend runs (or that none can; cuDNN first on an H100 or H200 where this torch and
its cuDNN put it first), whether FP8 matmuls (torch._scaled_mm) run, and how 16-bit products are summed (in fp32, as
tensor cores do: ``TensorCoreTracker``).

Each rule is torch's, cited beside it: the Python ones from torch/cuda/__init__.py of the 2.6.0 and 2.14.1 wheels, the
C++ ones from aten/src/ATen/native/transformers/cuda/sdp_utils.cpp and aten/src/ATen/native/cuda/Blas.cpp as torch's
main branch has them, with the words torch warns and raises read from the libtorch_cuda.so of the 2.6.0, 2.7.0 and
2.14.1 wheels. Only the choice is played: the kernels that run are the CPU's own (a profile shows
aten::_scaled_dot_product_flash_attention_for_cpu or the math backend's operators, never a GPU kernel's name). Not
played: SDPA's constraints on nested tensors, grouped-query head counts, strides and storage offsets, and cuDNN's
constraints that depend on its version (head dimensions over 128, dropout, short sequences).
"""

import os
import re
import warnings
from collections import Counter
from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._pytree import tree_map

from gpulab.memory import MemoryTracker

TORCH = tuple(int(part) for part in re.findall(r"\d+", torch.__version__)[:2])


def _as_of(table: dict):
    """The entry of the newest torch version in ``table`` at or below the installed one (the versions between those
    read take the older one's)."""
    return table[max((v for v in table if v <= TORCH), default=min(table))]


# The newest architecture each backend's range names, and how "cuDNN" is spelt, in each wheel read
NEWEST_SM = _as_of({(2, 6): (9, 0), (2, 7): (12, 0), (2, 14): (12, 1)})
CUDNN = _as_of({(2, 6): "CuDNN", (2, 14): "cuDNN"})


def is_bf16_supported(card):
    """``torch.cuda.is_bf16_supported`` as torch/cuda/__init__.py answers it (2.6.0 and 2.14.1 alike): True from
    compute capability 8.0; below it False with ``including_emulation=False``, else whether a bf16 tensor can be made on
    the device, which CUDA does on every card torch runs on (a T4 emulates bf16 arithmetic): True."""

    def answer(including_emulation: bool = True) -> bool:
        return (card.major, card.minor) >= (8, 0) or including_emulation

    return answer


# ---- scaled_dot_product_attention -----------------------------------------------------------------------------------

NAMES = {SDPBackend.FLASH_ATTENTION: "flash", SDPBackend.EFFICIENT_ATTENTION: "efficient",
         SDPBackend.CUDNN_ATTENTION: "cudnn", SDPBackend.MATH: "math"}
ENABLED = {"flash": torch.backends.cuda.flash_sdp_enabled, "efficient": torch.backends.cuda.mem_efficient_sdp_enabled,
           "cudnn": torch.backends.cuda.cudnn_sdp_enabled, "math": torch.backends.cuda.math_sdp_enabled}
# What the CPU runs for the card's choice: its math backend for math, else its own fused (flash) kernel where that
# kernel's constraints hold, math where not (aten/src/ATen/native/transformers/sdp_utils_cpp.cpp)
ON_THE_CPU = {"math": [SDPBackend.MATH], "flash": [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]}
ON_THE_CPU["efficient"] = ON_THE_CPU["cudnn"] = ON_THE_CPU["flash"]
# TypeMeta's and ScalarType's names, as torch's dtype messages print them
TYPE_META = {torch.float16: "c10::Half", torch.bfloat16: "c10::BFloat16", torch.float32: "float"}
SCALAR_TYPE = {torch.float16: "Half", torch.bfloat16: "BFloat16", torch.float32: "Float"}
SOURCE = " (Triggered internally at aten/src/ATen/native/transformers/cuda/sdp_utils.cpp, played by the CUDA stand-in.)"


@dataclass(frozen=True)
class Attention:
    """One SDPA call's inputs, as sdp_utils.cpp's ``sdp_params`` holds them (and ``torch.backends.cuda.SDPAParams``)."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attn_mask: torch.Tensor | None = None
    dropout: float = 0.0
    is_causal: bool = False
    cast_to: torch.dtype | None = None  # autocast's dtype, where it casts the inputs before the kernel is chosen

    @classmethod
    def of(cls, params) -> "Attention":
        return cls(params.query, params.key, params.value, params.attn_mask, params.dropout, params.is_causal)

    @classmethod
    def called(cls, query, key, value, attn_mask, dropout, is_causal) -> "Attention":
        """An SDPA call's inputs as its kernel gets them: under autocast, in autocast's dtype (SDPA is one of the
        operators autocast runs in lower precision, ATen/autocast_mode.h AT_FORALL_LOWER_PRECISION_FP; float64 is
        left alone). The stand-in's autocast is the CPU's (the lessons autocast on their device's type)."""
        device = query.device.type
        cast = query.is_floating_point() and query.dtype != torch.float64 and torch.is_autocast_enabled(device)
        return cls(query, key, value, attn_mask, dropout, is_causal,
                   torch.get_autocast_dtype(device) if cast else None)

    @property
    def dtypes(self) -> list[torch.dtype]:
        return [self.cast_to or t.dtype for t in (self.query, self.key, self.value)]

    @property
    def head_dims(self) -> tuple[int, int, int]:
        return self.query.size(-1), self.key.size(-1), self.value.size(-1)

    @property
    def requires_grad(self) -> bool:
        """sdp_utils_cpp.h input_requires_grad: an input requires grad and grad mode is on."""
        grads = any(t.requires_grad for t in (self.query, self.key, self.value))
        return grads and torch.is_grad_enabled()


def _sm(card) -> str:
    return f"Attempting to run on a sm {card.major}.{card.minor} gpu."


def _in_range(card, oldest: tuple[int, int]) -> bool:
    """sdp_utils.cpp check_sm_version<lower, upper>: the card's architecture in [oldest, the newest this torch lists]."""
    return oldest <= (card.major, card.minor) <= NEWEST_SM


def _newest() -> str:
    return "sm{}{}".format(*NEWEST_SM)


def _not_4d(p: Attention) -> str | None:
    """sdp_utils_cpp.h check_tensor_shapes: every fused kernel takes (batch, heads, sequence, head_dim)."""
    dims = [t.dim() for t in (p.query, p.key, p.value)]
    if dims == [4, 4, 4]:
        return None
    return ("All fused kernels requires query, key and value to be 4 dimensional, but got Query dim: {}, Key dim: {}, "
            "Value dim: {} instead.".format(*dims))


def _dtype(p: Attention, allowed: tuple) -> str | None:
    """sdp_utils_cpp.h check_tensor_dtype: query, key and value all of one allowed dtype."""
    dtypes = p.dtypes
    if len(set(dtypes)) == 1 and dtypes[0] in allowed:
        return None
    names = ", ".join(SCALAR_TYPE[d] for d in allowed)
    got = [TYPE_META.get(d, str(d).removeprefix("torch.")) for d in dtypes]
    return "Expected query, key and value to all be of dtype: {{{}}}. Got Query dtype: {}, Key dtype: {}, and Value " \
           "dtype: {} instead.".format(names, *got)


def _first(*reasons) -> str | None:
    """The first constraint that fails, in the order torch checks them (each a callable giving its reason or None)."""
    return next((reason for reason in (check() for check in reasons) if reason), None)


def flash_refusal(card, p: Attention) -> str | None:
    """Why flash attention cannot run this call on ``card`` (None: it can): sdp_utils.cpp can_use_flash_attention's
    general constraints in its order. Flash needs sm80 or newer (check_flash_attention_hardware_support): a T4
    (sm75) is refused."""
    low_precision = (torch.float16, torch.bfloat16) if card.major >= 8 else (torch.float16,)
    q, k, v = p.head_dims
    training_head_dim = (card.major, card.minor) in ((8, 6), (8, 7), (8, 8), (8, 9)) and p.requires_grad and (
        192 < q <= 224 or (q > 224 and p.dropout > 0))
    return _first(
        lambda: None if ENABLED["flash"]() else "Flash attention has been runtime disabled.",
        lambda: _not_4d(p),
        lambda: None if p.attn_mask is None else "Flash Attention does not support non-null attn_mask.",
        lambda: None if q == k == v and q <= 256 else (
            "Flash attention requires q,k,v to have the same last dimension and to be less than or equal to 256. Got "
            f"Query.size(-1): {q}, Key.size(-1): {k}, Value.size(-1): {v} instead."),
        lambda: None if _in_range(card, (8, 0)) else (
            f"Flash attention only supports gpu architectures in the range [sm80, {_newest()}]. {_sm(card)}"),
        lambda: None if not training_head_dim else (  # check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89
            "Flash attention currently doesn't support training with head_dim ∈ (192, 224] or (head_dim ∈ (224, 256] "
            "and dropout > 0.0) on gpu architectures in the range[sm86, sm89].Attempting to run with dropout set to: "
            f"{p.dropout}and head_dim: {q} on a sm {card.major}.{card.minor} gpu."),
        lambda: None if not (p.is_causal and p.query.size(-2) != p.key.size(-2)) else (
            "Flash attention does not support the is_causal flag when seqlen_q != seqlen_k. Got seqlen_q: "
            f"{p.query.size(-2)} seqlen_k: {p.key.size(-2)}. If you would like to use causal attention with non-square "
            "masks, please see CausalAttnMask."),
        lambda: _dtype(p, low_precision))


def efficient_refusal(card, p: Attention) -> str | None:
    """Why memory-efficient attention cannot run this call (None: it can): can_use_mem_efficient_attention's general
    constraints, then its dtypes. It runs from sm50 (a T4 too), in fp16 and fp32 before sm80, bf16 too from sm80; its
    head dimension a multiple of minimum_gemm_alignment (8 for fp16 and bf16 on tensor cores, 4 for fp32 from sm80, 1
    for fp32 before)."""
    half = p.dtypes[0] in (torch.float16, torch.bfloat16)
    tensor_cores = card.major >= 8 or (card.major == 7 and half)  # use_tensor_cores
    alignment = max(4 if card.major >= 8 else 1, (128 // (16 if half else 32)) if tensor_cores else 1)
    q, k, v = p.head_dims
    dtypes = (torch.float16, torch.float32, torch.bfloat16) if card.major >= 8 else (torch.float16, torch.float32)
    return _first(
        lambda: None if ENABLED["efficient"]() else "Memory Efficient attention has been runtime disabled.",
        lambda: None if _in_range(card, (5, 0)) else (
            f"Mem Efficient Attention only supports gpu architectures in the range [sm50, {_newest()}]. {_sm(card)}"),
        lambda: _not_4d(p),
        lambda: None if q == k and q % alignment == 0 and v % alignment == 0 and q > 0 and v > 0 else (
            f"Mem efficient attention requires last dimension of inputs to be divisible by {alignment}. Got "
            f"Query.size(-1): {q}, Key.size(-1): {k}, Value.size(-1): {v} instead."),
        lambda: _dtype(p, dtypes))


def cudnn_refusal(card, p: Attention) -> str | None:
    """Why cuDNN attention cannot run this call (None: it can): can_use_cudnn_attention's constraints that do not
    depend on the cuDNN version: fp16 or bf16, sm80 or newer (check_cudnn_hardware_support: a T4 is refused), a head
    dimension a multiple of 8. Its head-dimension limit (128, or 256 on Hopper and Blackwell with a recent cuDNN) is not
    played."""
    return _first(
        lambda: None if ENABLED["cudnn"]() else f"{CUDNN} attention has been runtime disabled.",
        lambda: _not_4d(p),
        lambda: _dtype(p, (torch.float16, torch.bfloat16) if card.major >= 8 else (torch.float16,)),
        lambda: None if _in_range(card, (8, 0)) else (
            f"cuDNN MHA only supports gpu architectures in the range [sm80, {_newest()}]. {_sm(card)}"),
        lambda: None if p.head_dims[0] % 8 == 0 and p.head_dims[2] % 8 == 0 else "head_dim should be a multiple of 8")


REFUSALS = {"flash": flash_refusal, "efficient": efficient_refusal, "cudnn": cudnn_refusal}


DEFAULT_ORDER = ["flash", "efficient", "math", "cudnn"]  # Context's sDPPriorityOrder until something sets it
CUDNN_FIRST = ["cudnn", "flash", "efficient", "math"]  # sdp_utils.cpp priority_order's cudnn_order


def _switch(name: str) -> bool | None:
    """c10::utils::check_env(name): True where the variable is "1", False where "0", else None."""
    return {"1": True, "0": False}.get(os.environ.get(name))


def _cudnn(loaded: bool = True) -> tuple[int, int, int]:
    """The cuDNN version torch loads (versionRuntimeCuDNN), or the one it was built with (CUDNN_VERSION); (0, 0, 0)
    for a torch without cuDNN."""
    if not torch.backends.cudnn.is_available():
        return (0, 0, 0)
    return torch._C._cudnn.getRuntimeVersion() if loaded else torch._C._cudnn.getCompileVersion()


def prefers_cudnn(card) -> bool:
    """sdp_utils.cpp check_prefer_cudnn_attention, which priority_order asks at the first SDPA call and, where it holds,
    writes cuDNN first into Context's order. Before 2.9 no version asks it (priority_order keeps the default). 2.9
    (pytorch/pytorch#162073): compute capability 9.0 or 10.0, a torch built with cuDNN 9.9 or newer, unless
    TORCH_CUDNN_SDPA_PREFERRED=0. 2.10 on (#171627, for #169849): the cuDNN loaded newer than 9.15.0, unless
    TORCH_CUDNN_SDPA_DEPRIORITIZED=1 (the H200's run of 2026-11-28, torch 2.11 with cuDNN 9.19, took cuDNN). Newer
    builds also take 10.3 (#170800) and, with CUDA 13, any 9.x or 10.x: no card the stand-in plays is one of those.
    The 2.9 and 2.10 rules are read from those pull requests and torch's main branch, not at the release tags."""
    if TORCH < (2, 9) or (card.major, card.minor) not in ((9, 0), (10, 0)):
        return False
    if TORCH < (2, 10):
        return _switch("TORCH_CUDNN_SDPA_PREFERRED") is not False and _cudnn(loaded=False) >= (9, 9, 0)
    return _switch("TORCH_CUDNN_SDPA_DEPRIORITIZED") is not True and _cudnn() > (9, 15, 0)


def priority(card) -> list[str]:
    """The order torch tries the backends in on ``card``: Context's sDPPriorityOrder (flash, memory-efficient, math,
    cuDNN unless ``sdpa_kernel(..., set_priority=True)`` set another), with cuDNN first where torch prefers it there
    (``prefers_cudnn``) and the order is still the default."""
    by_value = {backend.value: name for backend, name in NAMES.items()}
    order = [by_value[value] for value in torch._C._get_sdp_priority_order() if value in by_value]
    return CUDNN_FIRST if order == DEFAULT_ORDER and prefers_cudnn(card) else order


def _warn(text: str) -> None:
    warnings.warn(text + SOURCE, UserWarning, stacklevel=4)


def choose(card, p: Attention) -> str:
    """The backend ``card`` runs this call in (sdp_utils.cpp select_sdp_backend): the first in priority order that is
    enabled and whose constraints hold. Where none can, torch warns why each fused backend was not used and raises."""
    if not any(enabled() for enabled in ENABLED.values()):  # attention.cpp, after select_sdp_backend's error
        raise RuntimeError("No viable backend for scaled_dot_product_attention was found. This is likely due to "
                           "turning off both the math kernel and the fused kernels.")
    for backend in priority(card):
        if (ENABLED["math"]() if backend == "math" else REFUSALS[backend](card, p) is None):
            return backend
    for title, backend in (("Memory efficient kernel not used because:", "efficient"),
                           ("Flash attention kernel not used because:", "flash"),
                           (f"{CUDNN} attention kernel not used because:", "cudnn")):
        _warn(title)
        _warn(REFUSALS[backend](card, p))
    raise RuntimeError("No available kernel. Aborting execution.")


def attention(real, card, chosen: Counter):
    """``F.scaled_dot_product_attention`` on ``card``: the card's choice made (or refused, as torch refuses it), then
    run by the CPU (``ON_THE_CPU``), the choice counted in ``chosen``. Under torch.compile the call is traced as it is
    (one operator in the graph, as on a GPU): what the compiled code runs is the CPU's choice, unchecked."""

    def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                     enable_gqa=False):
        if not torch.compiler.is_compiling():
            backend = choose(card, Attention.called(query, key, value, attn_mask, dropout_p, is_causal))
            chosen[backend] += 1
            with sdpa_kernel(ON_THE_CPU[backend]):
                return real(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        return real(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)

    return scaled_dot_product_attention


def can_use(backend: str, card):
    """``torch.backends.cuda.can_use_<backend>_attention(params, debug=False)`` on ``card``: whether its constraints hold;
    with ``debug``, a warning says which did not."""

    def check(params, debug: bool = False) -> bool:
        reason = REFUSALS[backend](card, Attention.of(params))
        if reason and debug:
            warnings.warn(reason + SOURCE, UserWarning, stacklevel=2)
        return reason is None

    return check


# ---- FP8 matmuls ----------------------------------------------------------------------------------------------------

def has_fp8(card) -> bool:
    """Blas.cpp _scaled_mm_allowed_device: compute capability 9.0 or newer, or 8.9 (Ada): not an A100 (8.0) or a T4."""
    return card.major >= 9 or (card.major, card.minor) == (8, 9)


def _on_meta(value):
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.size(), value.stride(), dtype=value.dtype, device="meta")
    return value


def scaled_mm(real, card, gpu_only):
    """``torch._scaled_mm`` on ``card``. Below sm_89 it raises what Blas.cpp's _scaled_mm_out_cuda raises first (its
    words the same in 2.6.0, 2.7.0 and 2.14.1). Where the card has FP8, the GPU's layout checks (a row-major first
    operand, a column-major second, sizes multiples of 16) are torch's own, those of its meta function for a CUDA
    tensor (torch/_meta_registrations.py), then the CPU multiplies where this torch has a CPU kernel (2.14.1 has one;
    2.6.0 and 2.7.0 do not: ``gpu_only`` is raised there)."""

    def _scaled_mm(mat1, mat2, *args, **kwargs):
        if not has_fp8(card):
            raise RuntimeError("torch._scaled_mm is only supported on CUDA devices with compute capability >= 9.0 or "
                               "8.9, or ROCm MI300+")
        if torch.compiler.is_compiling():
            return real(mat1, mat2, *args, **kwargs)
        real(*map(_on_meta, (mat1, mat2, *args)), **{name: _on_meta(v) for name, v in kwargs.items()})
        try:
            return real(mat1, mat2, *args, **kwargs)
        except NotImplementedError:
            raise gpu_only(f"torch._scaled_mm on the CPU (torch {torch.__version__} has no CPU kernel for it)") from None

    return _scaled_mm


# ---------------------------------------------------------------- 16-bit arithmetic, as tensor cores do it

aten = torch.ops.aten
# The products and convolutions (forward and backward) that a card runs on its tensor cores in fp16 or bf16: what
# linear layers, matmuls, attention's math and convolutions reach below autograd
TENSOR_CORE_OPS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
                   aten.convolution.default, aten.convolution_backward.default}
WRITING_INTO = {aten.mm.out, aten.addmm.out, aten.bmm.out, aten.baddbmm.out}  # torch.mm(a, b, out=c) and kin
SIXTEEN_BIT = (torch.float16, torch.bfloat16)


def as_tensor_cores(func, args, kwargs):
    """``func(*args, **kwargs)``, with fp16 and bf16 products and convolutions computed as a card's tensor cores compute
    them: the 16-bit inputs' products summed in fp32, the result rounded once to the 16-bit type (cuBLAS's and cuDNN's
    default compute type for 16-bit data: CUBLAS_COMPUTE_32F). A CPU without fp16 arithmetic (no AVX512-FP16 or
    AMX-FP16) runs its own fp16 kernels about a hundred times slower than fp32 (a 1024² product on one core: 2.1 s
    against 0.028 s), which made a lesson played as a T4 spend minutes in a matmul sweep a T4 runs in milliseconds."""
    dtype = next((a.dtype for a in args if isinstance(a, torch.Tensor)), None)
    if dtype not in SIXTEEN_BIT or func not in TENSOR_CORE_OPS and func not in WRITING_INTO:
        return func(*args, **kwargs)
    if func in WRITING_INTO:
        kept = {k: v for k, v in kwargs.items() if k != "out"}
        return kwargs["out"].copy_(as_tensor_cores(func.overloadpacket.default, args, kept))
    widened = tree_map(lambda t: t.float() if isinstance(t, torch.Tensor) and t.dtype == dtype else t, (args, kwargs))
    out = func(*widened[0], **widened[1])
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) else t, out)


class TensorCoreTracker(MemoryTracker):
    """The stand-in's allocator statistics and its tensor cores in one dispatch mode (a Python call per operator, not
    two): ``as_tensor_cores`` computes, and the tracker counts the 16-bit results the card would hold, never the fp32
    working copies made on the way."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self._counted(func, as_tensor_cores(func, args, kwargs or {}))
