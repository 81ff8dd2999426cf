"""Lesson 08, the capstone: make the slow training job faster, graded by the speed-up measured on the
learner's own machine, with the same model and the accuracy kept."""

import functools
import secrets
import statistics

import torch
import torch.nn.functional as F

from .. import capstone, plans
from ..check import Question, Wrong
from ..comparison import Comparison
from ..device import get_device, on_gpu, sync
from ..mode import by_mode, quick_mode
from ..models import SpeedrunNet
from .portable import left_blank, source_of
from .timed_check import Duel, Trial, loaded_machine, pack_state, unpack_state


@functools.cache
def job() -> capstone.Sizes:
    """The job both versions train: lesson 08's as the lesson plans it on this machine (``gpulab.plans``: on a GPU in
    full mode, the network and images sized for the card, so that a T4's baseline trains in minutes; in quick mode
    ``capstone.QUICK_SIZES``, whose baseline takes a few seconds on one thread of a 2-core CPU and brings the network to
    about 95 % test accuracy, 82-98 % over seeds 0-5)."""
    quick = quick_mode()
    return plans.plan_for("08", plans.Card.here(quick=quick), quick=quick).job

# Accuracy may fall this far below the baseline's mean (or twice the spread of its runs, whichever is more): quick
# mode's short runs spread by several points from one seed to the next, and a broken step costs far more (labels
# shuffled, the normalisation forgotten or a larger batch without its learning rate: 10 to 80 points, tests show it).
ACCURACY_TOLERANCE = by_mode(full=0.03, quick=0.08)
# ... and the learner's version must be this many times faster. A CPU gains from batching the augmentation and from
# channels_last; its convolutions stay, which caps the gain: with three pairs the shown solution measured 1.36-2.15x
# (median 1.66x) on one thread of a 2-core CPU beside two busy processes, the unchanged baseline 0.82-1.34x: four
# pairs, and 1.35x asked. So judged, 20 checks of each beside two busy processes (grading_benchmarks/
# check_stability.py, 2026-11-28, the images counted on the device): the solution passed 20 of 20 (1.52-1.64x), the
# baseline 0 of 20 (0.87-1.09x).
# A GPU gains from all of lesson 08: the baseline's per-sample augmentation caps it at what one CPU core prepares,
# while the network has arithmetic to spare.
THRESHOLDS = {"cpu": 1.35, "cuda quick": 2.0, "cuda full": 3.0}


def threshold(device: torch.device) -> float:
    """The speed-up asked of the learner's version on this device, in this mode."""
    if not on_gpu(device):
        return THRESHOLDS["cpu"]
    return THRESHOLDS["cuda quick" if quick_mode() else "cuda full"]


def _warm_up(device: torch.device) -> None:
    """Start the device (CUDA context, cuDNN and cuBLAS handles) before anything is timed."""
    model = SpeedrunNet(job().widths).to(device)
    F.cross_entropy(model(torch.randn(8, 3, 32, 32, device=device)), torch.zeros(8, dtype=torch.long,
                                                                                  device=device)).backward()
    sync(device)


def _architecture(model: torch.nn.Module) -> list:
    modules = [[name, type(m).__name__] for name, m in model.named_modules()]
    return modules + [[name, list(p.shape)] for name, p in model.named_parameters()]


# ----- in the check's own processes: one trial of a training function, with what it trained counted ---------

WATERMARK = (12, 10, (255, 0, 255, 0))  # row, column, values: channel 0 of every training image, to see flips


def stamped(images: torch.Tensor) -> torch.Tensor:
    """The training images with a vertical watermark left of their centre: a horizontal flip moves it right."""
    row, column, values = WATERMARK
    images = images.clone()
    images[:, 0, row:row + len(values), column] = torch.tensor(values, dtype=torch.uint8)
    return images


