"""Training steps raced side by side (lessons 10 and 11), and the waterfall of lesson 10.

``race`` trains two fresh runs of a lesson's training step, from the same weights on the same batches, one optimizer
step each in turn (``gpulab.compare`` with ``number=1``: a first step timed apart, which holds compilation, then
interleaved pairs); it measures the memory one more step of each allocates, and how far their training losses lie
apart, step by step (the **loss gap**: both sides see the same batches, so the losses differ only by the
configuration's arithmetic). ``Meter`` gives a configuration's MFU over the dense peak of the precision it runs in,
"of achievable" over that precision's measured ceiling, HFU from what its kernels run, and its model FLOP/s over one
reference peak for a path that changes precision. ``Waterfall`` is ``racing.Path`` with those rows: kept when faster
beyond the noise and training the same, each row logged as its verdict is given, then shown as a table and figures;
within ``Limits`` (a ``racing.Budget`` for its races and the head-to-head, each race planned before it starts from the
step times measured so far; and the card's memory, against each configuration's predicted need).

The training step itself is the lesson's: ``run_steps(options)``, a generator that trains a fresh model with those
options and yields ``(model, loss)`` after each optimizer step. This module only times, compares and records.
"""

import functools
import gc
import math
import os
import statistics
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import matplotlib.pyplot as plt
import pandas as pd
import torch

from . import flops, plots, racing, text
from .comparison import Comparison, compare
from .device import device_info, get_device, on_gpu
from .memory import peak_bytes
from .plans import plan10
from .results import ResultLog

GAP_NATS, GAP_SHARE = 0.05, 0.02  # a candidate trains the same when its loss gap is within 0.05 nats or 2 %


@dataclass
class Race:
    """Two configurations trained side by side: the candidate's speed-up (``comparison``), the largest difference of
    their training losses step by step (``loss_gap``, nats), each run's loss at its last step, the MiB one more step
    of each allocates, and each run's ``one_step`` (to go on training it; emptied once a path has judged it)."""

    comparison: Comparison
    loss_gap: float
    losses: tuple  # (current, candidate)
    peaks: tuple  # (current, candidate)
    steps: tuple  # (current, candidate)


def session(run_steps, options: dict):
    """``one_step()`` trains the next step of a fresh run of ``run_steps(options)``; ``trained`` keeps its model and
    every step's training loss (a tensor on the device: no wait for the GPU)."""
    run, trained = run_steps(options), {"losses": []}

    def one_step():
        trained["model"], loss = next(run)
        trained["losses"].append(loss)
    return one_step, trained


def graph_pool_bytes(device=None) -> int:
    """Bytes held by CUDA graphs' private memory pools: the allocator's segments outside its default pool (0, 0), in
    ``torch.cuda.memory_snapshot()`` (``segment_pool_id``); 0 on a CPU."""
    if not on_gpu(get_device(device)):
        return 0
    return sum(s["total_size"] for s in torch.cuda.memory_snapshot() if tuple(s["segment_pool_id"]) != (0, 0))


def step_peak_mib(one_step, options: dict, pools_before: int, device=None) -> float:
    """The most memory one more step allocates above what the run already holds (weights, gradients, optimizer
    state). With CUDA graphs a replayed step allocates almost nothing: its activations live in the pool the graphs
    were recorded in, so the bytes the pools grew by since ``pools_before`` count too. NaN for a compiled step on a
    CPU, whose tracker (a dispatch mode) compiled code does not run under."""
    device = get_device(device)
    gc.collect()
    if on_gpu(device):
        torch.cuda.empty_cache()
        pools = graph_pool_bytes(device) - pools_before if options.get("compile") == "reduce-overhead" else 0
        return (peak_bytes(one_step, device) + pools) / 2**20
    if options.get("compile"):
        return math.nan
    return peak_bytes(one_step, device) / 2**20


