"""Lesson 08's check, on real answers in their own processes: what each one trained is counted there and verified
here. Each answer runs one trial (no baseline, no timing), so nothing here depends on the machine's speed."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import gpulab
from gpulab import capstone, models
from gpulab.check import Wrong
from gpulab.questions import lesson08
from gpulab.questions.portable import source_of
from gpulab.questions.timed_check import Duel

from .conftest import shown_solution

pytestmark = pytest.mark.long  # minutes of work: started first (tests/conftest.py)

fast_train = shown_solution(lesson08.q1, "fast_train", torch=torch, F=F, capstone=capstone, gpulab=gpulab)


def answer_trials(answer, seeds=(11,)):
    """The answer's trials in its own process, each verified and evaluated as the check does."""
    with Duel(f"{lesson08.__name__}:TASK", source_of(answer), answer.__name__, sides=("answer",)) as duel:
        return [lesson08._judged(duel.trial("answer", seed)) for seed in seeds]


def train_loop(model, data, epochs, device, *, share=1.0, crop=True, flip=True, dtype=torch.float32):
    """A plain training loop on the device, with the augmentation and precision switches a wrong answer gets wrong."""
    images = F.pad(data.train_images, (4, 4, 4, 4)).to(device)
    labels = data.train_labels.to(device)
    model.to(dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    n = int(len(labels) * share)
    for _ in range(epochs):
        for index in torch.randperm(len(labels), device=device)[:n].split(128):
            dy, dx = torch.randint(0, 9, (2,)).tolist() if crop else (4, 4)
            x = images[index, :, dy:dy + 32, dx:dx + 32]
            if flip and torch.rand(()) < 0.5:
                x = x.flip(3)
            loss = F.cross_entropy(model(capstone.normalize(x).to(dtype)), labels[index])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    model.float()


def augment_per_epoch(model, data, *, epochs, device):
    """Unusual but right: each epoch's crops made at once, one group of images per crop offset, then batches;
    and the test split is not needed (nor given)."""
    assert len(data.test_images) == 0
    model.to(memory_format=torch.channels_last)
    images = F.pad(data.train_images, (4, 4, 4, 4)).to(device)
    labels = data.train_labels.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=capstone.SIZES.lr, momentum=0.9, nesterov=True)
    n, batch, step = len(labels), capstone.SIZES.batch, 0
    for _ in range(epochs):
        offsets = torch.randint(0, 81, (n,), device=device)
        epoch = torch.empty(n, 3, 32, 32, dtype=torch.uint8, device=device)
        for offset in range(81):
            chosen = offsets == offset
            dy, dx = divmod(offset, 9)
            epoch[chosen] = images[chosen, :, dy:dy + 32, dx:dx + 32]
        flip = torch.rand(n, device=device) < 0.5
        epoch[flip] = epoch[flip].flip(3)
        for index in torch.randperm(n, device=device).split(batch):
            x = capstone.normalize(epoch[index]).contiguous(memory_format=torch.channels_last)
            for group in optimizer.param_groups:
                group["lr"] = capstone.lr_at(step, epochs * (n // batch), capstone.SIZES.lr)
            loss = F.cross_entropy(model(x), labels[index])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1


def test_the_shown_solution_and_an_unusual_right_answer_train_as_asked():
    for answer in (fast_train, augment_per_epoch):
        (trial,) = answer_trials(answer)
        assert trial.report["samples"] == lesson08.job().epochs * lesson08.job().n_train
        assert trial.report["accuracy"] > 0.6  # each epoch after the first is marked where it starts
        assert [m["epoch"] for _, m in trial.marks] == list(range(1, lesson08.job().epochs))


class ReplayedStep(TorchDispatchMode):
    """A CPU stand-in for a training step captured in a CUDA graph and replayed: ``with graph:`` runs the step once and
    records every operator it ran, with its tensors; ``replay()`` runs those operators again on the same tensors, each
    result written where the recorded one is (a graph's static memory), and nothing else: no Python of the step, no
    hook, only the "kernels" (as torch.cuda.CUDAGraph.replay does). Unlike a GPU's capture, the recording run trains."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.calls.append((func, args, kwargs or {}, out))
        return out

    def replay(self):
        with torch.no_grad():
            for func, args, kwargs, out in self.calls:
                for kept, fresh in zip(tree_leaves(out), tree_leaves(func(*args, **kwargs))):
                    if isinstance(kept, torch.Tensor) and kept.data_ptr() != fresh.data_ptr():  # else a view or
                        kept.copy_(fresh)  # an in-place result: already there


def replayed_like_a_cuda_graph(model, data, *, epochs, device):
    """The job as lesson 08's CUDA-graph step runs it: an eager warm-up step (SGD makes its momentum buffers), one step
    captured, then each later batch copied into the captured step's inputs and the step replayed, which runs no Python
    (on a CPU: ``ReplayedStep``). Right, and counted as such: every image, every epoch, crops and flips seen."""
    images, labels = F.pad(data.train_images, (4, 4, 4, 4)).to(device), data.train_labels.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=capstone.SIZES.lr, momentum=capstone.MOMENTUM, nesterov=True,
                                weight_decay=capstone.WEIGHT_DECAY)
    n, b = len(labels), capstone.SIZES.batch
    pixels, channels = torch.arange(32, device=device), torch.arange(3, device=device)[None, :, None, None]

    def batches():
        for index in torch.randperm(n, device=device)[: n // b * b].view(-1, b):
            dy, dx = torch.randint(0, 9, (2, b, 1), device=device)
            cols = torch.where(torch.rand(b, 1, device=device) < 0.5, 31 - pixels, pixels) + dx
            x = images[index[:, None, None, None], channels, (pixels + dy)[:, None, :, None], cols[:, None, None, :]]
            yield capstone.normalize(x, data.mean, data.std), labels[index]

    def step(x, y):
        loss = F.cross_entropy(model(x), y, label_smoothing=capstone.LABEL_SMOOTHING)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    feed = (batch for _ in range(epochs) for batch in batches())
    step(*next(feed))
    static_x, static_y = (t.clone() for t in next(feed))
    graph = ReplayedStep()
    with graph:
        step(static_x, static_y)
    for x, y in feed:
        static_x.copy_(x)
        static_y.copy_(y)
        graph.replay()


def test_an_answer_that_replays_its_step_without_python_is_counted_whole():
    """The 2026-11-28 review: the check counted with Python hooks, which a replayed CUDA graph never runs, so such an
    answer (as lesson 08 teaches) was told it fed the model a few batches. Its step's own kernels count now."""
    (trial,) = answer_trials(replayed_like_a_cuda_graph)
    n, epochs = lesson08.job().n_train, lesson08.job().epochs
    assert trial.report["samples"] == epochs * (n // capstone.SIZES.batch * capstone.SIZES.batch)
    assert trial.report["backwards"] == trial.report["forwards"] == epochs * (n // capstone.SIZES.batch)
    assert trial.marks == []  # its epochs leave no marks: the check times its whole run


def a_swapped_activation(model, data, *, epochs, device):
    model.net[1] = nn.GELU()
    fast_train(model, data, epochs=epochs, device=device)


def a_new_model(model, data, *, epochs, device):
    fast_train(models.TutorialCNN(width=1).to(device), data, epochs=epochs, device=device)


def weights_in_half_afterwards(model, data, *, epochs, device):
    fast_train(model, data, epochs=epochs, device=device)
    model.half()


def bf16_weights_while_training(model, data, *, epochs, device):
    train_loop(model, data, epochs, device, dtype=torch.bfloat16)


def half_the_images(model, data, *, epochs, device):
    train_loop(model, data, epochs, device, share=0.5)


def an_epoch_less(model, data, *, epochs, device):
    train_loop(model, data, epochs - 1, device)


def no_crops(model, data, *, epochs, device):
    train_loop(model, data, epochs, device, crop=False)


def no_flips(model, data, *, epochs, device):
    train_loop(model, data, epochs, device, flip=False)


def stem_put_back_after_training(model, data, *, epochs, device):
    stem = model.net[0].weight.detach().clone()
    fast_train(model, data, epochs=epochs, device=device)
    with torch.no_grad():
        model.net[0].weight.copy_(stem)


def weights_found_in_other_objects(model, data, *, epochs, device):
    import gc

    for other in gc.get_objects():  # the check's baseline is not in this process: nothing to copy
        if isinstance(other, nn.Module) and other is not model and type(other) is type(model):
            model.load_state_dict(other.state_dict())


@pytest.mark.parametrize("answer, says", [
    (a_swapped_activation, "the model was changed"),
    (a_new_model, "did not train the model it was given"),
    (weights_in_half_afterwards, "float16 after your function"),
    (bf16_weights_while_training, "bfloat16 during training"),
    (half_the_images, "train on every image, every epoch"),
    (an_epoch_less, "train on every image, every epoch"),
    (no_crops, "padded crops"),
    (no_flips, "flip each image"),
    (weights_found_in_other_objects, "did not train the model it was given"),
    (stem_put_back_after_training, r"^parameters left out of training: net\.0\.weight ended where it started"),
], ids=lambda value: getattr(value, "__name__", ""))
def test_wrong_answers_are_rejected_with_their_mistake(answer, says):
    with pytest.raises(Wrong, match=says):
        answer_trials(answer)


WEIGHTS = {}  # filled by the first call: a cache that survives from one call to the next in the answer's process


def cached_weights(model, data, *, epochs, device):
    if "state" in WEIGHTS:
        model.load_state_dict(WEIGHTS["state"])
        return
    fast_train(model, data, epochs=epochs, device=device)
    WEIGHTS["state"] = {k: v.clone() for k, v in model.state_dict().items()}


def test_weights_cached_from_an_earlier_call_are_rejected():
    with pytest.raises(Wrong, match="did not train the model it was given"):
        answer_trials(cached_weights, seeds=(1, 2))


WEIGHTS_FILE = ""  # where a test saved weights "trained earlier"


def saved_weights(model, data, *, epochs, device):
    model.load_state_dict(torch.load(WEIGHTS_FILE))


def test_weights_trained_earlier_and_loaded_from_a_file_are_rejected(tmp_path, monkeypatch):
    torch.save(models.SpeedrunNet(lesson08.job().widths).state_dict(), tmp_path / "trained.pt")
    monkeypatch.setitem(globals(), "WEIGHTS_FILE", str(tmp_path / "trained.pt"))
    with pytest.raises(Wrong, match="did not train the model it was given"):
        answer_trials(saved_weights)


def a_frozen_stem(model, data, *, epochs, device):
    """Issue 39's shortcut: the shown solution with the stem (its convolution and BatchNorm) and the first block's
    convolution frozen, so that backward stops before the costliest, full-resolution layers. It passed the check at
    2.24x and 94.3 % accuracy in quick mode on a GPU."""
    for layer in (model.net[0], model.net[1], model.net[3]):
        layer.requires_grad_(False)
    fast_train(model, data, epochs=epochs, device=device)


def test_the_issues_frozen_stem_is_rejected_with_the_parameters_it_left_out():
    with pytest.raises(Wrong, match=r"^parameters left out of training: net\.0\.weight, net\.1 \(weight, bias\), "
                                    r"net\.3\.weight had a gradient in 0 of \d+ backward passes\. [^\n]*$"):
        answer_trials(a_frozen_stem)