def augmentation_seen(inputs: torch.Tensor) -> dict:
    """What the model was fed: the share of ``inputs`` that are padded crops (a constant border row or column,
    as zero padding makes), and of those showing the watermark, the share flipped. Unchanged by any
    per-channel normalisation."""
    x = inputs.float()
    low, high = x.amin(dim=(2, 3), keepdim=True), x.amax(dim=(2, 3), keepdim=True)
    tolerance = 0.01 * (high - low).clamp_min(1e-6)
    lines = [x[:, :, 0, :], x[:, :, -1, :], x[:, :, :, 0], x[:, :, :, -1]]
    constant = [((line.amax(-1) - line.amin(-1)) <= tolerance[..., 0, 0]).all(1) for line in lines]
    cropped = torch.stack(constant).any(0)
    top, bottom = (x[:, 0] - high[:, 0]).abs() <= tolerance[:, 0], (x[:, 0] - low[:, 0]).abs() <= tolerance[:, 0]
    pattern = top[:, :-3] & bottom[:, 1:-2] & top[:, 2:-1] & bottom[:, 3:]  # bright, dark, bright, dark, downwards
    _, column, _ = WATERMARK
    size = x.shape[-1]
    kept = pattern[:, :, column - 4:column + 5].flatten(1).any(1)
    flipped = pattern[:, :, size - 1 - column - 4:size - column + 4].flatten(1).any(1)
    marked = int((kept | flipped).sum())
    return {"inputs": len(x), "cropped": float(cropped.float().mean()) if len(x) else 0.0, "marked": marked,
            "flipped": float(flipped.sum()) / marked if marked else 0.0}


