"""Lesson 04 (mixed precision): precision helpers, the GradScaler checkpoint round trip, the teacher task,
the roofline figure, the exercise checks (right passes, plausible wrong is rejected, blank is not attempted), the
lesson's plan, and the loss-scaling demonstration on this CPU."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from gpulab import plots, precision, tasks  # noqa: E402
from gpulab.check import CORRECT, NOT_ATTEMPTED, WRONG, ____  # noqa: E402
from gpulab.memory import MemoryTracker  # noqa: E402
from gpulab.questions.lesson04 import q1, q2, q3, q4  # noqa: E402

from .conftest import shown_solution  # noqa: E402
from .test_lesson00 import stack_walker  # noqa: E402


def status(question, *answers) -> str:
    question.check(*answers)
    return question.last.status


# ---- precision helpers ----------------------------------------------------------------------------------------


def test_flops_throughput_and_intensity():
    assert precision.matmul_flops(2, 3, 4) == 48
    assert precision.tflops(3e12, 1.5) == pytest.approx(2.0)
    assert precision.matmul_intensity(1024, 1024, 1024, 2) == pytest.approx(2 * 1024 / (3 * 2))
    assert precision.matmul_intensity(64, 64, 64, 2) == pytest.approx(2 * precision.matmul_intensity(64, 64, 64, 4))


def test_precision_support_follows_compute_capability():
    cpu = precision.precision_support(None)
    assert [p for p, s in cpu.items() if s.available] == ["fp32", "bf16"]
    t4 = precision.precision_support((7, 5))
    assert t4["fp16"].available and not t4["bf16"].available and not t4["tf32"].available
    assert "7.5" in t4["bf16"].note and "emulated" in t4["bf16"].note
    assert all(s.available for s in precision.precision_support((8, 0)).values())
    assert all(s.available for s in precision.precision_support((9, 0)).values())
    pascal = precision.precision_support((6, 1))
    assert pascal["fp16"].available and "without tensor cores" in pascal["fp16"].note


def test_device_support_and_measured_peak_here():
    here = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cc = torch.cuda.get_device_capability() if here.type == "cuda" else None
    assert precision.device_support(here) == precision.precision_support(cc)
    peak, n = precision.measured_peak(torch.float32, here, n=64)
    assert n == 64 and peak > 0


def test_matmul_peak_times_its_products_on_the_stream_of_the_device_measured(monkeypatch):
    """With cuda:1 measured while cuda:0 is current, events recorded on the current stream would time only the
    launches: they go on cuda:1's stream, where the products run, and the last one is waited for."""
    streams, waited = [], []

    class Event:
        def __init__(self, enable_timing=False, **_):
            pass

        def record(self, stream=None):
            streams.append(stream)  # None: the current device's current stream

        def synchronize(self):
            waited.append(self)

        def elapsed_time(self, end):
            return 2.0

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: ("stream of", torch.device(device).index))
    calls = []
    times = precision.timed_calls(lambda: calls.append(1), 3, torch.device("cuda", 1))
    assert calls == [1, 1, 1] and times == [0.002] * 3
    assert streams == [("stream of", 1)] * 4 and len(waited) == 1
    assert precision.timed_calls(lambda: None, 2, torch.device("cpu")) and streams == [("stream of", 1)] * 4


# ---- checkpoints keep the GradScaler's state ------------------------------------------------------------------


def _run(seed=0, **scaler_kwargs):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt, torch.amp.GradScaler("cpu", **scaler_kwargs)


def _step(model, opt, scaler, x, y, overflow=False):
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    if overflow:  # what an fp16 overflow leaves behind
        model[0].weight.grad[0, 0] = float("inf")
    scaler.step(opt)
    scaler.update()


