"""Lesson 08's races: its configurations trained side by side from the same seed, the job's noise measured first, and
the path's keep-or-drop loop, all inside one time budget.

The training itself is the lesson's: ``train_naive(model, data, epochs, rounds, seed)`` and
``train(model, data, epochs, rounds, seed, **options)`` each return the rounds of one run (``next()`` trains a round
and returns its losses); ``train`` builds its job when called (a CUDA graph is captured there). This module makes
the models, races two runs (``racing.race``), plans each race's seconds from the rates measured so far and refuses one
that would not fit what is left of the budget, and records each verdict (``racing.Path``, judged by ``racing.SameJob``).
"""

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import matplotlib.pyplot as plt
import pandas as pd
import torch

from . import busy, capstone, datasheets, flops, plots, racing
from .device import device_info, get_device, on_gpu
from .models import SpeedrunNet
from .plans import plan08
from .results import ResultLog, reference

NUMERIC = ("amp", "batch", "lr")  # the options that change what is computed; the others change where and how
DEVICE_JOB = {"pipeline": "device"}  # the noise's configuration: the naive recipe with its data on the device


def key(options: dict | None) -> str:
    """A configuration's key in the measured rates and first rounds (None: the naive job)."""
    return repr(options)


@dataclass
class Races:
    """Lesson 08's path on one budget (``budget_s``, spent only while the noise and the races run)."""

    train_naive: Callable
    train: Callable
    data: capstone.ImageData
    job: capstone.Sizes
    base: dict  # every option switched off: the naive recipe's
    budget_s: float = math.inf
    compile_s: float = plan08.COMPILE_S
    compile_again_s: float = plan08.COMPILE_AGAIN_S  # a step's compile tried again, which reuses what is cached
    planned_rates: plan08.Rates | None = None  # the plan's rates: a configuration not measured yet is planned from them
    log: ResultLog | None = None
    device: torch.device = field(default_factory=get_device)
    amp_dtype: torch.dtype = torch.bfloat16  # what autocast trains in where a configuration asks for it
    rates: dict = field(default_factory=dict)  # configuration -> its steady training images/s, as measured so far
    first_rounds: dict = field(default_factory=dict)  # configuration -> its first round from seed 1
    noise: list = field(default_factory=list)  # the noise seeds' runs
    budget: racing.Budget = field(init=False)
    path: racing.Path | None = None
    judge: racing.SameJob | None = None
    steps: list = field(default_factory=list)  # the path's steps, as run_path was given them

    def __post_init__(self):
        self.budget = racing.Budget(self.budget_s).pause()

    # ---- one run of a configuration ------------------------------------------------------------------------------

    def session(self, options: dict | None, seed: int = 0):
        """A fresh model initialised from ``seed`` and its run (``next(run)`` trains a round and returns its losses),
        and ``evaluate()``, its test accuracy."""
        torch.manual_seed(seed)
        model = SpeedrunNet(self.job.widths, seed=seed).to(self.device)
        j = self.job
        run = (self.train_naive(model, self.data, j.epochs, j.rounds, seed) if options is None
               else self.train(model, self.data, j.epochs, j.rounds, seed, **options))
        d = self.data
        return run, lambda: capstone.evaluate(model, d.test_images, d.test_labels, self.device, mean=d.mean, std=d.std)

    def images_per_round(self, options: dict | None) -> int:
        """A round is a fixed share of an epoch's full batches (a last, partial batch is dropped)."""
        batch = (options or {}).get("batch", self.job.batch)
        return len(self.data.train_labels) // batch // self.job.rounds * batch

    def other_seed(self, options: dict | None) -> tuple:
        """A configuration's first round from seed 1 (measured once, for every race from that configuration)."""
        if key(options) not in self.first_rounds:
            run, _ = self.session(options, seed=1)
            first = racing.alone(run, rounds=1, samples_per_round=self.images_per_round(options), device=self.device)
            self.first_rounds[key(options)] = first.losses
            self.rates.setdefault(key(options), first.samples_per_s)
        return self.first_rounds[key(options)]

    def race(self, current: tuple, candidate: tuple) -> racing.Race:
        """Two configurations, (name, options) each (None: the naive job), raced round by round from seed 0."""
        (name_a, options_a), (name_b, options_b) = current, candidate
        images = {self.images_per_round(options_a), self.images_per_round(options_b)}
        if len(images) > 1:
            raise ValueError(f"{name_a} and {name_b} train {images} images per round: rounds must hold the same images")
        same = all({**self.base, **(options_a or {})}[k] == {**self.base, **(options_b or {})}[k] for k in NUMERIC)
        yardstick = self.other_seed(options_a) if same else ()
        (run_a, evaluate_a), (run_b, evaluate_b) = self.session(options_a), self.session(options_b)
        raced = racing.race(run_a, run_b, rounds=self.job.epochs * self.job.rounds, samples_per_round=images.pop(),
                            labels=(name_a, name_b), evaluate=(evaluate_a, evaluate_b), evaluate_every=self.job.rounds,
                            device=self.device, same_arithmetic=same, other_seed=yardstick)
        self.rates[key(options_a)], self.rates[key(options_b)] = (raced.baseline.samples_per_s,
                                                                   raced.candidate.samples_per_s)
        return raced

    # ---- the noise, then the path ---------------------------------------------------------------------------------

    def measure_noise(self, steps=(), seeds=capstone.NOISE_SEEDS) -> list[racing.Run]:
        """Other seeds of the job with its data on the device, each trained to the end: with the first race's baseline,
        their accuracies are the job's spread; the first seed's first round is what another seed's losses look like.
        Then the naive job's first round from that seed, the first race's yardstick. The first seed always trains; a
        later one only where what is left of the budget after it still holds the races of ``steps`` ((name, options,
        not_here) each) as planned at the rates measured so far (``plan``): the races come first."""
        rounds, self.noise = self.job.epochs * self.job.rounds, []  # a cell run again measures again
        with self.budget.spending():
            for seed in seeds:
                if self.noise:
                    races_s = self.plan(steps, noise_seeds=()).planned_s.sum()
                    why = self.budget.refuses(self.run_s(DEVICE_JOB) + races_s)
                    if why:
                        print(f"seed {seed} of the job not trained: with it, the noise and the races planned at "
                              f"{self.run_s(DEVICE_JOB) + races_s:.0f} s, {max(self.budget.left(), 0):.0f} s of the "
                              f"lesson's budget left; the spread has {len(self.noise) + 1} runs, its margin is wider")
                        continue
                run, evaluate = self.session(DEVICE_JOB, seed)
                self.noise.append(racing.alone(run, rounds=rounds, samples_per_round=self.images_per_round(DEVICE_JOB),
                                               label=f"seed {seed}", evaluate=evaluate, evaluate_every=self.job.rounds,
                                               device=self.device))
                self.rates[key(DEVICE_JOB)] = statistics.median(r.samples_per_s for r in self.noise)
                if len(self.noise) == 1:
                    self.first_rounds[key(DEVICE_JOB)] = self.noise[0].losses[:1]
                    self.other_seed(None)
        return self.noise

    def run_s(self, options: dict | None) -> float:
        """One run of a configuration at the rate measured for it (the job with its data on the device where not yet
        measured), with its evaluations."""
        return self.job.epochs * self.job.rounds * self.images_per_round(options) / self.rate(options) + self.evaluations()

    def evaluations(self) -> float:
        """One run's evaluations, at the rate measured for the job with its data on the device."""
        return plan08.evaluation_s(self.job.epochs, len(self.data.test_labels), self.rates[key(DEVICE_JOB)])

    def rate(self, options: dict | None) -> float:
        """A configuration's images/s as planned now: as measured where it was (the naive job, the job with its data
        on the device, each configuration raced); another at the measured rate of the job with its data on the device
        times the plan's ratio of the two (``planned_rates``: mixed precision faster; none: the same)."""
        if key(options) in self.rates:
            return self.rates[key(options)]
        if options is None or options.get("pipeline", self.base["pipeline"]) == "per-sample":
            return self.rates[key(None)]
        measured, planned = self.rates[key(DEVICE_JOB)], self.planned_rates
        return measured * planned.of(options) / planned.device if planned else measured

    def plan(self, steps, noise_seeds=None) -> pd.DataFrame:
        """The noise (``noise_seeds``: the seeds trained, by default) and each step's race (``steps``: (name, options,
        not_here)), in seconds, from the rates measured so far, as ``gpulab plan`` plans them from the card's."""
        seeds = [int(r.label.removeprefix("seed ")) for r in self.noise] if noise_seeds is None else noise_seeds
        rows = plan08.path_seconds([(n, o) for n, o, not_here in steps if not not_here], self.rate, self.job,
                                   self.compile_s, noise_seeds=seeds)
        return pd.DataFrame(rows[0 if seeds else 1:], columns=["part", "planned_s"])

    def planned(self, name: str, options: dict) -> float:
        """A race's seconds as ``gpulab plan`` plans it (``plan08.race_seconds``), at the rate measured for the kept
        configuration, with the compilation where the candidate compiles and the kept configuration does not (a retry
        reuses what is cached: ``compile_again_s``) and both runs' evaluations."""
        kept = self.path.current[1]
        candidate = {**(kept or {}), **options}
        compiles = candidate.get("compile") and not (kept or {}).get("compile")
        startup = (self.compile_again_s if "(again)" in name else self.compile_s) if compiles else 0.0
        images = self.images_per_round(candidate)
        return plan08.race_seconds(self.job.epochs * self.job.rounds * images, images, self.rates[key(kept)],
                                   startup + 2 * self.evaluations())

    def refused(self, name: str, options: dict) -> str | None:
        """Why this race is not started now (None: it fits in the budget, and says so). The first race always runs:
        the naive job's one run."""
        seconds = self.planned(name, options)
        why = self.budget.refuses(seconds) if self.path.rows else None
        if not why:
            left = "" if math.isinf(self.budget.seconds) else f", {max(self.budget.left(), 0):.0f} s left"
            print(f"racing {name}: planned {seconds:.0f} s{left}")
        return why

    def not_captured(self, options: dict) -> str | None:
        """A step captured in a CUDA graph is built once before its race: where the capture fails here (an operation
        no capture allows, or a CPU playing a GPU, which cannot capture), its row says why and nothing is raced."""
        candidate = {**(self.path.current[1] or {}), **options}
        try:
            self.session(candidate)
        except RuntimeError as error:
            return f"not raced: capturing the step failed here ({str(error).splitlines()[0]})"
        return None

    def run_path(self, steps) -> racing.Path:
        """Each of ``steps`` ((name, options, why it cannot run here)) raced against the configuration kept so far,
        then each step dropped for its speed tried once more where a later one was kept; every row logged as its
        verdict is given."""
        self.steps = steps
        self.judge = racing.SameJob(seeds=tuple(r.final_accuracy for r in self.noise), share=capstone.LOSS_SHARE,
                                    steps=capstone.LOSS_STEPS)
        self.path = racing.Path(self.race, judge=self.judge, row=self.judge.row, current=("naive job", None),
                                log=self._log)
        with self.budget.spending():
            for name, options, not_here in steps:
                not_here = not_here or self.refused(name, options)
                if not not_here and options.get("cuda_graph") and not (self.path.current[1] or {}).get("cuda_graph"):
                    not_here = self.not_captured(options)
                self.path.step(name, options, not_here)
            self.path.again(not_here=self.refused)
        return self.path

    def _log(self, row: dict, result) -> None:
        if self.log is not None:
            self.log.add(**{k: v for k, v in row.items() if not (isinstance(v, float) and math.isnan(v))})

    def table(self) -> pd.DataFrame:
        """The path's rows as the lesson shows them: each step's speed, speed-up with its interval, start-up, time to
        the target, accuracy, what it was judged on, and its verdict."""
        steps = pd.DataFrame(self.path.rows)
        shown = steps.assign(speedup=[f"{r.vs_previous:.2f}× ({r.low:.2f}–{r.high:.2f})"
                                      if r.vs_previous == r.vs_previous else "" for r in steps.itertuples()])
        columns = ["step", "samples_per_s", "speedup", "startup_s", "time_to_target_s", "accuracy", "judged_on",
                   "loss_gap", "loss_tolerance", "note"]
        return shown[[c for c in columns if c in shown]].round(4)

    # ---- figures and the summary --------------------------------------------------------------------------------

    def first_race(self) -> racing.Race:
        return next(iter(self.path.results.values()))

    def loss_figure(self) -> None:
        """The first race's two sides and another seed, step by step through the first round, the judged steps
        shaded; and their gaps over those steps beside the race's tolerance."""
        first, n = self.first_race(), capstone.LOSS_STEPS
        gap, other = (racing.loss_gap(first.baseline.losses, losses, n) for losses in (first.candidate.losses,
                                                                                       first.other_seed))
        fig, ax = plt.subplots(figsize=(8, 3.5))
        for run, style in ((first.baseline, "-"), (first.candidate, "--")):
            ax.plot(racing.steps_of(run.losses[:1]), style, label=f"{run.label}, seed 0")
        ax.plot(racing.steps_of(first.other_seed), ":", color="0.5", label=f"{first.baseline.label}, seed 1")
        ax.axvspan(-0.5, n - 0.5, color="0.9", zorder=0, label=f"the {n} steps judged")
        ax.set(xlabel="step of the first round", ylabel="training loss", title="the first race's first round")
        ax.legend()
        plt.show()
        print(f"{first.candidate.label} vs {first.baseline.label}, seed 0: loss gap {gap:.3g} (mean over the first {n} "
              f"steps); another seed's gap {other:.3g}; tolerance {self.judge.tolerance(first):.3g} "
              f"({capstone.LOSS_SHARE:g} of it)")

    def precision_of(self, options: dict | None) -> str:
        """The precision a configuration's convolutions run in (``flops.precision_of``)."""
        return flops.precision_of(self.amp_dtype if (options or {}).get("amp") else None, convolutions=True)

    def precisions(self) -> list[str]:
        """The precisions the path's configurations train in."""
        return sorted({self.precision_of(o) for o in [{}, *(o for _, o, why in self.steps if not why)]})

    def waterfall(self, flops_per_image: float, title: str) -> None:
        """Each step's speed-up with its interval (kept, dropped, or no longer the same job), its time to the target,
        and its model FLOP/s against one peak: the dense peak of the fastest precision the path uses."""
        steps = pd.DataFrame(self.path.rows)
        ran = steps[steps.samples_per_s.notna()]
        precision, tflops = flops.reference_peak(self.precisions(), self.device)
        fig, (left, middle, right) = plt.subplots(1, 3, figsize=(17, 4.5), gridspec_kw={"width_ratios": [2, 1, 1]})
        plots.waterfall(ran.step.tolist(), ran.vs_previous.tolist(), kept=ran.kept.tolist(),
                        accuracy_lost=ran.note.isin([racing.MISSED_TARGET, racing.LOSSES_DIFFER]).tolist(),
                        lost_label="not the same job: losses differ, or the target missed",
                        intervals=list(zip(ran.low, ran.high)), title=title, ax=left)
        colors = ["tab:green" if k else "0.7" for k in ran.kept]
        middle.barh(ran.step, ran.time_to_target_s, color=colors)
        middle.set(xlabel="seconds to the target accuracy", title="time to target (training only)")
        share = ran.samples_per_s * flops_per_image / 1e12 / tflops * 100
        right.barh(ran.step, share.where(share <= 100), color=colors)  # above 100 %: the reference was not the best
        sheet = on_gpu(self.device) and datasheets.peak(device_info(self.device).name, precision)
        right.set(xlabel=f"% of the {'dense datasheet' if sheet else 'measured'} {precision} "
                         f"{'peak' if sheet else 'ceiling'} ({tflops:.3g} TFLOP/s)", title="MFU against one peak")
        for ax in (middle, right):
            ax.invert_yaxis()
        right.set_yticklabels([])
        plt.show()

    def summary(self, busy_naive: busy.Busy, busy_final: busy.Busy, flops_per_image: float, ceilings) -> pd.DataFrame:
        """The naive job (its one run: the first race's) beside the optimised one (from the race that kept its last
        step): speed, time to the target, accuracy, MFU over the dense peak of each one's precision and of achievable,
        and the busy shares of their profiler windows; logged, and the speed-up said two ways."""
        final, final_options = self.path.current
        naive = self.first_race().baseline
        optimised = self.path.results[final].candidate if final in self.path.results else naive
        kept = [r for r in self.path.rows if r.get("kept")]
        u_naive, u_final = (flops.mfu(flops_per_image, 1 / run.samples_per_s, ceilings, precision=self.precision_of(o))
                            for run, o in ((naive, None), (optimised, final_options)))
        target = self.judge.target
        table = pd.DataFrame({label: [run.samples_per_s, run.time_to(target), run.final_accuracy, u.row()["mfu"],
                                      u.row()["of_achievable"], b.kernel_share, b.nvml_util, b.sm_activity]
                              for label, run, u, b in (("naive job", naive, u_naive, busy_naive),
                                                       ("optimised", optimised, u_final, busy_final))},
                             index=["samples/s (steady)", "seconds to the target",
                                    f"test accuracy after {self.job.epochs} epochs", "MFU (dense datasheet peak)",
                                    "of achievable (measured ceiling)", "GPU busy: kernels (trace)", "NVML utilisation",
                                    "SM activity (GPM)"])
        ratio, chain = optimised.samples_per_s / naive.samples_per_s, math.prod(r["vs_previous"] for r in kept)
        if self.log is not None:
            self.log.add(step="optimised vs naive", speedup=ratio, speedup_of_kept_steps=chain,
                         naive_samples_per_s=naive.samples_per_s, time_to_target_naive_s=naive.time_to(target),
                         time_to_target_s=optimised.time_to(target), accuracy=optimised.final_accuracy,
                         samples_per_s=optimised.samples_per_s, **u_final.row(), **busy_final.row())
        name, speedups = device_info(self.device).name, " × ".join(f"{r['vs_previous']:.2f}" for r in kept)
        print(f"On {name}: the optimised job trains {ratio:.2f}× the naive job's images per second (each rate from its "
              f"own race); the kept steps' speed-ups, each raced side by side, multiply to {chain:.2f}× "
              f"({speedups or 'nothing kept'}).")
        print(f"Time to {target:.1%}: {naive.time_to(target):.2f} s → {optimised.time_to(target):.2f} s (start-up "
              f"{optimised.startup_s:.2f} s of it). Kept: {', '.join(r['step'] for r in kept) or 'nothing'}.")
        print(f"naive: {u_naive}\noptimised: {u_final}\n{busy_naive}\n{busy_final}")
        for row in self.path.rows:
            if row.get("caveat"):
                print(f"{row['step']} was raced while {row['caveat']}.")
        return table

    # ---- what the traces say about the steps that did not help ----------------------------------------------------

    def explain_dropped(self, traced: dict, step_of: Callable) -> list[str]:
        """For each step dropped as not faster, what the trace of the configuration it was raced on says: ``traced``
        holds the busy shares measured so far, by configuration name; the others are measured once each, a window of
        ``step_of(options)``'s steps."""
        lines = []
        for row in self.path.rows:
            if row.get("note") in (racing.WITHIN_NOISE, racing.SLOWER_HERE):
                lines.append(f"{row['step']}: {row['note']} ({row['vs_previous']:.2f}×) — "
                             f"{self._pace(row, traced, step_of)}")
        return lines

    def _pace(self, row: dict, traced: dict, step_of: Callable) -> str:
        kept_before = [r["step"] for r in self.path.rows[: self.path.rows.index(row)] if r.get("kept")]
        base = kept_before[-1] if kept_before else "naive job"
        if base not in traced:
            traced[base] = busy.measure(step_of(self.path.options_of(base)), label=base, device=self.device, steps=10)
        share = traced[base].kernel_share
        if share != share:
            return "no GPU here: on a CPU every change competes for the same cores"
        if share < 0.5:
            pace = "the CPU set the pace: a step shows only as far as it shortens the CPU's part (data, launches, waits)"
        elif share > 0.9:
            pace = "the GPU set the pace: a step shows only as far as it shortens the kernels"
        else:
            pace = "the CPU's part and the kernels both still count"
        return f"raced on '{base}', whose GPU ran kernels {share:.0%} of each step: {pace}"


