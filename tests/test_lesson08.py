"""Lesson 08's capstone: the data set is learnable and the same everywhere, and the graded speed-up check's decisions,
tested with injected trials (its verification of what was trained, the accuracy against the baseline's spread, the
steady-state speed-up, the retry when a first round is too close to call), plus two real checks with wide margins.
The answers' own processes are exercised in test_lesson08_answers.py."""

import re

import nbformat
import pytest
import torch
import torch.nn.functional as F

import gpulab
from gpulab import capstone, models
from gpulab.check import Wrong
from gpulab.questions import lesson08
from gpulab.questions.timed_check import Trial, pack_state

from .conftest import ROOT, shown_solution
from .test_lesson08_answers import ReplayedStep

pytestmark = pytest.mark.long  # minutes of work: started first (tests/conftest.py)


def judged(answer):
    lesson08.q1.check(answer)
    return lesson08.q1.last


# ----- the data ---------------------------------------------------------------------------------------

def test_the_data_set_is_uint8_and_the_same_for_the_same_seed():
    a, b = capstone.make_dataset(64, 16, seed=3), capstone.make_dataset(64, 16, seed=3)
    assert a.train_images.shape == (64, 3, 32, 32) and a.train_images.dtype == torch.uint8
    assert a.test_labels.shape == (16,) and a.train_labels.max() < a.num_classes
    assert torch.equal(a.train_images, b.train_images) and torch.equal(a.test_labels, b.test_labels)
    assert not torch.equal(a.train_images, capstone.make_dataset(64, 16, seed=4).train_images)


def test_the_normalisation_constants_fit_the_data():
    pixels = capstone.make_dataset(4096, 0).train_images.float() / 255
    mean, std = pixels.mean(dim=(0, 2, 3)), pixels.std(dim=(0, 2, 3))
    assert torch.allclose(mean, torch.tensor(capstone.MEAN), atol=0.02)
    assert torch.allclose(std, torch.tensor(capstone.STD), atol=0.02)


def test_augmented_items_are_normalised_random_crops_and_flips():
    data = capstone.make_dataset(8, 8)
    padded = capstone.normalize(F.pad(data.train_images[:1], (4, 4, 4, 4)))[0]
    plain, label = capstone.AugmentedImages(data.train_images, data.train_labels, augment=False)[0]
    assert torch.allclose(plain, padded[:, 4:36, 4:36], atol=1e-5) and label == int(data.train_labels[0])
    augmented = capstone.AugmentedImages(data.train_images, data.train_labels)
    torch.manual_seed(0)
    seen = set()
    for _ in range(20):
        x, y = augmented[0]
        assert x.dtype == torch.float32 and x.shape == (3, 32, 32) and isinstance(y, int)
        crops = {(dy, dx, flip) for dy in range(9) for dx in range(9) for flip in (False, True)
                 if torch.allclose(x, padded[:, dy:dy + 32, dx:dx + 32].flip(2) if flip else padded[:, dy:dy + 32, dx:dx + 32],
                                   atol=1e-5)}
        assert crops, "an augmented image is a 32×32 crop of the image padded by 4, flipped or not"
        seen |= crops
    assert len(seen) > 5 and {flip for *_, flip in seen} == {False, True}


def test_evaluation_keeps_the_training_mode():
    data = capstone.make_dataset(8, 64)
    for training in (True, False):
        model = models.TutorialCNN().train(training)
        accuracy = capstone.evaluate(model, data.test_images, data.test_labels, "cpu", batch_size=24)
        assert 0 <= accuracy <= 1 and model.training == training
    model.net[-1].bias.data[:] = -1e3
    model.net[-1].bias.data[data.test_labels[0]] = 1e3  # always predicts the first image's class
    expected = (data.test_labels == data.test_labels[0]).float().mean().item()
    assert capstone.evaluate(model, data.test_images, data.test_labels, "cpu", batch_size=24) == pytest.approx(expected)


# ----- what the model was fed: crops and flips seen in its inputs ---------------------------------------------