def test_gradscaler_checkpoint_round_trip(tmp_path):
    x, y = torch.randn(32, 8), torch.randint(3, (32,))
    model, opt, scaler = _run(init_scale=2.0**20, growth_interval=3)
    for i in range(5):
        _step(model, opt, scaler, x, y, overflow=i == 2)
    assert scaler.get_scale() == 2.0**19 and scaler.state_dict()["_growth_tracker"] == 2  # not the defaults

    path = precision.save_checkpoint(tmp_path / "ckpt.pt", model, opt, scaler, step=5)
    model2, opt2, scaler2 = _run(seed=1)  # other weights, default scaler
    assert precision.load_checkpoint(path, model2, opt2, scaler2) == {"step": 5}
    assert scaler2.state_dict() == scaler.state_dict()
    assert scaler2.get_scale() == scaler.get_scale()

    _step(model, opt, scaler, x, y)  # the next step: scale grows (tracker reaches 3) in both runs
    _step(model2, opt2, scaler2, x, y)
    assert scaler.get_scale() == scaler2.get_scale() == 2.0**20
    assert scaler.state_dict() == scaler2.state_dict()
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


def test_checkpoint_without_scaler_state_is_refused(tmp_path):
    model, opt, _ = _run()
    path = precision.save_checkpoint(tmp_path / "no_scaler.pt", model, opt)
    with pytest.raises(ValueError, match="no GradScaler state"):
        precision.load_checkpoint(path, model, opt, torch.amp.GradScaler("cpu"))
    assert precision.load_checkpoint(path, model, opt) == {}