class TrainingWatch:
    """Hooks on the model a training function is given, keeping what it trained: the samples (forwards in training
    mode with gradients), the forward passes, the backward passes that reached each parameter, and the first two
    inputs of the last ``KEEP`` batches (to see the augmentation).

    They are kept on the device, by kernels the hooks launch with the step (a forward pre-hook adds the batch's size
    and a forward and copies its first inputs into a ring; a hook on each parameter's accumulated gradient notes the
    parameter in Python, and the one that completes a backward pass that reached every parameter adds one to all
    their counts: one kernel a step), so that they hold what the step consumed however the step is run: a step
    captured in a CUDA graph and replayed runs those kernels again with its own, where a Python hook never runs
    again (``torch.cuda.graph`` records every kernel launched on the capturing stream, the hooks' included:
    torch/cuda/graphs.py, ``graph``; a replay runs the recorded kernels only). A backward pass that reaches only
    some parameters is counted parameter by parameter when the next one repeats one of them, or at the end: a
    captured step counts the pass before it if that one reached only some, and its replays go uncounted if that one
    reached all (the backward passes then fall short of the forward passes, which the check rejects). In Python,
    where the hooks run: the weights' and inputs' dtypes, and a mark at the start of every epoch after the first,
    from the samples counted in Python (the parent's clock times the epochs from those marks; a replayed graph
    leaves none, and its whole run is timed, start-up included)."""

    KEEP = 256  # batches whose first two inputs are kept

    def __init__(self, model: torch.nn.Module, n_train: int, events, device: torch.device):
        self.model, self.n_train, self.events, self.device = model, n_train, events, device
        self.counts = torch.zeros(2, dtype=torch.int64, device=device)  # samples, forwards: on the device
        self.slots, self.inputs = torch.arange(2, device=device), None  # the ring of inputs, made at the first batch
        self.samples = self.epoch_start = 0  # counted in Python, where the hook runs: for the epoch marks
        self.epochs, self.weight_dtypes, self.input_dtypes = 1, set(), set()
        self.parameters = list(model.named_parameters())  # the objects hooked, by name
        self.first = self.parameters[0][1]
        self.gradients = torch.zeros(len(self.parameters), dtype=torch.int64, device=device)  # passes, per parameter
        self.pending: set[int] = set()  # the parameters the backward pass under way has reached
        self.handles = [model.register_forward_pre_hook(torch.compiler.disable(self._forward), with_kwargs=True)]
        self.handles += [parameter.register_post_accumulate_grad_hook(functools.partial(self._reached, i))
                         for i, (_, parameter) in enumerate(self.parameters)]

    def _forward(self, module, args, kwargs):
        if not (module.training and torch.is_grad_enabled()):
            return
        x = args[0] if args else next(iter(kwargs.values()))
        b = len(x)
        if self.inputs is None:
            self.inputs = torch.zeros(2 * self.KEEP, *x.shape[1:], device=self.device)
        if b >= 2 and x.shape[1:] == self.inputs.shape[1:]:  # kernels of the step, which a CUDA graph replays:
            ring = (self.counts[1] % self.KEEP) * 2 + self.slots  # where this batch's two inputs go, on the device
            self.inputs.index_copy_(0, ring, x[:2].detach().float())
        self.counts[0].add_(b)
        self.counts[1].add_(1)
        self.weight_dtypes.add(str(self.first.dtype).removeprefix("torch."))
        self.input_dtypes.add(str(x.dtype).removeprefix("torch."))
        if on_gpu(self.device) and torch.cuda.is_current_stream_capturing():
            return  # a capture runs nothing (its kernels are recorded), and may not wait for the GPU
        if self.samples - self.epoch_start + b > self.n_train:  # this batch overflows the epoch: it starts a new one
            sync(self.device)
            self.events.mark(epoch=self.epochs, samples=self.samples)
            self.epochs, self.epoch_start = self.epochs + 1, self.samples
        self.samples += b

    def _reached(self, index: int, parameter) -> None:
        if index in self.pending:  # a new backward pass: the last one reached only some parameters
            self._count_pending()
        self.pending.add(index)
        if len(self.pending) == len(self.parameters):  # every parameter: one kernel of the step
            self.gradients.add_(1)
            self.pending.clear()

    def _count_pending(self) -> None:
        for index in self.pending:
            self.gradients[index].add_(1)
        self.pending.clear()

    def facts(self) -> dict:
        for handle in self.handles:
            handle.remove()
        self._count_pending()
        samples, forwards = self.counts.tolist()
        gradients = dict(zip((name for name, _ in self.parameters), self.gradients.tolist()))
        now = dict(self.model.named_parameters())
        kept = self.inputs[:2 * min(forwards, self.KEEP)].cpu() if self.inputs is not None else torch.zeros(0, 3, 32, 32)
        return {"samples": samples, "forwards": forwards, "backwards": max(gradients.values(), default=0),
                "gradients": gradients, "replaced": [name for name, p in self.parameters if now.get(name) is not p],
                "epochs_seen": self.epochs if samples else 0, "weight_dtypes": sorted(self.weight_dtypes),
                "input_dtypes": sorted(self.input_dtypes), "augmentation": augmentation_seen(kept)}


class TrainingTask:
    """What the check's two processes run (``gpulab.questions.timed_check``): a fresh model and data set per seed."""

    baseline = staticmethod(capstone.slow_train)

    @staticmethod
    def namespace() -> dict:
        return {"__name__": "__answer__"}

    @staticmethod
    def warm_up() -> None:
        _warm_up(get_device())

    @staticmethod
    def trial(train, seed: int, events) -> dict:
        device = get_device()
        data = capstone.make_dataset(job().n_train, 0, seed=seed)
        empty = torch.zeros(0, dtype=torch.uint8)
        data = capstone.ImageData(stamped(data.train_images), data.train_labels, empty, empty.long())  # no test split
        torch.manual_seed(seed)
        model = SpeedrunNet(job().widths, seed=seed).to(device)
        watch = TrainingWatch(model, job().n_train, events, device)
        train(model, data, epochs=job().epochs, device=device)
        sync(device)
        events.done()
        return {"model": type(model).__name__, "architecture": _architecture(model), "state": pack_state(model),
                "final_dtypes": sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()}),
                **watch.facts()}


TASK = TrainingTask()


