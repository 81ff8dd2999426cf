"""Answers worked out on paper: ``TensorOperations`` counts the tensor operations an answer runs, so that a check
that asks for a formula (lesson 09's FLOPs per token, lesson 11's activation bytes) can refuse one that builds a
model and measures it instead."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class TensorOperations(TorchDispatchMode):
    """Counts the tensor operations run inside it on tensors of more than one number: a model's weights, a batch (a
    model built and counted inside the learner's function). Arithmetic on single numbers, such as returning
    ``torch.tensor(value)``, is working it out on paper and is not counted."""

    def __init__(self):
        super().__init__()
        self.ran = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(isinstance(t, torch.Tensor) and t.numel() > 1 for t in tree_leaves((args, kwargs, out))):
            self.ran += 1
        return out