def race(run_steps, current: tuple, candidate: tuple, *, pairs: int = 5, device=None) -> Race:
    """Two configurations, ``(name, options)`` each, trained side by side from the same weights on the same batches:
    one step each to start up, then ``pairs`` interleaved pairs of steps; then one more step of each, its memory
    measured."""
    device = get_device(device)
    (name_a, options_a), (name_b, options_b) = current, candidate
    pools_before = graph_pool_bytes(device)
    step_a, trained_a = session(run_steps, options_a)
    step_b, trained_b = session(run_steps, options_b)
    comparison = compare(step_a, step_b, labels=(name_a, name_b), number=1, warmup=1, pairs=pairs, device=device)
    peaks = (step_peak_mib(step_a, options_a, pools_before, device), step_peak_mib(step_b, options_b, pools_before,
                                                                                   device))
    losses_a, losses_b = (torch.stack(t["losses"]).float().cpu() for t in (trained_a, trained_b))
    return Race(comparison, (losses_b - losses_a).abs().max().item(), (losses_a[-1].item(), losses_b[-1].item()),
                peaks, (step_a, step_b))


def same_training(result: Race) -> bool:
    """Whether the candidate computed the same training: its loss gap within ``GAP_NATS`` or ``GAP_SHARE`` of its
    loss, whichever is larger (False for a NaN)."""
    return result.loss_gap <= max(GAP_NATS, GAP_SHARE * abs(result.losses[1]))


def judge(result: Race) -> str | None:
    """``racing.Path``'s judge: None where the candidate trains the same, else why it is not kept."""
    return None if same_training(result) else racing.LOSSES_DIFFER


# ----- MFU of a configuration --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Reference:
    """One peak for every step of a path that changes precision: the dense datasheet peak of the fastest precision
    the path uses (or, without a datasheet, that precision's measured ceiling)."""

    precision: str
    tflops: float
    words: str

    def __str__(self) -> str:
        return self.words


def reference_peak(precisions, device=None) -> Reference:
    """The ``Reference`` of a path whose steps run in ``precisions`` (``flops.reference_peak``, in words)."""
    device = get_device(device)
    precision, tflops = flops.reference_peak(sorted(set(precisions)), device)
    dense = tflops == flops.datasheet(device_info(device).name, precision)
    words = (f"the dense {precision} peak ({tflops:g} TFLOP/s)" if dense else
             f"the {precision} ceiling measured here ({tflops:.3g} TFLOP/s)")
    return Reference(precision, tflops, words)


def gpt_hardware_flops(size: dict, base: dict, amp_dtype: torch.dtype, device=None) -> Callable[[dict], float]:
    """What a training step of ``text.GPT`` with ``options`` runs (``base`` the options' defaults, with ``micro`` and
    ``accum``): FlopCounterMode's count of one micro-batch, eager, in the step's precision, with causal attention's
    skipped tiles taken out (``flops.kernel_flops``: padding and flash attention's recomputation stay in), per token
    (one sequence counted), scaled to the step's tokens. Counted once per model shape and precision."""
    device = get_device(device)

    @functools.cache
    def counted(attention: str, padded_vocab: int, amp: bool) -> float:
        model = text.GPT(text.GPTConfig(**size, attention=attention, padded_vocab=padded_vocab)).to(device)
        x = torch.randint(0, text.VOCAB, (1, size["seq_len"]), generator=torch.Generator().manual_seed(1)).to(device)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp):
            step = flops.count(lambda: model(x, x).backward())
        return flops.kernel_flops(step, size["seq_len"]) / x.numel()

    def hardware_flops(options: dict) -> float:
        o = {**base, **options}
        per_token = counted(o["attention"], o["padded_vocab"], o["amp"])
        return per_token * o["micro"] * o["accum"] * size["seq_len"]
    return hardware_flops


@dataclass
class Meter:
    """MFU and HFU of a configuration's step (``flops.mfu``): the model's FLOPs per step (``model_flops``: the
    unpadded model's) over the dense peak of the precision ``precision(options)`` names, "of achievable" over that
    precision's ceiling in ``ceilings``, HFU from ``hardware_flops(options)``; and over one ``reference`` peak."""

    model_flops: float
    ceilings: dict
    precision: Callable[[dict], str]
    reference: Reference
    hardware_flops: Callable[[dict], float] | None = None

    def __call__(self, options: dict, seconds: float) -> flops.Utilisation:
        hardware = self.hardware_flops(options) if self.hardware_flops else None
        return flops.mfu(self.model_flops, seconds, self.ceilings, precision=self.precision(options),
                         hardware_flops=hardware)

    def against_reference(self, u: flops.Utilisation) -> float:
        """The step's model FLOP/s over the one reference peak (NaN where its utilisation is not a result)."""
        return math.nan if u.impossible else u.against(self.reference.tflops)


# ----- the waterfall -------------------------------------------------------------------------------------------------