# ----- in the notebook's process: the trials judged ---------------------------------------------------------

# A few batches beyond the epochs asked for are a warm-up (a CUDA graph is captured after some, as lesson 08 does); an
# epoch more is not.
WARM_UP_EPOCHS = 0.5
PAIRS = 4  # interleaved pairs of trainings, and as many again when their interval straddles the threshold
MIN_BASELINE_ACCURACY = 0.6  # a baseline below this did not train properly on this machine: the check is void


def _check_faster(fast_train) -> str:
    if not callable(fast_train):
        raise Wrong("pass your function itself: `q1.check(fast_train)`")
    if left_blank(fast_train):
        raise NotImplementedError
    source = source_of(fast_train)
    seeds = [secrets.randbelow(2**31) for _ in range(2 * PAIRS)]  # new data and order every call
    with Duel(f"{__name__}:TASK", source, fast_train.__name__) as duel:
        first = _judged(duel.trial("answer", seeds[0]))  # what was trained, before the baseline runs
        pairs = [(_judged(duel.trial("baseline", seeds[0])), first)]  # answer first; the next pair baseline first
        pairs += _judged_pairs(duel.pairs(seeds[1:PAIRS]))
        if speed(pairs).reaches(threshold(get_device())) is None:  # too close to call: measure as many again
            pairs += _judged_pairs(duel.pairs(seeds[PAIRS:]))
    return judge(pairs, threshold(get_device()), loaded_machine())


def _judged(trial: Trial) -> Trial:
    """The trial, verified if it is the answer's, with the test accuracy of the model it trained (measured here,
    on its seed's test images)."""
    if trial.side == "answer":
        _verify(trial)
    trial.report["accuracy"] = _accuracy(trial)
    return trial


def _accuracy(trial: Trial) -> float:
    """The test accuracy of the weights a trial reported, on the test images of its seed."""
    test = capstone.make_dataset(job().n_train, job().n_test, seed=trial.seed)
    model = SpeedrunNet(job().widths)
    model.load_state_dict(unpack_state(trial.report["state"]))
    return capstone.evaluate(model, test.test_images, test.test_labels, "cpu")


def _judged_pairs(pairs):
    return [(_judged(baseline), _judged(answer)) for baseline, answer in pairs]


def _verify(trial: Trial) -> None:
    """Raise Wrong unless the answer's trial trained the model it was given, all of it, as the job says."""
    facts, epochs, n = trial.report, job().epochs, job().n_train
    if facts["model"] != "SpeedrunNet" or facts["architecture"] != _architecture(SpeedrunNet(job().widths)):
        raise Wrong("the model was changed: train the SpeedrunNet you are given, with its layers and shapes as they "
                    "are (a faster model is a different exercise)")
    if facts["samples"] == 0:
        raise Wrong("your function did not train the model it was given: no forward pass in training mode with "
                    "gradients reached it. Train that model object, in place")
    for when, dtypes in (("during training", facts["weight_dtypes"]), ("after your function", facts["final_dtypes"])):
        if dtypes != ["float32"]:
            raise Wrong(f"the weights were {' and '.join(dtypes)} {when}: keep them float32 and compute in lower "
                        "precision with torch.autocast (lesson 04)")
    if facts["samples"] < 0.97 * epochs * n:
        raise Wrong(f"your training fed the model {facts['samples']:,} images; {epochs} epochs of {n:,} are "
                    f"{epochs * n:,} (a partial last batch may be dropped): train on every image, every epoch")
    if facts["samples"] > (epochs + WARM_UP_EPOCHS) * n:
        raise Wrong(f"your training fed the model {facts['samples']:,} images, more than {epochs} epochs of {n:,}: "
                    "train exactly the epochs asked for")
    if facts["backwards"] < 0.97 * facts["forwards"]:
        raise Wrong(f"{facts['forwards']} training forward passes but {facts['backwards']} backward passes: every "
                    "batch needs its backward pass and optimizer step")
    untrained = left_out(facts, initial_parameters(trial.seed), unpack_state(facts["state"]))
    if untrained:
        raise Wrong(untrained)
    seen = facts["augmentation"]
    if seen["cropped"] < 0.5:
        raise Wrong(f"only {seen['cropped']:.0%} of the images your model was fed were padded crops: augment as the "
                    "baseline does, a random 32×32 crop of each image padded by 4 pixels (zeros)")
    if seen["marked"] < 0.25 * seen["inputs"] or not 0.2 <= seen["flipped"] <= 0.8:
        raise Wrong(f"{seen['flipped']:.0%} of the images your model was fed were flipped: flip each image "
                    "horizontally with probability ½, as the baseline does (crops of data.train_images, normalised "
                    "with capstone.normalize)")