def fed(images, *, crop=True, flip=True, scale=1.0, seed=0):
    """The inputs a training step would feed: ``images`` (uint8) cropped from their zero-padded copies and flipped
    as the baseline augments, normalised, times ``scale``."""
    gen = torch.Generator().manual_seed(seed)
    padded = F.pad(images, (4, 4, 4, 4))
    out = []
    for image in padded:
        dy, dx = torch.randint(0, 9, (2,), generator=gen).tolist() if crop else (4, 4)
        x = image[:, dy:dy + 32, dx:dx + 32]
        out.append(x.flip(2) if flip and torch.rand(1, generator=gen) < 0.5 else x)
    return capstone.normalize(torch.stack(out)) * scale


@pytest.fixture(scope="module")
def stamped_images():
    return lesson08.stamped(capstone.make_dataset(256, 0, seed=5).train_images)


def test_crops_and_flips_are_seen_in_any_normalisation(stamped_images):
    for scale in (1.0, 0.25):
        seen = lesson08.augmentation_seen(fed(stamped_images, scale=scale))
        assert seen["cropped"] > 0.95 and seen["marked"] > 0.95 * 256 and 0.35 < seen["flipped"] < 0.65, seen


def test_inputs_without_crops_or_flips_are_seen_as_such(stamped_images):
    assert lesson08.augmentation_seen(fed(stamped_images, crop=False))["cropped"] == 0
    seen = lesson08.augmentation_seen(fed(stamped_images, flip=False))
    assert seen["flipped"] == 0 and seen["marked"] > 0.95 * 256
    unstamped = capstone.make_dataset(256, 0, seed=5).train_images
    assert lesson08.augmentation_seen(fed(unstamped))["marked"] == 0  # real images never look like the watermark


