"""Lesson 08's capstone: the data set is learnable and the same everywhere, and the graded speed-up check accepts a
faster version of the same training, calls a blank one "not attempted", and rejects one that changes the model,
loses accuracy, or is not faster."""

import nbformat
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gpulab import capstone, models
from gpulab.questions import lesson08

from .conftest import ROOT, shown_solution


@pytest.fixture(scope="module")
def solution():
    return shown_solution(lesson08.q1, "fast_train", torch=torch, F=F, capstone=capstone)


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


def test_the_baseline_learns_the_task():
    data = capstone.make_dataset(4096, 1024)
    model = models.TutorialCNN()
    losses = capstone.slow_train(model, data, epochs=1, device="cpu")
    assert len(losses) == 4096 // 128 and losses[-1] < losses[0]
    assert capstone.evaluate(model, data.test_images, data.test_labels, "cpu") > 0.5  # chance: 0.1


# ----- the graded speed-up ----------------------------------------------------------------------------

def augment_per_epoch(model, data, *, epochs, device):
    """Unusual but right: each epoch's crops made at once, one group of images per crop offset, then batches."""
    model.to(memory_format=torch.channels_last)
    images = F.pad(data.train_images, (4, 4, 4, 4)).to(device)
    labels = data.train_labels.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    n = len(labels)
    for _ in range(epochs):
        offsets = torch.randint(0, 81, (n,), device=device)
        epoch = torch.empty(n, 3, 32, 32, dtype=torch.uint8, device=device)
        for offset in range(81):
            chosen = offsets == offset
            dy, dx = divmod(offset, 9)
            epoch[chosen] = images[chosen, :, dy:dy + 32, dx:dx + 32]
        flip = torch.rand(n, device=device) < 0.5
        epoch[flip] = epoch[flip].flip(3)
        for index in torch.randperm(n, device=device).split(128):
            x = capstone.normalize(epoch[index]).contiguous(memory_format=torch.channels_last)
            loss = F.cross_entropy(model(x), labels[index])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()


def not_attempted(model, data, *, epochs, device):
    raise NotImplementedError


def the_baseline_again(model, data, *, epochs, device):
    capstone.slow_train(model, data, epochs=epochs, device=device)


def a_swapped_activation(solution):
    def fast_train(model, data, *, epochs, device):
        model.net[1] = nn.GELU()
        solution(model, data, epochs=epochs, device=device)
    return fast_train


def a_new_model(solution):
    def fast_train(model, data, *, epochs, device):
        solution(models.TutorialCNN(seed=1), data, epochs=epochs, device=device)
    return fast_train


def a_learning_rate_too_high(solution):
    def fast_train(model, data, *, epochs, device):
        solution(model, data, epochs=epochs, device=device, lr=0.05)
    return fast_train


def weights_in_half(solution):
    def fast_train(model, data, *, epochs, device):
        solution(model, data, epochs=epochs, device=device)
        model.half()
    return fast_train


def test_the_shown_solution_and_an_unusual_right_answer_pass(solution):
    result = judged(solution)
    assert result.status == "correct", result.message
    assert "faster" in result.message and "accuracy" in result.message and "the baseline took" in result.message
    result = judged(augment_per_epoch)
    assert result.status == "correct", result.message


def test_the_solution_notebook_holds_the_solution_the_question_shows():
    notebook = nbformat.read(ROOT / "solutions" / "08_capstone.ipynb", as_version=4)
    answer = next(c.source for c in notebook.cells if "### BEGIN SOLUTION" in c.source)
    written = [line for line in answer.splitlines() if "### " not in line]
    assert written == lesson08.q1.solution_text.strip().splitlines()


def test_a_blank_answer_is_not_attempted_and_a_non_function_is_wrong():
    assert judged(not_attempted).status == "not attempted"
    result = judged(capstone.make_dataset(8, 8))
    assert result.status == "wrong" and "your function itself" in result.message


@pytest.mark.parametrize("make, words", [
    (a_swapped_activation, "the model was changed"),
    (a_new_model, "untrained"),
    (a_learning_rate_too_high, "accuracy fell"),
    (weights_in_half, "float32"),
], ids=lambda value: getattr(value, "__name__", ""))
def test_wrong_answers_are_rejected(solution, make, words):
    result = judged(make(solution))
    assert result.status == "wrong"
    assert words in result.message, result.message


def test_the_baseline_itself_is_not_faster():
    result = judged(the_baseline_again)
    assert result.status == "wrong" and "not fast enough" in result.message, result.message


def test_the_threshold_depends_on_the_device_and_mode(monkeypatch):
    assert lesson08.threshold(torch.device("cpu")) == lesson08.THRESHOLDS["cpu"]
    monkeypatch.setenv("GPULAB_QUICK", "0")
    full = lesson08.threshold(torch.device("cuda"))
    monkeypatch.setenv("GPULAB_QUICK", "1")
    assert full == lesson08.THRESHOLDS["cuda full"] > lesson08.threshold(torch.device("cuda"))