# A parameter counts as moved when its change, less the part that rescales it, exceeds this share of the change and
# float32's rounding over the steps (this share of its size). The shown solution's quick-mode job on a CPU, seed 3
# (tests/test_lesson08.py): the stem, its gradients zeroed and its weight decay applied, kept 2.4e-5 of its change
# (2e-7 of its size); every trained parameter 0.85 of its change or more (0.025 of its size or more).
RESCALED, ROUNDING = 0.01, 1e-5


def initial_parameters(seed: int) -> dict[str, torch.Tensor]:
    """The weights a trial's model started from, built again here from its seed."""
    return {name: p.detach() for name, p in SpeedrunNet(job().widths, seed=seed).named_parameters()}


def unscaled_change(initial: torch.Tensor, final: torch.Tensor) -> tuple[float, float, float]:
    """The norms of a parameter's change less the part along its start (what rescaling it does), of its whole change,
    and of its start."""
    start, change = initial.double().flatten(), (final.double() - initial.double()).flatten()
    size = start.dot(start)
    rest = change - change.dot(start) / size * start if size > 0 else change
    return float(rest.norm()), float(change.norm()), float(size.sqrt())


def moved(initial: torch.Tensor, final: torch.Tensor) -> bool:
    """Whether a parameter ended somewhere other than where it started or a multiple of it (``RESCALED``). One that
    is no longer finite moved: training diverged, and the accuracy says so."""
    if not final.isfinite().all():
        return True
    rest, change, size = unscaled_change(initial, final)
    return rest > RESCALED * change + ROUNDING * size


def left_out(facts: dict, initial: dict, final: dict) -> str | None:
    """One line naming the parameters a training left out, or None when it trained every one. A parameter is trained
    when all of these hold:

    1. It received a gradient in every backward pass (97 % of them at least): autograd accumulated one into it, as
       the watch's post-accumulate-grad hooks count on the device, a replayed CUDA graph included.
       ``requires_grad_(False)``, ``.detach()`` or ``torch.no_grad()`` on part of the model leave a parameter without
       one, in every step or in some.
    2. The optimizer applied it: the parameter ended neither where it started nor at a multiple of that (``moved``).
       A gradient computed but not applied (the parameter left out of the optimizer, a learning rate of 0, the
       gradient zeroed or dropped before the step), or weights put back after training, leave it where it started or
       where weight decay alone takes it: SGD's and AdamW's multiply a parameter by a factor each step, gradient or
       none.
    3. It is still the tensor the model was given (one put in its place is not counted).

    ``initial`` is built again from the trial's seed in the check's process; ``final`` holds the weights it reported."""
    backwards, replaced, total = facts["backwards"], facts["replaced"], len(initial)
    starved = {name: n for name, n in facts["gradients"].items() if n < 0.97 * backwards and name not in replaced}
    unmoved = [name for name in initial
               if name not in starved and name not in replaced and not moved(initial[name], final[name])]
    said = []
    if replaced:
        said.append(f"{_names(replaced, total)} {'were' if len(replaced) > 1 else 'was'} replaced by "
                    f"{'new tensors' if len(replaced) > 1 else 'a new tensor'}")
    if starved:
        low, high = min(starved.values()), max(starved.values())
        said.append(f"{_names(starved, total)} had a gradient in {low if low == high else f'{low} to {high}'} of "
                    f"{backwards} backward passes")
    if unmoved:
        said.append(f"{_names(unmoved, total)} ended where {'they' if len(unmoved) > 1 else 'it'} started or at a "
                    "multiple of it (as weight decay alone leaves a parameter)")
    if not said:
        return None
    return (f"parameters left out of training: {'; '.join(said)}. Train the whole model you were given, every step: "
            "no requires_grad_(False), .detach() or torch.no_grad() on part of it, every parameter in the optimizer "
            "with a learning rate above 0, and keep the trained weights")