@pytest.mark.gpu
def test_fp16_run_on_the_gpu_resumes_identically(tmp_path):
    """The lesson's recipe on CUDA: fp16 autocast + GradScaler("cuda"), checkpoint, identical next step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 10)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**30, growth_interval=2)
    x, y = torch.randn(128, 64, device="cuda"), torch.randint(10, (128,), device="cuda")

    def step(model, opt, scaler):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    start = [p.detach().clone() for p in model.parameters()]
    for _ in range(16):
        step(model, opt, scaler)
    assert scaler.get_scale() < 2.0**30  # 2^30 overflowed fp16: skipped steps, then real ones
    assert not all(torch.equal(a, b) for a, b in zip(start, model.parameters()))
    path = precision.save_checkpoint(tmp_path / "gpu.pt", model, opt, scaler)
    model2 = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 10)).cuda()
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    scaler2 = torch.amp.GradScaler("cuda")
    precision.load_checkpoint(path, model2, opt2, scaler2)
    assert scaler2.state_dict() == scaler.state_dict()
    step(model, opt, scaler)
    step(model2, opt2, scaler2)
    assert scaler.state_dict() == scaler2.state_dict()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
    assert precision.device_support()["bf16"].available == torch.cuda.is_bf16_supported(including_emulation=False)


# ---- the teacher task is learnable ----------------------------------------------------------------------------


def test_teacher_task_is_deterministic_and_learnable():
    task = tasks.teacher_task(4096, 2000, seed=0)
    again = tasks.teacher_task(4096, 2000, seed=0)
    assert torch.equal(task.x_train, again.x_train) and torch.equal(task.y_test, again.y_test)
    first = [y for _, y in task.batches(64, 3, seed=1)]
    assert all(torch.equal(a, b) for a, b in zip(first, [y for _, y in again.batches(64, 3, seed=1)]))
    assert task.chance() < 0.3  # no class dominates

    torch.manual_seed(0)
    model = tasks.student_mlp(task.dim, 64, 2, task.classes)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    before = task.accuracy(model)
    for x, y in task.batches(128, 150, seed=1):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = task.accuracy(model)
    assert after > 0.45 and after > 2 * task.chance() and after > before + 0.2


# ---- peak memory per precision, from a clean state -----------------------------------------------------------


def _memory_runs(device="cpu"):
    """start(precision) and step(run) for training a small MLP with AdamW, as the lesson does. The first step of
    the process also allocates a one-time 1 MiB workspace, as cuBLAS does at its first matmul."""
    workspace = []
    x, y = torch.randn(32, 32, device=device), torch.randint(10, (32,), device=device)

    def start(p):
        torch.manual_seed(0)
        model = tasks.student_mlp(32, 64, 2, 10).to(device)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3), {"fp32": None, "bf16": torch.bfloat16}[p]

    def step(run):
        model, opt, amp_dtype = run
        if not workspace:
            workspace.append(torch.empty(2**20, dtype=torch.uint8, device=device))
        with torch.autocast(torch.device(device).type, dtype=amp_dtype or torch.bfloat16, enabled=amp_dtype is not None):
            loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return start, step, workspace


def _clean_peaks(order, device="cpu"):
    start, step, _ = _memory_runs(device)
    peaks, kept = {}, []
    for p in order:
        peaks[p] = tasks.training_peak_memory(lambda p=p: start(p), step, device=device)
        kept.append(start(p))  # the notebook keeps earlier runs alive: that must not change the next measurement
    return peaks


def _baseline_first_peaks(order):
    """The old measurement: baseline read before each run is built, while the previous run is still alive."""
    start, step, _ = _memory_runs()
    peaks = {}
    with MemoryTracker() as card:  # the CPU's stand-in for the CUDA allocator, over the whole loop
        run = None
        for p in order:
            base = card.current
            card.reset_peak()
            run = start(p)  # the previous run's AdamW state is freed here, after the baseline
            for _ in range(3):
                step(run)
            peaks[p] = card.peak - base
    return peaks


def test_peak_memory_per_precision_does_not_depend_on_run_order():
    assert _clean_peaks(["fp32", "bf16"]) == _clean_peaks(["bf16", "fp32"])
    old = _baseline_first_peaks(["fp32", "bf16"]), _baseline_first_peaks(["bf16", "fp32"])
    assert old[0] != old[1]  # the old way did depend on it: this test can tell


def test_peak_memory_counts_weights_gradients_optimizer_state_and_activations():
    start, step, workspace = _memory_runs()
    peak = tasks.training_peak_memory(lambda: start("fp32"), step)
    weights = sum(p.numel() * 4 for p in start("fp32")[0].parameters())
    assert peak > 4 * weights  # weights, gradients, AdamW's two moments, and activations on top
    assert peak < 2**20  # ... but not the one-time 1 MiB workspace: the throw-away run made it
    assert workspace


@pytest.mark.gpu
def test_peak_memory_on_the_gpu_does_not_depend_on_run_order():
    assert _clean_peaks(["fp32", "bf16"], "cuda") == _clean_peaks(["bf16", "fp32"], "cuda")


# ---- the roofline figure ---------------------------------------------------------------------------------------


def test_roofline_draws_points_roofs_and_memory_slope():
    import pandas as pd

    frame = pd.DataFrame({"precision": ["fp32", "fp32", "bf16", "bf16"], "intensity": [10, 100, 20, 200],
                          "tflops": [5, 40, 10, 300]})
    ax = plots.roofline(frame, peaks={"fp32": 50, "bf16": 600}, datasheet={"fp32": 67, "bf16": None},
                        bandwidth_gbs=2000, title="t")
    assert ax.get_xscale() == ax.get_yscale() == "log"
    # 2 sweeps + 2 measured roofs + 1 datasheet roof (None skipped) + the memory slope
    assert len(ax.get_lines()) == 6
    labels = {t.get_text() for t in ax.get_legend().get_texts()}
    assert {"fp32", "bf16", "measured peak (fastest matmul)", "datasheet peak (vendor)"} <= labels
    slope = [line for line in ax.get_lines() if line.get_label().startswith("memory roof")][0]
    assert max(slope.get_ydata()) <= 600 * 1.0001  # the slope stops at the highest roof


# ---- exercise checks --------------------------------------------------------------------------------------------


M, N, K, SECONDS = 384, 256, 1024, 0.004


def test_q1_tflops():
    assert status(q1, 2 * M * N * K / SECONDS / 1e12, M, N, K, SECONDS) == CORRECT
    assert status(q1, torch.tensor(2.0 * M * N * K) / SECONDS / 1e12, M, N, K, SECONDS) == CORRECT  # a 0-d tensor
    assert status(q1, 2 * M * K * N * 1e-12 / SECONDS, M, N, K, SECONDS) == CORRECT  # in another order
    assert status(q1, ____, M, N, K, SECONDS) == NOT_ATTEMPTED


@pytest.mark.parametrize("tflops, says", [
    (M * N * K / SECONDS / 1e12, "2 FLOPs"),
    (2 * M * N * K / SECONDS / 1e9, "GFLOP/s"),
    (2 * M * N * K / SECONDS, "that is FLOP/s"),
    (2 * M * N * K / (SECONDS * 1e3) / 1e12, "`seconds` is in seconds"),
    (2 * M * N * K / SECONDS / 2**40, "not 2⁴⁰"),
    (2 * M**3 / SECONDS / 1e12, "not square"),
    (2 * M * K * K / SECONDS / 1e12, "not square"),
    (2 * N**3 / SECONDS / 1e12, "not square"),
    (1.0, "expected the throughput"),
])
def test_q1_rejects(tflops, says):
    assert status(q1, tflops, M, N, K, SECONDS) == WRONG
    assert says in q1.last.message


# ---- q2: a training step, observed ----------------------------------------------------------------------------

train_step = shown_solution(q2, "train_step", torch=torch, F=F)


def step_without_scaler_step(model, optimizer, scaler, x, y, device_type, dtype):
    with torch.autocast(device_type, dtype=dtype):
        loss = F.cross_entropy(model(x), y)
    optimizer.zero_grad()
    scaler.scale(loss).backward()
    optimizer.step()
    scaler.update()
    return loss.detach()


def step_backward_unscaled(model, optimizer, scaler, x, y, device_type, dtype):
    with torch.autocast(device_type, dtype=dtype):
        loss = F.cross_entropy(model(x), y)
    optimizer.zero_grad()
    scaler.scale(loss)
    loss.backward()
    scaler.step(optimizer)
    scaler.update()
    return loss.detach()


def step_without_autocast(model, optimizer, scaler, x, y, device_type, dtype):
    loss = F.cross_entropy(model(x), y)
    optimizer.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    return loss.detach()


def step_without_zero_grad(model, optimizer, scaler, x, y, device_type, dtype):
    with torch.autocast(device_type, dtype=dtype):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    return loss.detach()


def step_without_update(model, optimizer, scaler, x, y, device_type, dtype):
    with torch.autocast(device_type, dtype=dtype):
        loss = F.cross_entropy(model(x), y)
    optimizer.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    return loss.detach()


def step_with(autocast_args, finish=lambda loss: loss.detach()):
    """The right step, except for the autocast it opens and what it returns."""
    def step(model, optimizer, scaler, x, y, device_type, dtype):
        with torch.autocast(**autocast_args(device_type, dtype)):
            loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        return finish(loss)
    return step


def print_loss(loss):
    print(f"loss {loss:.3f}")
    return loss.detach()


def unusual_but_right_step(model, optimizer, scaler, x, y, device_type, dtype):
    """Keyword arguments, torch.amp.autocast, zero_grad before the forward pass, a detached loss."""
    optimizer.zero_grad()
    with torch.amp.autocast(device_type=device_type, dtype=dtype, enabled=True):
        logits = model(x)
        loss = F.cross_entropy(logits, y)
    scaled = scaler.scale(loss)
    scaled.backward()
    scaler.step(optimizer)
    scaler.update()
    return loss.detach().clone()


def step_zero_grad_after_backward(model, optimizer, scaler, x, y, device_type, dtype):
    """Plausible but wrong: the gradients are cleared between backward() and the step."""
    with torch.autocast(device_type, dtype=dtype):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    optimizer.zero_grad()
    scaler.step(optimizer)
    scaler.update()
    return loss.detach()


def step_backward_inside_autocast(model, optimizer, scaler, x, y, device_type, dtype):
    """Unusual but right: backward inside the autocast block (autocast leaves backward alone), no detach."""
    optimizer.zero_grad(set_to_none=False)
    with torch.autocast(device_type=device_type, dtype=dtype):
        loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()
    return loss


def unfinished_step(model, optimizer, scaler, x, y, device_type, dtype):
    raise NotImplementedError


@pytest.mark.parametrize("wrong, says", [
    (step_without_scaler_step, "scaler.step(optimizer)"),
    (step_backward_unscaled, "unscaled loss"),
    (step_without_autocast, "torch.autocast"),
    (step_without_zero_grad, "zero_grad"),
    (step_without_update, "scaler.update()"),
    (step_with(lambda d, t: dict(device_type=d, dtype=torch.bfloat16)), "use the `dtype` you are given"),
    (step_with(lambda d, t: dict(device_type="cpu", dtype=t)), "you ignored `device_type`"),
    (step_with(lambda d, t: dict(device_type=d, dtype=t), finish=lambda loss: loss.item()), "item"),
    (step_with(lambda d, t: dict(device_type=d, dtype=t), finish=print_loss), "__format__"),
    (step_with(lambda d, t: dict(device_type=d)), "use the `dtype` you are given"),  # autocast's default dtype
    (step_zero_grad_after_backward, "ran after the backward pass"),
])
def test_q2_rejects_plausible_wrong_steps(wrong, says):
    assert status(q2, wrong) == WRONG
    assert says in q2.last.message


def test_q2_train_step():
    assert status(q2, train_step) == CORRECT
    assert status(q2, unusual_but_right_step) == CORRECT
    assert status(q2, step_backward_inside_autocast) == CORRECT
    assert status(q2, unfinished_step) == NOT_ATTEMPTED


def test_q2_solution_trains_with_a_real_gradscaler():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    x, y = torch.randn(8, 4), torch.randint(2, (8,))
    losses = [train_step(model, opt, scaler, x, y, "cpu", torch.bfloat16).item() for _ in range(20)]
    assert losses[-1] < losses[0]


# ---- q3: fp16 underflow ---------------------------------------------------------------------------------------


def underflow_share(grads, scale):
    nonzero = grads != 0
    return (((grads * scale).half() == 0) & nonzero).sum().item() / nonzero.sum().item()


def underflow_share_unusual(grads, scale):
    """Unusual but right: count with torch.count_nonzero, cast with .to(), return a 0-d tensor."""
    nonzero = torch.count_nonzero(grads)
    lost = torch.count_nonzero((grads * scale).to(torch.float16) == 0) - (grads.numel() - nonzero)
    return lost / nonzero


def share_with_exact_zeros(grads, scale):
    return ((grads * scale).half() == 0).float().mean().item()


def share_below_smallest_normal(grads, scale):
    nonzero = grads != 0
    small = (grads * scale).abs() < torch.finfo(torch.float16).tiny
    return ((small & nonzero).sum() / nonzero.sum()).item()


def share_below_smallest_subnormal(grads, scale):
    nonzero = grads != 0
    return (((grads * scale).abs() < 2.0**-24) & nonzero).float().sum().item() / nonzero.sum().item()


def share_without_scale(grads, scale):
    return underflow_share(grads, 1.0)


def share_of_all_gradients(grads, scale):
    return (((grads * scale).half() == 0) & (grads != 0)).float().mean().item()


def share_in_bf16(grads, scale):
    nonzero = grads != 0
    return (((grads * scale).bfloat16() == 0) & nonzero).sum().item() / nonzero.sum().item()


def share_in_percent(grads, scale):
    return 100 * underflow_share(grads, scale)


def test_q3_underflow_share():
    assert status(q3, underflow_share) == CORRECT
    assert status(q3, underflow_share_unusual) == CORRECT
    assert status(q3, share_with_exact_zeros) == WRONG
    assert "non-zero" in q3.last.message
    assert status(q3, share_below_smallest_normal) == WRONG
    assert "subnormal" in q3.last.message
    assert status(q3, share_below_smallest_subnormal) == WRONG  # fp16 rounds, it does not truncate
    assert "rounds to the nearest" in q3.last.message
    for wrong, says in ((share_without_scale, "by `scale` before the cast"),
                        (share_of_all_gradients, "not by all of them"),
                        (share_in_bf16, "bf16 keeps fp32's range"),
                        (share_in_percent, "not a percentage")):
        assert status(q3, wrong) == WRONG and says in q3.last.message, wrong.__name__
    assert status(q3, ____) == NOT_ATTEMPTED


# ---- q4: AMP with gradient accumulation and clipping ----------------------------------------------------------

accumulation_step = shown_solution(q4, "accumulation_step", torch=torch, F=F)


def accumulation(*, clip="after unscale", divide=True, zero="before", step_inside=False, update_inside=False,
                 read_loss=False, one_backward=False, autocast_dtype=None, unscale_inside=False, returned="mean"):
    """The recipe with one thing changed, as a learner might get it wrong."""
    def step(model, optimizer, scaler, micro_batches, max_norm, device_type, dtype):
        k = len(micro_batches)
        if zero == "before":
            optimizer.zero_grad()
        losses, total = [], 0
        for x, y in micro_batches:
            if zero == "inside":
                optimizer.zero_grad()
            with torch.autocast(device_type, dtype=autocast_dtype or dtype):
                loss = F.cross_entropy(model(x), y)
            if read_loss:
                losses.append(loss.item())
            else:
                losses.append(loss.detach())
            if one_backward:
                total = total + loss / k
                continue
            scaler.scale(loss / k if divide else loss).backward()
            if unscale_inside:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            if step_inside:  # a training step per micro-batch
                scaler.step(optimizer)
                scaler.update()
            elif update_inside:
                scaler.update()
        if one_backward:
            scaler.scale(total).backward()
        if clip == "before unscale":
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            scaler.unscale_(optimizer)
        elif clip == "without unscale":
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        elif clip == "after unscale" and not unscale_inside and not step_inside:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        if not step_inside:
            scaler.step(optimizer)
        if not update_inside and not step_inside:
            scaler.update()
        if read_loss:
            return torch.tensor(losses).mean()
        return {"mean": lambda: torch.stack(losses).mean(), "of divided": lambda: torch.stack(losses).mean() / k,
                "last": lambda: losses[-1]}[returned]()
    return step


def accumulation_unusual(model, optimizer, scaler, micro_batches, max_norm, device_type, dtype):
    """Unusual but right: divide after scaling, clip with foreach, sum the losses into a tensor."""
    for p in model.parameters():
        p.grad = None
    total = torch.zeros(())
    for x, y in micro_batches:
        with torch.autocast(device_type=device_type, dtype=dtype):
            loss = F.cross_entropy(model(x), y)
        (scaler.scale(loss) / len(micro_batches)).backward()
        total += loss.detach().float()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(list(model.parameters()), max_norm, foreach=True)
    scaler.step(optimizer)
    scaler.update()
    return total / len(micro_batches)


@pytest.mark.parametrize("wrong, says", [
    (accumulation(clip="before unscale"), "clipped the *scaled* gradients"),
    (accumulation(clip="without unscale"), "clipped the *scaled* gradients"),
    (accumulation(clip="never"), "not clipped"),
    (accumulation(unscale_inside=True), "called again before `scaler.update()`"),
    (accumulation(divide=False), "too large"),
    (accumulation(zero="inside"), "only the last micro-batch"),
    (accumulation(zero="never"), "previous step"),
    (accumulation(step_inside=True), "stepped 4 times"),
    (accumulation(update_inside=True), "`scaler.update()` once"),
    (accumulation(read_loss=True), "item"),
    (accumulation(one_backward=True), "keeps every micro-batch's activations alive"),
    (accumulation(autocast_dtype=torch.float16), "use the `dtype` you are given"),
    (accumulation(returned="of divided"), "the mean of `loss / k`"),
    (accumulation(returned="last"), "the last micro-batch's loss"),
])
def test_q4_rejects_plausible_wrong_accumulation(wrong, says):
    assert status(q4, wrong) == WRONG
    assert says in q4.last.message


def test_q4_accumulation_step():
    assert status(q4, accumulation_step) == CORRECT
    assert status(q4, accumulation()) == CORRECT  # the test's own recipe, unchanged
    assert status(q4, accumulation_unusual) == CORRECT
    assert status(q4, unfinished_step) == NOT_ATTEMPTED


def test_stack_walking_answers_find_no_expected_value():
    def tensors(value):
        return isinstance(value, torch.Tensor) or isinstance(value, list) and value and isinstance(value[0], torch.Tensor)

    def loss_found(right):
        """The recipe, except that the loss it returns is a tensor it found on the stack (7 when it finds none)."""
        def use(found, *args):
            right(*args)
            return next(f for f in found if isinstance(f, torch.Tensor) and f.numel() == 1)
        return stack_walker(use, lambda *args: right(*args) * 0 + 7, tensors)

    walkers = [  # (question, a walker)
        (q2, loss_found(train_step)),
        (q3, stack_walker(lambda found, grads, scale: found[0], lambda grads, scale: 0.5,
                          lambda v: isinstance(v, float))),
        (q4, loss_found(accumulation_step)),
    ]
    for question, walker in walkers:
        assert status(question, walker) == WRONG and walker.calls and walker.found == [], question.name


def test_q4_solution_trains_with_a_real_gradscaler():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    scaler = torch.amp.GradScaler("cpu")
    micro = [(torch.randn(8, 4), torch.randint(2, (8,))) for _ in range(4)]
    losses = [accumulation_step(model, opt, scaler, micro, 1.0, "cpu", torch.bfloat16).item() for _ in range(20)]
    assert losses[-1] < losses[0]


# ---- the lesson's plan (gpulab/plans/plan04.py) ----------------------------------------------------------------

QUICK_SIZES = dict(sweep_sizes=[32, 64, 128], sweep_min_time=0.02, compare_min_time=0.2, compare_pairs=5, aligned_n=256,
                   width=128, depth=2, batch=256, steps=150, points=8192, step_min_time=0.05, scaler_steps=40,
                   growth_interval=3)  # the lesson's quick-mode sizes before it was planned (gpulab.by_mode)
SIX = ["Tesla T4", "NVIDIA L4", "NVIDIA GeForce RTX 4060 Laptop GPU", "NVIDIA A100-SXM4-40GB", "NVIDIA H100 80GB HBM3",
       "NVIDIA H200"]


def cpu_card():
    from gpulab import plans

    return plans.Card("CPU", None, 2, 0)


@pytest.mark.parametrize("name", ["CPU", "Tesla T4", "NVIDIA L4", "NVIDIA H200"])
def test_quick_mode_keeps_its_sizes_and_the_card_chooses_the_precisions(name):
    from gpulab import plans

    card = cpu_card() if name == "CPU" else plans.Card.named(name)
    plan = plans.plan_for("04", card, quick=True)
    assert {k: plan.sizes[k] for k in QUICK_SIZES} == QUICK_SIZES
    assert plan.underflow_points == plan.points  # the mean loss of section 4 over every training point
    assert plan.precisions == {"CPU": ["fp32", "bf16"], "Tesla T4": ["fp32", "fp16"]}.get(name, ["fp32", "tf32", "fp16",
                                                                                                  "bf16"])
    assert plan.mfu is False  # a toy model on every card: speed-ups, no MFU
    assert ("is a toy here" in plan.why["mfu"]) == (name != "CPU")


@pytest.mark.parametrize("name", SIX)
def test_full_mode_trains_a_model_whose_mfu_means_something_on_each_card(name):
    from gpulab import plans
    from gpulab.plans import plan04

    card = plans.Card.named(name)
    plan = plans.plan_for("04", card)
    assert plan.mfu and plan.width in plan04.WIDTHS and plan.width % 64 == 0
    gpu, launches = plan04.gpu_s(card, card.amp_precision, plan.sizes), plan04.launches_s(card, plan.sizes)
    assert gpu >= plan04.GPU_BOUND * launches
    toy = {**plan.sizes, "width": 128, "depth": 2, "batch": 256}  # the quick mode's toy on the same card
    assert plan04.gpu_s(card, card.amp_precision, toy) < plan04.launches_s(card, toy)


def test_the_plans_step_flops_are_flop_counter_modes():
    from gpulab import flops, plans
    from gpulab.plans import plan04

    sizes = plans.plan_for("04", cpu_card(), quick=True).sizes
    model = tasks.student_mlp(32, sizes["width"], sizes["depth"], 10)
    x, y = torch.randn(sizes["batch"], 32), torch.randint(10, (sizes["batch"],))
    assert plan04.step_flops(sizes) == flops.training_flops(model, x, y, loss_fn=F.cross_entropy).total
    assert plan04._params(sizes) == sum(p.numel() for p in model.parameters())


def test_the_predicted_step_times_reproduce_the_h100s_shipped_rows():
    """The rest of a step (AdamW, LayerNorm, GELU, the casts) is priced from the H100's shipped step times: planned for
    that H100 at those sizes, the prediction gives them back; a card with half the bandwidth takes longer."""
    from gpulab import plans
    from gpulab.plans import plan04
    from gpulab.results import reference

    h100 = plans.Card.named("NVIDIA H100 80GB HBM3")
    rows = reference("04_training_precision").query("device_name == 'NVIDIA H100 80GB HBM3'")
    for row in rows.itertuples():
        sizes = dict(width=row.width, depth=row.depth, batch=row.batch)
        assert plan04.step_s(h100, row.precision, sizes) == pytest.approx(row.median_s)
    assert plan04.step_s(plans.Card.named("NVIDIA A100-SXM4-40GB"), "bf16", sizes) > row.median_s


# ---- section 4: gradients lost to fp16 without scaling, kept with it ---------------------------------------------

def test_the_loss_scaling_demonstration_loses_gradients_without_scaling_and_keeps_them_with_it(monkeypatch,
                                                                                              results_dir):
    """On the H200 of 2026-11-28 the section printed 0.0000 % of gradients lost both with and without scaling: it
    counted the weights' gradients of one 256-point batch, sums over the batch that fp16 holds (0 % both ways on this
    CPU too). It now counts the gradients backward carries between the layers, of the loss averaged over the quick
    plan's 8,192 training points, from the fp32 model trained in quick mode: without scaling fp16 flushes some to zero,
    scaled by 2^16 it keeps them. fp16 casts on a CPU round as a GPU's do (c10/util/Half-inl.h: to nearest, subnormals
    kept), so this shows what a GPU shows."""
    from .test_mfu_lessons_03_04 import run, trained04

    monkeypatch.setenv("GPULAB_QUICK", "1")
    monkeypatch.setattr(plt, "show", lambda *args, **kwargs: None)
    scope = trained04(monkeypatch, ["fp32"], steps=150)  # the quick plan's training, in fp32 only
    scope["display"] = lambda *args: None
    run(scope, "04", "def layer_gradients(", '"fp16 backward, no scaling"', "log2 scale")
    plt.close("all")
    shares = scope["shares"]
    lost = shares["fp16 backward, no scaling"]["became zero"]
    kept = shares["fp16 backward, scaled by 2^16"]["became zero"]
    assert lost > 0.01, f"only {lost:.3%} of the gradients flushed to zero without scaling"
    assert kept < lost / 100
    assert scope["underflow_log"].frame()["points"].tolist() == [8192, 8192]
