"""Lesson 08's check, on real answers in their own processes: what each one trained is counted there and verified
here. Each answer runs one trial (no baseline, no timing), so nothing here depends on the machine's speed."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gpulab import capstone, models
from gpulab.check import Wrong
from gpulab.questions import lesson08
from gpulab.questions.portable import source_of
from gpulab.questions.timed_check import Duel

from .conftest import shown_solution

fast_train = shown_solution(lesson08.q1, "fast_train", torch=torch, F=F, capstone=capstone)


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
        assert trial.report["samples"] == lesson08.SIZES["epochs"] * lesson08.SIZES["n_train"]
        assert trial.report["accuracy"] > 0.6  # each epoch after the first is marked where it starts
        assert [m["epoch"] for _, m in trial.marks] == list(range(1, lesson08.SIZES["epochs"]))


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
    torch.save(models.SpeedrunNet(lesson08.SIZES["widths"]).state_dict(), tmp_path / "trained.pt")
    monkeypatch.setitem(globals(), "WEIGHTS_FILE", str(tmp_path / "trained.pt"))
    with pytest.raises(Wrong, match="did not train the model it was given"):
        answer_trials(saved_weights)