def _names(names, total: int) -> str:
    """Parameter names, compactly: a module's together (``net.1 (weight, bias)``), at most six modules."""
    names = list(names)
    if len(names) == total:
        return f"all {total} parameters"
    modules: dict[str, list[str]] = {}
    for name in names:
        module, _, leaf = name.rpartition(".")
        modules.setdefault(module, []).append(leaf)
    said = [f"{m}.{leaves[0]}" if len(leaves) == 1 else f"{m} ({', '.join(leaves)})" for m, leaves in modules.items()]
    return ", ".join(said[:6]) + (f" and those of {len(said) - 6} more modules" if len(said) > 6 else "")


def _marked(trial: Trial) -> bool:
    """Whether the trial marked where its second epoch started (its hooks ran in Python then)."""
    return any(m.get("epoch") == 1 for _, m in trial.marks)


def steady_seconds_per_sample(trial: Trial) -> float:
    """Seconds per training image after the first epoch (start-up: workers, compilation, cuDNN's search)."""
    marks = [(t, m) for t, m in trial.marks if m.get("epoch") == 1]
    if not marks:
        return trial.seconds / max(trial.report.get("samples", 0), 1)
    t, mark = marks[0]
    return (trial.seconds - t) / max(trial.report["samples"] - mark["samples"], 1)


def startup_seconds(trial: Trial) -> float:
    """How much longer the first epoch took than a steady one."""
    marks = [(t, m) for t, m in trial.marks if m.get("epoch") == 1]
    if not marks:
        return 0.0
    t, mark = marks[0]
    return max(t - mark["samples"] * steady_seconds_per_sample(trial), 0.0)


def speed(pairs) -> Comparison:
    """The answer's steady-state speed-up over the baseline, pair by pair."""
    return Comparison.of([steady_seconds_per_sample(b) for b, _ in pairs],
                         [steady_seconds_per_sample(a) for _, a in pairs], labels=("slow_train", "yours"))