def test_the_watch_counts_training_samples_and_marks_each_epoch():
    class Events:
        marks = []

        def mark(self, **info):
            self.marks.append(info)

    model = models.TutorialCNN()
    events = Events()
    watch = lesson08.TrainingWatch(model, n_train=64, events=events, device=torch.device("cpu"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(3):
        for b in (24, 24, 16):  # a partial last batch
            F.cross_entropy(model(torch.randn(b, 3, 32, 32)), torch.zeros(b, dtype=torch.long)).backward()
            optimizer.step()
        with torch.no_grad():
            model(torch.randn(8, 3, 32, 32))  # an evaluation: not counted
    facts = watch.facts()
    assert facts["samples"] == 3 * 64 and facts["forwards"] == facts["backwards"] == 9
    assert [m["epoch"] for m in events.marks] == [1, 2] and facts["epochs_seen"] == 3
    assert facts["weight_dtypes"] == ["float32"] and len(model._forward_pre_hooks) == 0  # hooks removed


def batches_of(n_batches, b=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(b, 3, 32, 32, generator=gen), torch.randint(0, 10, (b,), generator=gen))
            for _ in range(n_batches)]


def train_eager(model, batches):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for x, y in batches:
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()


def train_replayed(model, batches):
    """As lesson 08's CUDA-graph step: one eager step (SGD makes its momentum buffers), one captured, the rest replayed
    from static inputs."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    static_x, static_y = batches[1][0].clone(), batches[1][1].clone()

    def step(x, y):
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()

    step(*batches[0])
    graph = ReplayedStep()
    with graph:
        step(static_x, static_y)
    for x, y in batches[2:]:
        static_x.copy_(x)
        static_y.copy_(y)
        graph.replay()


def test_the_cpu_stand_in_for_a_replayed_graph_trains_as_the_eager_steps_do():
    """What the next test rests on: replaying the recorded operators is training, step for step."""
    batches = batches_of(6)
    eager, replayed = models.SpeedrunNet(capstone.SIZES.widths), models.SpeedrunNet(capstone.SIZES.widths)
    train_eager(eager, batches)
    train_replayed(replayed, batches)
    for (name, a), b in zip(eager.state_dict().items(), replayed.state_dict().values()):
        assert torch.allclose(a.float(), b.float(), rtol=1e-4, atol=1e-6), name


def test_the_watch_counts_a_step_replayed_without_python_as_a_cuda_graph_runs_it(course_device):
    """The 2026-11-28 review: the watch counted in Python hooks, which a CUDA graph's replay never runs, so an answer
    that captures its step (as lesson 08 teaches) was told it trained on a few batches. The counts now live on the
    device, kept by kernels of the step itself (on the CPU, and on the CPU playing a GPU: its branch asks whether a
    capture is under way)."""
    class Events:
        marks = []

        def mark(self, **info):
            self.marks.append(info)

    model = models.SpeedrunNet(capstone.SIZES.widths)
    watch = lesson08.TrainingWatch(model, n_train=64, events=Events(), device=course_device)
    batches = batches_of(12)  # 3 epochs of 64: 12 steps of 16
    train_replayed(model, batches)
    facts = watch.facts()
    assert facts["samples"] == 12 * 16 and facts["forwards"] == facts["backwards"] == 12, facts
    for i, (x, _) in enumerate(batches):  # each batch's first two inputs, the replayed ones too, in the ring
        assert torch.equal(watch.inputs[2 * i:2 * i + 2], x[:2]), i
    assert facts["weight_dtypes"] == ["float32"] and facts["augmentation"]["inputs"] == 2 * 12


# ----- the decisions, on injected trials ----------------------------------------------------------------------

N, EPOCHS = lesson08.job().n_train, lesson08.job().epochs


def trained_weights(seed=0, **moves) -> dict:
    """Seed ``seed``'s model with every parameter moved at random, as training moves it, or as ``moves`` says (a
    parameter's name, dots as __, to a function of its initial weights)."""
    gen = torch.Generator().manual_seed(seed)
    state = models.SpeedrunNet(lesson08.job().widths, seed=seed).state_dict()
    for name, p in lesson08.initial_parameters(seed).items():
        move = moves.get(name.replace(".", "__"), lambda w: w + 0.1 * torch.randn(w.shape, generator=gen))
        state[name] = move(p.clone())
    return state


def packed(state: dict) -> str:
    """A state as a trial reports it."""
    model = models.SpeedrunNet(lesson08.job().widths)
    model.load_state_dict(state)
    return pack_state(model)


TRAINED = packed(trained_weights())


def facts(**changes) -> dict:
    """The report of an answer that trained as asked."""
    steps = EPOCHS * N // 64
    report = {"model": "SpeedrunNet", "architecture": lesson08._architecture(models.SpeedrunNet(lesson08.job().widths)),
              "samples": EPOCHS * N, "forwards": steps, "backwards": steps,
              "gradients": dict.fromkeys(lesson08.initial_parameters(0), steps), "replaced": [], "state": TRAINED,
              "weight_dtypes": ["float32"], "final_dtypes": ["float32"], "input_dtypes": ["float32"],
              "augmentation": {"inputs": 512, "cropped": 0.99, "marked": 512, "flipped": 0.5}}
    return {**report, **changes}


def trial(side, *, steady, startup=0.0, accuracy=0.93, seed=0, **changes) -> Trial:
    """A trial whose epochs after the first took ``steady`` seconds each, the first ``startup`` more."""
    epoch1 = steady + startup
    marks = [(epoch1, {"event": "mark", "epoch": 1, "samples": N})]
    return Trial(side, seed, epoch1 + (EPOCHS - 1) * steady, marks, {**facts(**changes), "accuracy": accuracy})


def pairs(base_steady, answer_steady, *, base_acc=(0.93, 0.94, 0.92, 0.93), answer_acc=(0.93,) * 4, **answer):
    return [(trial("baseline", steady=b, accuracy=ba), trial("answer", steady=a, accuracy=aa, **answer))
            for b, a, ba, aa in zip(base_steady, answer_steady, base_acc, answer_acc)]


def test_a_clear_speed_up_with_the_accuracy_kept_passes_and_says_its_spread():
    verdict = lesson08.judge(pairs([4.0, 4.4, 3.8, 4.0], [2.0] * 4, startup=1.5), needed=1.4)
    assert "steady-state speed-up 2.00× (median; 1.90–2.20× over 4 interleaved pairs" in verdict
    assert "start-up, not counted: 1.50 s" in verdict


def test_start_up_is_not_counted_against_a_fast_steady_state():
    assert "2.00×" in lesson08.judge(pairs([4.0] * 4, [2.0] * 4, startup=30.0), needed=1.4)


def test_a_speed_up_below_the_threshold_is_not_yet():
    with pytest.raises(Wrong, match="not fast enough: steady-state speed-up 1.25×"):
        lesson08.judge(pairs([5.0] * 4, [4.0] * 4), needed=1.4)


def test_an_accuracy_below_the_baselines_spread_is_not_yet_however_fast():
    with pytest.raises(Wrong, match="accuracy fell"):
        lesson08.judge(pairs([4.0] * 4, [1.0] * 4, answer_acc=(0.80, 0.82, 0.81, 0.80)), needed=1.4)
    noisy = (0.90, 0.96, 0.84, 0.90)  # a baseline that spreads this much widens the floor beyond the tolerance
    assert "correct" not in lesson08.judge(pairs([4.0] * 4, [1.0] * 4, base_acc=noisy, answer_acc=(0.83,) * 4), 1.4)


def test_one_unlucky_run_on_either_side_does_not_decide_the_accuracy():
    """Quick mode's short runs now and then land far below the rest (the stability benchmark saw a right answer
    rejected for one such run): the medians are compared."""
    unlucky = (0.95, 0.58, 0.96, 0.94)
    assert "1.00× faster" not in lesson08.judge(pairs([4.0] * 4, [1.0] * 4, answer_acc=unlucky), needed=1.4)
    assert "4.00×" in lesson08.judge(pairs([4.0] * 4, [1.0] * 4, base_acc=(0.93, 0.94, 0.30, 0.92)), needed=1.4)


def test_a_baseline_that_did_not_learn_voids_the_check():
    with pytest.raises(Wrong, match="the baseline itself reached only 20%"):
        lesson08.judge(pairs([4.0] * 4, [1.0] * 4, base_acc=(0.2,) * 4), needed=1.4)


@pytest.mark.parametrize("changes, says", [
    (dict(model="SmallCNN"), "the model was changed"),
    (dict(architecture=[["", "SpeedrunNet"]]), "the model was changed"),
    (dict(samples=0, forwards=0, backwards=0), "did not train the model it was given"),
    (dict(weight_dtypes=["bfloat16"]), "bfloat16 during training"),
    (dict(final_dtypes=["float16"]), "float16 after your function"),
    (dict(samples=EPOCHS * N // 2), "train on every image, every epoch"),
    (dict(samples=(EPOCHS - 1) * N), "train on every image, every epoch"),
    (dict(samples=(EPOCHS + 1) * N), "more than"),
    (dict(backwards=3), "backward passes"),
    (dict(augmentation={"inputs": 512, "cropped": 0.0, "marked": 512, "flipped": 0.5}), "padded crops"),
    (dict(augmentation={"inputs": 512, "cropped": 0.99, "marked": 512, "flipped": 0.0}), "flip each image"),
    (dict(augmentation={"inputs": 512, "cropped": 0.99, "marked": 3, "flipped": 0.33}), "flip each image"),
])
def test_what_was_trained_is_verified(changes, says):
    with pytest.raises(Wrong, match=says):
        lesson08._verify(trial("answer", steady=1.0, **changes))
    lesson08._verify(trial("answer", steady=1.0, samples=EPOCHS * (N - N // 50)))  # a dropped partial batch is fine


# ----- every parameter trained: the ways to leave some out, in this process under the check's watch -------------

def watched(train, *, steps=8, seed=0, replayed=False, facts=False):
    """What the check says of a training of seed ``seed``'s model, under the check's watch, on ``steps`` batches,
    eagerly or as a captured and replayed step (``ReplayedStep``): ``left_out``'s line, or None (with ``facts``: the
    watch's facts too). ``train(model)`` prepares the model and returns the optimizer (None: SGD as the recipe's)."""
    model = models.SpeedrunNet(lesson08.job().widths, seed=seed)
    watch = lesson08.TrainingWatch(model, n_train=10**6, events=None, device=torch.device("cpu"))
    optimizer = train(model) or torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)

    def step(x, y):
        optimizer.zero_grad(set_to_none=False)  # zeros, kept: weight decay still moves a parameter they leave out
        F.cross_entropy(model(x), y).backward()
        optimizer.step()

    batches = batches_of(steps)
    if replayed:  # one eager step, one captured, the rest replayed from static inputs
        step(*batches[0])
        static_x, static_y = batches[1][0].clone(), batches[1][1].clone()
        graph = ReplayedStep()
        with graph:
            step(static_x, static_y)
        for x, y in batches[2:]:
            static_x.copy_(x)
            static_y.copy_(y)
            graph.replay()
    else:
        for x, y in batches:
            step(x, y)
    seen = watch.facts()
    said = lesson08.left_out(seen, lesson08.initial_parameters(seed), model.state_dict())
    return (said, seen) if facts else said


def stem_frozen(model):
    model.net[0].requires_grad_(False)


def head_not_in_the_optimizer(model):
    return torch.optim.SGD(list(model.parameters())[:-1], lr=0.05, momentum=0.9, weight_decay=5e-4)


def stem_at_learning_rate_0(model):
    stem = list(model.net[:2].parameters())
    rest = list(model.net[2:].parameters())
    return torch.optim.SGD([{"params": stem, "lr": 0.0}, {"params": rest}], lr=0.05, momentum=0.9, weight_decay=5e-4)


def everything_at_learning_rate_0(model):
    return torch.optim.SGD(model.parameters(), lr=0.0, momentum=0.9, weight_decay=5e-4)


def stem_output_detached(model):
    model.net[2].register_forward_hook(lambda module, args, output: output.detach())


def stem_convolution_without_grad(model):
    model.net[0].forward = torch.no_grad()(model.net[0].forward)


def stem_gradients_zeroed(model):
    """Gradients computed, then zeroed before the step: weight decay alone moves the stem (a multiple of its start)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    def zero(*args):
        model.net[0].weight.grad.zero_()
    optimizer.register_step_pre_hook(zero)
    return optimizer


def stem_put_back(model):
    """The stem's weights restored after every step (after training would do the same)."""
    saved = model.net[0].weight.detach().clone()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    def put_back(*args):
        model.net[0].weight.data.copy_(saved)
    optimizer.register_step_post_hook(put_back)
    return optimizer


def stem_trained_every_4th_step(model):
    """The costly full-resolution backward skipped in most steps: the stem's output detached 3 steps in 4."""
    steps = iter(range(10**6))
    model.net[2].register_forward_hook(lambda module, args, output: output if next(steps) % 4 == 0 else output.detach())


def stem_replaced(model):
    model.net[0].weight = torch.nn.Parameter(model.net[0].weight.detach().clone())


WHOLE = "Train the whole model you were given, every step"


@pytest.mark.parametrize("train, says", [
    (stem_frozen, r"^parameters left out of training: net\.0\.weight had a gradient in 0 of 8 backward passes\. "),
    (head_not_in_the_optimizer, r": net\.26\.weight ended where it started or at a multiple of it"),
    (stem_at_learning_rate_0, r": net\.0\.weight, net\.1 \(weight, bias\) ended where they started"),
    (everything_at_learning_rate_0, r": all 22 parameters ended where they started"),
    (stem_output_detached, r": net\.0\.weight, net\.1 \(weight, bias\) had a gradient in 0 of 8 backward"),
    (stem_convolution_without_grad, r": net\.0\.weight had a gradient in 0 of 8 backward passes"),
    (stem_gradients_zeroed, r": net\.0\.weight ended where it started or at a multiple of it \(as weight decay"),
    (stem_put_back, r": net\.0\.weight ended where it started"),
    (stem_trained_every_4th_step, r": net\.0\.weight, net\.1 \(weight, bias\) had a gradient in 2 of 8 backward"),
    (stem_replaced, r": net\.0\.weight was replaced by a new tensor\. "),
], ids=lambda value: getattr(value, "__name__", ""))
def test_each_way_of_leaving_parameters_untrained_is_named_in_one_line(train, says):
    said = watched(train)
    assert said is not None and re.search(says, said), said
    assert "\n" not in said and said.count(WHOLE) == 1


def test_a_whole_model_trained_eagerly_or_replayed_is_not_told_anything():
    assert watched(lambda model: None) is None
    assert watched(lambda model: None, replayed=True) is None


def test_a_frozen_stem_is_counted_in_a_replayed_step_too():
    """The captured step's hooks ran once, at the capture: its replays count the parameters it reached."""
    said = watched(stem_frozen, replayed=True)
    assert said.startswith("parameters left out of training: net.0.weight had a gradient in 0 of 8 backward"), said


def test_a_captured_step_that_leaves_the_stem_out_after_one_that_trained_it_falls_short_of_its_forwards():
    """Step 0 eager and whole, step 1 (the captured one) without the stem: the replays' passes go uncounted, and the
    check rejects the backward passes short of the forwards before it reads the parameters'."""
    _, seen = watched(stem_trained_every_4th_step, replayed=True, facts=True)
    assert seen["forwards"] == 8 and seen["backwards"] == 2
    with pytest.raises(Wrong, match="8 training forward passes but 2 backward passes"):
        lesson08._verify(trial("answer", steady=1.0, **dict(seen, samples=EPOCHS * N)))


def test_a_training_with_the_recipe_moves_every_parameter_far_beyond_a_rescaling_and_decay_alone_does_not():
    """The margins of ``RESCALED`` and ``ROUNDING``: the shown solution's whole quick-mode job, its stem's gradients
    zeroed before every step (its weight decay still applied), on seed 3."""
    solution = shown_solution(lesson08.q1, "fast_train", torch=torch, F=F, capstone=capstone, gpulab=gpulab)
    data = capstone.make_dataset(N, 0, seed=3)
    model = models.SpeedrunNet(lesson08.job().widths, seed=3)
    model.net[0].weight.register_hook(torch.zeros_like)
    solution(model, data, epochs=EPOCHS, device=torch.device("cpu"))
    initial = lesson08.initial_parameters(3)
    for name, p in model.named_parameters():
        rest, change, size = lesson08.unscaled_change(initial[name], p.detach())
        if name == "net.0.weight":
            assert change > 0 and rest < lesson08.RESCALED / 100 * change and rest < lesson08.ROUNDING / 10 * size
        else:
            assert rest > 50 * lesson08.RESCALED * change and rest > 1000 * lesson08.ROUNDING * size, name


def test_the_parameters_left_out_are_verified_from_the_weights_reported_against_the_seeds_own():
    steps = EPOCHS * N // 64
    put_back = packed(trained_weights(net__3__weight=lambda w: w, net__5__bias=lambda w: w))
    with pytest.raises(Wrong, match=r"^parameters left out of training: net\.3\.weight, net\.5\.bias ended where"):
        lesson08._verify(trial("answer", steady=1.0, state=put_back))
    decayed = packed(trained_weights(net__26__weight=lambda w: 0.97 * w))
    with pytest.raises(Wrong, match=r": net\.26\.weight ended where it started or at a multiple of it"):
        lesson08._verify(trial("answer", steady=1.0, state=decayed))
    with pytest.raises(Wrong, match="ended where"):  # another seed's model: its weights are not this trial's start
        lesson08._verify(trial("answer", steady=1.0, seed=1, state=packed(trained_weights(seed=0, net__0__weight=(
            lambda w: lesson08.initial_parameters(1)["net.0.weight"])))))
    starved = dict(facts()["gradients"], **{"net.0.weight": 0, "net.1.weight": steps - 9})
    with pytest.raises(Wrong, match=rf": net\.0\.weight, net\.1\.weight had a gradient in 0 to {steps - 9} of {steps} "):
        lesson08._verify(trial("answer", steady=1.0, gradients=starved))
    lesson08._verify(trial("answer", steady=1.0, gradients=dict(starved, **{"net.0.weight": steps - 1,
                                                                           "net.1.weight": steps - 2})))
    diverged = packed(trained_weights(net__0__weight=lambda w: w * float("nan")))
    lesson08._verify(trial("answer", steady=1.0, state=diverged))  # the accuracy judges a diverged training


def test_the_names_left_out_are_said_compactly():
    names = list(lesson08.initial_parameters(0))
    assert lesson08._names(names, len(names)) == "all 22 parameters"
    assert lesson08._names(names[:4], len(names)) == "net.0.weight, net.1 (weight, bias), net.3.weight"
    assert lesson08._names(names[:-1], len(names)) == ("net.0.weight, net.1 (weight, bias), net.3.weight, "
                                                       "net.5 (weight, bias), net.7.weight, net.8 (weight, bias) and "
                                                       "those of 8 more modules")


class ScriptedDuel:
    """Stands in for gpulab.questions.timed_check.Duel: hands out prepared trials, the answer's steady seconds per seed."""

    def __init__(self, answer_steady):
        self.answer_steady, self.ran = answer_steady, []

    def __call__(self, task, source, name, **options):
        assert task == "gpulab.questions.lesson08:TASK" and "def fast_train" in source and name == "fast_train"
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def trial(self, side, seed):
        self.ran.append(side)
        steady = 4.0 if side == "baseline" else self.answer_steady[self.ran.count("answer") - 1]
        return trial(side, steady=steady, seed=seed)

    def pairs(self, seeds):
        return [(self.trial("baseline", s), self.trial("answer", s)) for s in seeds]


def fast_train(model, data, *, epochs, device):
    pass


@pytest.fixture
def scripted(monkeypatch):
    monkeypatch.setattr(lesson08, "_accuracy", lambda trial: trial.report["accuracy"])
    monkeypatch.setattr(lesson08, "loaded_machine", lambda: None)

    def install(answer_steady):
        duel = ScriptedDuel(answer_steady)
        monkeypatch.setattr(lesson08, "Duel", duel)
        return duel
    return install


def test_a_clear_first_round_is_judged_on_four_pairs(scripted):
    duel = scripted([2.0] * 4)
    assert judged(fast_train).status == "correct"
    assert duel.ran == ["answer", "baseline", "baseline", "answer", "baseline", "answer", "baseline", "answer"]


def test_a_round_too_close_to_call_is_measured_again_before_a_verdict(scripted):
    duel = scripted([3.0, 2.6, 3.2, 2.7, 2.8, 2.9, 2.8, 2.9])  # 1.25-1.54x around 1.35x: the first four straddle it
    result = judged(fast_train)
    assert len(duel.ran) == 16 and "over 8 interleaved pairs" in result.message
    assert result.status == "correct", result.message  # median 4/2.85 = 1.40x


def test_a_loaded_machine_is_said_next_to_the_verdict(scripted, monkeypatch):
    scripted([3.5] * 4)
    monkeypatch.setattr(lesson08, "loaded_machine", lambda: "the CPU was oversubscribed (load average 5.0 on 2 cores)")
    result = judged(fast_train)
    assert result.status == "wrong" and "not fast enough" in result.message and "oversubscribed" in result.message


def test_the_threshold_depends_on_the_device_and_mode(monkeypatch):
    assert lesson08.threshold(torch.device("cpu")) == lesson08.THRESHOLDS["cpu"]
    monkeypatch.setenv("GPULAB_QUICK", "0")
    full = lesson08.threshold(torch.device("cuda"))
    monkeypatch.setenv("GPULAB_QUICK", "1")
    assert full == lesson08.THRESHOLDS["cuda full"] > lesson08.threshold(torch.device("cuda"))


# ----- real checks, with margins no load can cross --------------------------------------------------------------

def the_baseline_with_every_trick(model, data, *, epochs, device):
    """The baseline itself, plus what once earned speed-ups without any: a patched clock, a swapped baseline, and
    trained weights looked for in every object of the process. (A thread left running to slow the baseline down
    cannot: the answer's process is suspended while the baseline runs, see test_timed_check.py.)"""
    import gc
    import time

    time.perf_counter = lambda: 0.0
    capstone.slow_train.__code__ = (lambda *args, **kwargs: None).__code__
    for other in gc.get_objects():
        if isinstance(other, torch.nn.Module) and other is not model and type(other) is type(model):
            model.load_state_dict(other.state_dict())
    from torch.utils.data import DataLoader

    loader = DataLoader(capstone.AugmentedImages(data.train_images, data.train_labels, mean=data.mean, std=data.std),
                        batch_size=capstone.SIZES.batch, shuffle=True, drop_last=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=capstone.SIZES.lr, momentum=capstone.MOMENTUM, nesterov=True,
                                weight_decay=capstone.WEIGHT_DECAY)
    step = 0
    for _ in range(epochs):
        for x, y in loader:  # the baseline's own recipe, so that only the speed-up can decide
            for group in optimizer.param_groups:
                group["lr"] = capstone.lr_at(step, epochs * len(loader), capstone.SIZES.lr)
            loss = F.cross_entropy(model(x.to(device)), y.to(device), label_smoothing=capstone.LABEL_SMOOTHING)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            loss.item()
            step += 1


def test_tricks_around_the_baseline_earn_no_speed_up(monkeypatch):
    monkeypatch.setitem(lesson08.THRESHOLDS, "cpu", 5.0)  # the baseline against itself: about 1x, never 5x
    monkeypatch.setattr(lesson08.capstone, "slow_train", lambda *args, **kwargs: __import__("time").sleep(5))
    result = judged(the_baseline_with_every_trick)
    assert result.status == "wrong" and "not fast enough" in result.message, result.message


def test_the_solution_notebook_holds_the_solution_the_question_shows():
    notebook = nbformat.read(ROOT / "solutions" / "08_capstone.ipynb", as_version=4)
    answer = next(c.source for c in notebook.cells if "### BEGIN SOLUTION" in c.source)
    written = [line for line in answer.splitlines() if "### " not in line]
    assert written == lesson08.q1.solution_text.strip().splitlines()


def not_attempted(model, data, *, epochs, device):
    raise NotImplementedError


def test_a_blank_answer_is_not_attempted_and_a_non_function_is_wrong():
    assert judged(not_attempted).status == "not attempted"
    result = judged(capstone.make_dataset(8, 8))
    assert result.status == "wrong" and "your function itself" in result.message


def test_the_exercise_trains_the_job_the_lesson_plans_for_the_card(monkeypatch):
    """In full mode on a T4 the check trains the lesson's planned job, not the H100's (the full network in fp32 would
    take its baseline many minutes there); in quick mode, quick mode's job."""
    from gpulab import plans

    from .cuda_stand_in import installed

    lesson08.job.cache_clear()
    monkeypatch.setenv("GPULAB_QUICK", "0")
    with installed("Tesla T4"):
        planned = plans.plan_for("08", plans.Card.here()).job
        assert lesson08.job() == planned and planned != capstone.FULL_SIZES
    lesson08.job.cache_clear()
    monkeypatch.setenv("GPULAB_QUICK", "1")
    assert lesson08.job() == capstone.QUICK_SIZES
    lesson08.job.cache_clear()