# ---- the speed the job would train at, at a share of a card's peak ------------------------------------------------

SHIPPED_CEILINGS = {"NVIDIA H100 80GB HBM3": ("04_matmul_precision", "tflops"),
                    "NVIDIA H200": ("09_ceilings", "ceiling_tflops")}


def speed_targets(flops_per_image: float, precision: str, device=None, *, mfu: float = 0.4) -> pd.DataFrame:
    """The samples/s at ``mfu`` of a card's dense peak, over the FLOPs of one training image: on the cards the course
    shipped ceilings for (bf16, their mixed precision), with that speed as a share of the ceiling measured there, and on
    this GPU in ``precision`` (the precision it trains in: fp16 where bf16 is not native)."""
    rows = []
    for card, (name, column) in SHIPPED_CEILINGS.items():
        shipped = reference(name)
        shipped = shipped[(shipped.device_name == card) & (shipped.precision == "bf16")]
        peak, ceiling = datasheets.peak(card, "bf16"), shipped[column].max() if len(shipped) else math.nan
        rows.append({"card": card, "precision": "bf16", "dense peak (TFLOP/s)": peak, "measured ceiling": ceiling,
                     f"samples/s at {mfu:.0%} MFU": mfu * peak * 1e12 / flops_per_image,
                     "that speed, of achievable": mfu * peak / ceiling})
    name = device_info(device).name if on_gpu(device) else None
    peak = datasheets.peak(name, precision) if name else None
    if peak:
        rows.append({"card": f"this GPU ({name})", "precision": precision, "dense peak (TFLOP/s)": peak,
                     f"samples/s at {mfu:.0%} MFU": mfu * peak * 1e12 / flops_per_image})
    return pd.DataFrame(rows).set_index("card").round(3)