def judge(pairs, needed: float, caveat: str | None = None) -> str:
    """The verdict on verified trials: accuracy kept against the baseline's spread, then the speed-up. Accuracies
    are compared by their medians: quick mode's short runs now and then land far below the rest (an unlucky start),
    on either side, and one such run must not decide."""
    base = [b.report["accuracy"] for b, _ in pairs]
    yours = [a.report["accuracy"] for _, a in pairs]
    base_mid, yours_mid = statistics.median(base), statistics.median(yours)
    spread = statistics.stdev(base) if len(base) > 1 else 0.0
    floor = base_mid - max(ACCURACY_TOLERANCE, 2 * spread)
    if base_mid < MIN_BASELINE_ACCURACY:
        raise Wrong(f"the baseline itself reached only {base_mid:.0%} test accuracy on this machine, so the check "
                    "cannot judge yours: run it again (and tell the course if this repeats)")
    comparison = speed(pairs)
    startup = statistics.median(startup_seconds(a) for _, a in pairs)
    counted = (f"your start-up, not counted: {startup:.2f} s" if all(_marked(a) for _, a in pairs) else
               "your start-up counted: your epochs left no marks, as a replayed CUDA graph runs no Python hook")
    said = (f"steady-state speed-up {comparison.speedup:.2f}× (median; {min(comparison.ratios):.2f}–"
            f"{max(comparison.ratios):.2f}× over {comparison.pairs} interleaved pairs of trainings; {counted}); median "
            f"test accuracy {yours_mid:.1%} vs the baseline's {base_mid:.1%}")
    note = f" Note: {caveat}." if caveat else ""
    if yours_mid < floor:
        raise Wrong(f"accuracy fell below the baseline's: {said}; the floor is {floor:.1%}. Same epochs: a larger "
                    "batch takes fewer steps, so raise the learning rate with it (k times for k times the batch, with "
                    f"the warm-up; quick mode's few steps may want the baseline's batch of {capstone.SIZES.batch}). "
                    f"Check the normalisation (capstone.normalize) and that each image keeps its label.{note}")
    device = get_device()
    if comparison.speedup < needed:
        kind, mode = "GPU" if on_gpu(device) else "CPU", "quick" if quick_mode() else "full"
        raise Wrong(f"not fast enough: {said}; on a {kind} in {mode} mode the check asks for {needed:g}×. Find where "
                    "the baseline's time goes (lessons 02, 03, 06)." + note)
    return (f"{said}. The same model, all of it trained, on every image, the accuracy kept, {comparison.speedup:.2f}× "
            f"faster.{note}")


q1 = Question(
    lesson="08", number=1, title="make the training job faster",
    checker=_check_faster,
    hint_text="Time the baseline's parts first: on a CPU much of it is the per-sample augmentation in the main "
              "process. Move the uint8 images to the device once, crop and flip a whole batch at a time with tensor "
              "indexing, keep .item() out of the loop, use channels_last (faster convolutions on CPUs too), and keep "
              "the recipe (SGD with Nesterov momentum, capstone.lr_at's schedule, label smoothing). On a GPU add bf16 "
              "autocast where the GPU has it natively, fused SGD and torch.compile. A larger batch takes fewer steps "
              "in the same epochs: raise the learning rate with it, or keep the baseline's.",
    solution_text='''
def fast_train(model, data, *, epochs, device, batch_size=capstone.SIZES.batch, lr=capstone.SIZES.lr):
    device = torch.device(device)
    on_gpu = gpulab.on_gpu(device)
    images = F.pad(data.train_images, (4, 4, 4, 4)).to(device)  # uint8, padded for the crops, moved once
    labels = data.train_labels.to(device)
    model = model.to(memory_format=torch.channels_last)  # NHWC: faster convolutions on GPUs and on CPUs
    use_bf16 = on_gpu and torch.cuda.is_bf16_supported(including_emulation=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=capstone.MOMENTUM, nesterov=True,
                                weight_decay=capstone.WEIGHT_DECAY, fused=on_gpu)
    n, size = len(labels), data.train_images.shape[-1]
    pixels = torch.arange(size, device=device)
    channels = torch.arange(3, device=device)[None, :, None, None]
    step, total = 0, epochs * (n // batch_size)
    model.train()
    for _ in range(epochs):
        order = torch.randperm(n, device=device)
        for index in order[: n // batch_size * batch_size].view(-1, batch_size):
            # a random 32×32 crop of each padded image, and a random flip, for the whole batch at once
            dy, dx = torch.randint(0, 9, (2, batch_size, 1), device=device)
            flip = torch.rand(batch_size, 1, device=device) < 0.5
            cols = torch.where(flip, size - 1 - pixels, pixels) + dx
            x = images[index[:, None, None, None], channels, (pixels + dy)[:, None, :, None], cols[:, None, None, :]]
            x = capstone.normalize(x, data.mean, data.std).contiguous(memory_format=torch.channels_last)
            for group in optimizer.param_groups:
                group["lr"] = capstone.lr_at(step, total, lr)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16):
                loss = F.cross_entropy(model(x), labels[index], label_smoothing=capstone.LABEL_SMOOTHING)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
''',
)