TOF32_HINT = "TensorFloat32 tensor cores"  # Inductor's hint at compiling fp32 matmuls with TF32 off


@dataclass
class Limits:
    """What a waterfall may spend on this card: the seconds of its races and its head-to-head (``budget``, spent only
    while they run), and the device memory a race may hold (``usable_gb``, against ``race_gb(options)``: a race's need
    predicted from a whole configuration); a compile's start-up, first and later in the kernel (``compile_s``,
    ``compile_again_s``), to plan each race before it starts."""

    budget: racing.Budget = field(default_factory=lambda: racing.Budget().pause())
    usable_gb: float = math.inf
    race_gb: Callable[[dict], float] | None = None
    compile_s: float = 0.0
    compile_again_s: float = 0.0

    @classmethod
    def of(cls, plan, base: dict) -> "Limits":
        """Lesson 10's ``plan``: its budget (paused until a race runs), the card's usable memory against
        ``plan10.race_gb`` of each configuration (``base``: the step's defaults, its micro-batch among them), the
        compile times it planned with."""
        return cls(racing.Budget(plan.budget_s).pause(), plan.usable_gb,
                   lambda options: plan10.race_gb(plan.gpt, {**base, **options}), plan.compile_s, plan.compile_again_s)


class Waterfall:
    """The keep-or-drop path of a training step (``racing.Path``): each step raced against the configuration kept so
    far by ``run(current, candidate)`` (a ``Race``), kept when faster beyond the noise and training the same
    (``judge``). Each row has the step's tokens/s, its precision and that precision's dense peak, MFU, "of
    achievable", HFU, MFU against the meter's reference, the MiB a step allocates, its last training loss, its loss
    gap and its start-up; rows are logged to ``log`` as each verdict is given (the first race also gives the starting
    configuration's row), with the state of the machine over their race. Within ``limits``: a step whose race would
    not fit the card's memory, or whose race and the head-to-head after it would not end within what is left of the
    budget (``pairs`` interleaved pairs, planned at the kept configuration's measured step), is not raced, and its row
    says why. The first race always runs: it measures the starting configuration."""

    def __init__(self, run: Callable[[tuple, tuple], Race], meter: Meter, *, tokens_per_step: int, log: str,
                 start: tuple = ("naive fp32", {}), device=None, limits: Limits | None = None, pairs: int = 5):
        self.meter, self.tokens_per_step, self.start, self.device = meter, tokens_per_step, start, get_device(device)
        self._run, self.log, self.limits, self.pairs = run, ResultLog(log), limits or Limits(), pairs
        self.step_s: dict[str, float] = {}  # a configuration's median step as measured so far, by its options
        self.compiled = False  # whether a race of this waterfall has compiled the model yet
        self.path = racing.Path(self._race, judge=judge, row=self._measured, current=start, log=self._logged)

    @property
    def current(self) -> tuple:
        """The configuration kept so far, ``(name, options)``."""
        return self.path.current

    @property
    def races(self) -> dict:
        return self.path.results

    def step(self, name: str, options: dict, not_here: str | None = None) -> dict:
        with self.limits.budget.spending():
            refused = None if not_here else self.refused(name, options)
            if refused:
                print(f"{name}: {refused}")
            return self.path.step(name, options, not_here or refused)

    def planned_s(self, kept: dict, candidate: dict) -> float:
        """A race's seconds before it starts: both sides at the kept configuration's measured step (the candidate is
        meant to be faster), and the compiles it starts with (``plan10.startup_s``)."""
        step = self.step_s[repr(kept)]
        return plan10.race_s(step, step, self.pairs) + plan10.startup_s(
            kept, candidate, self.compiled, self.limits.compile_s, self.limits.compile_again_s)

    def refused(self, name: str, options: dict) -> str | None:
        """Why the step ``name`` is not raced now (None: it fits the card's memory and the budget, and says so)."""
        candidate = {**(self.current[1] or {}), **options}
        if self.limits.race_gb is not None:
            need = self.limits.race_gb(candidate)
            if need > self.limits.usable_gb:
                return (f"not raced: two runs of it need about {need:.1f} GB (predicted), more than the "
                        f"{self.limits.usable_gb:.1f} GB this card's plan fills")
        if not self.races:
            return None
        seconds = self.planned_s(self.current[1], candidate)
        naive, kept = self.step_s[repr(self.start[1])], self.step_s[repr(self.current[1])]
        final = plan10.race_s(naive, kept, self.pairs) + plan10.startup_s(
            self.start[1], candidate, True, self.limits.compile_s, self.limits.compile_again_s)
        left = self.limits.budget.left()
        if seconds + final > left:
            return (f"not raced: planned {seconds:.0f} s, and {final:.0f} s for the head-to-head after it; "
                    f"{max(left, 0):.0f} s of the lesson's budget left")
        print(f"racing {name}: planned {seconds:.0f} s" + ("" if math.isinf(left) else f", {left:.0f} s left"))
        return None

    def race_ends(self) -> Race:
        """The starting configuration raced against the one kept, directly, within the budget (the steps before kept
        its seconds for it); both runs' ``steps`` kept, to go on training them."""
        name, options = self.current
        with self.limits.budget.spending(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=TOF32_HINT)  # answered where the compile step raced
            return self._run(self.start, (f"{name} (final)", options))

    def _race(self, current: tuple, candidate: tuple) -> Race:
        if candidate[1].get("compile") and self.meter.precision(candidate[1]) == "fp32" and device_info(self.device).tf32:
            print(f"{candidate[0]}: its matmuls stay in full fp32, as the TF32 step was not kept here (not faster "
                  "beyond the noise). Inductor hints at turning TF32 on; this waterfall decides that by measuring.")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=TOF32_HINT)  # the hint, answered above
            result = self._run(current, candidate)
        self.step_s[repr(current[1])] = statistics.median(result.comparison.baseline_times)
        self.step_s[repr(candidate[1])] = statistics.median(result.comparison.candidate_times)
        self.compiled = self.compiled or bool(current[1].get("compile") or candidate[1].get("compile"))
        result.steps = ()  # the two runs are judged: their models go (eight races would keep sixteen models)
        gc.collect()
        return result

    def row(self, name: str, options: dict, seconds: float, **fields) -> dict:
        """A configuration's columns for a step taking ``seconds``."""
        u = self.meter(options, seconds)
        return {"step": name, "tokens_per_s": self.tokens_per_step / seconds, **u.row(),
                "mfu_vs_reference": self.meter.against_reference(u), **fields}

    def _measured(self, result: Race, options: dict) -> dict:
        steady = statistics.median(result.comparison.candidate_times)
        row = self.row("", options, steady, step_peak_MiB=result.peaks[1], loss=result.losses[1],
                       loss_gap=result.loss_gap,
                       startup_s=max(result.comparison.candidate_warmup[0] - steady, 0.0))
        del row["step"]
        return row

    def start_row(self) -> dict:
        """The starting configuration's row, from the first race (its baseline)."""
        first = next(iter(self.races.values()))
        return self.row(*self.start, statistics.median(first.comparison.baseline_times), step_peak_MiB=first.peaks[0],
                        loss=first.losses[0], kept=True, note="the baseline")

    def _logged(self, row: dict, result: Race | None) -> None:
        if result is None:  # the step cannot run here: nothing was measured
            return
        rows = ([self.start_row()] if len(self.races) == 1 else []) + [row]
        for measured in rows:
            self.log.add(**{k: v for k, v in measured.items() if not (isinstance(v, float) and math.isnan(v))},
                         reference=str(self.meter.reference), conditions=result.comparison.conditions)

    def frame(self) -> pd.DataFrame:
        """Every row: the starting configuration's, then one per step (NaN where a step did not run)."""
        rows = [self.start_row(), *self.path.rows] if self.races else list(self.path.rows)
        return pd.DataFrame(rows)

    def table(self) -> pd.DataFrame:
        """The rows to read: speed-up with its interval, precision and its dense peak beside MFU, percentages."""
        path = self.frame()
        ref = f"MFU vs {self.meter.reference.precision} peak"
        shown = path.assign(speedup=[f"{r.vs_previous:.2f}× ({r.low:.2f}–{r.high:.2f})" if r.vs_previous == r.vs_previous
                                     else "" for r in path.reindex(columns=["vs_previous", "low", "high"]).itertuples()])
        shown = shown.rename(columns={"mfu": "MFU", "of_achievable": "of achievable", "hfu": "HFU",
                                      "mfu_vs_reference": ref, "datasheet_tflops": "dense peak (TFLOP/s)"})
        shown["loss_gap"] = [f"{g:.2g}" if g == g else "" for g in shown.get("loss_gap", pd.Series(math.nan, shown.index))]
        for column in ("MFU", "of achievable", "HFU", ref):
            shown[column] = [flops.percent(v) if v == v else "" for v in shown.get(column, [math.nan] * len(shown))]
        columns = ["step", "tokens_per_s", "speedup", "precision", "dense peak (TFLOP/s)", "MFU", "of achievable",
                   "HFU", ref, "step_peak_MiB", "loss", "loss_gap", "startup_s", "kept", "note"]
        return shown.reindex(columns=columns).round(4)

    def legend(self) -> str:
        """What the table's columns divide by, in words."""
        ref = self.meter.reference
        return (f"MFU: over the dense datasheet peak of the step's own precision (its column beside it: an fp32 step's "
                f"peak is far below a 16-bit one's); of achievable: over that precision's ceiling measured here; MFU "
                f"vs {ref.precision} peak: every step over one reference, {ref}, the column that shows progress across "
                "precisions. loss: the step's training loss at the race's last step; loss_gap: the largest difference "
                "from the configuration before it, step by step, on the same batches.")

    def plot(self, title: str) -> None:
        """Each step's speed-up over the configuration before it (with its interval; the product of the kept ones
        last), then every step's MFU against the reference and its memory."""
        path = self.frame()
        ran = path[path["vs_previous"].notna()] if "vs_previous" in path else path.iloc[0:0]
        plots.waterfall(ran.step.tolist(), ran.vs_previous.tolist(), kept=ran.kept.tolist(),
                        accuracy_lost=(ran.note == racing.LOSSES_DIFFER).tolist(), lost_label="its training losses differ",
                        kept_label="kept: faster, the same training", intervals=list(zip(ran.low, ran.high)),
                        title=f"{title}: speed-up of each step (tokens/s of the same training)")
        plt.show()
        measured = path[path["tokens_per_s"].notna()]
        colors = ["tab:green" if k else "0.7" for k in measured.kept]
        with plots.style():
            _, (left, right) = plt.subplots(1, 2, figsize=(13, 4.2))
        left.barh(measured.step, measured.mfu_vs_reference.fillna(0) * 100, color=colors)
        left.set(xlabel=f"MFU (%) against {self.meter.reference}, for every step", title="MFU per step, one reference")
        left.invert_yaxis()
        right.barh(measured.step, measured.step_peak_MiB.fillna(0), color=colors)
        right.set(xlabel="MiB a step allocates above the model, its gradients and optimizer state",
                  title="Peak memory per step")
        right.invert_yaxis()
        right.set_yticklabels([])
        plt.show()

    def head_to_head(self, final: Race, final_options: dict) -> tuple[flops.Utilisation, flops.Utilisation]:
        """The starting configuration and ``final_options`` raced directly (``final``): both ends' utilisation, and
        the race's row logged."""
        naive_s, final_s = (statistics.median(t) for t in (final.comparison.baseline_times,
                                                           final.comparison.candidate_times))
        naive_u, final_u = self.meter(self.start[1], naive_s), self.meter(final_options, final_s)
        self.log.add(step="optimised vs naive", **final.comparison.row(), **final_u.row(), loss=final.losses[1],
                     loss_gap=final.loss_gap, mfu_vs_reference=self.meter.against_reference(final_u),
                     reference=str(self.meter.reference))
        return naive_u, final_u


# ----- compiling cold ------------------------------------------------------------------------------------------------

COLD_CACHES = "gpulab-compile-"  # the prefix of the empty cache folder the compile steps start from
_caches: list = []  # the folder, kept for the rest of the process (compile workers go on using the one they started with)


def cold_compile_caches(device=None) -> bool:
    """Inductor's and Triton's caches in an empty folder (``TORCHINDUCTOR_CACHE_DIR``, ``TRITON_CACHE_DIR``), so that
    the next compile is cold, as on a fresh machine (a second run of a script finds those caches on disk and starts
    much faster). True where it set them now; False on a CPU (nothing is timed compiling there) and where this
    process set them already: what it compiles next is then warm."""
    if not on_gpu(get_device(device)) or COLD_CACHES in os.environ.get("TORCHINDUCTOR_CACHE_DIR", ""):
        return False
    _caches.append(tempfile.TemporaryDirectory(prefix=COLD_CACHES))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _caches[-1].name
    os.environ["TRITON_CACHE_DIR"] = os.path.join(_caches[-1].name, "triton")
    return True
