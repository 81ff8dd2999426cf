"""Lesson 10, the GPT made fast: a graph break found and fixed.

The check does not time the learner's code: it compares what the learner's function returns with what the function
it fixes returns, eagerly and compiled, and asks ``torch._dynamo.explain`` how many graphs it makes."""

import math
import warnings

import torch

from ..check import Question, Wrong

# ----- q1: a graph break found and fixed ------------------------------------------------------------------------------

def scaled_mlp(x, w1, w2, limit: float = 4.0):
    """An MLP's forward pass with a debugging habit in it: the activations' largest magnitude read back to Python,
    and a branch on it that scales them down when they grow past ``limit``."""
    h = x @ w1
    peak = h.abs().max().item()  # a Python number: graph break (and, on a GPU, a wait for the GPU)
    if peak > limit:  # a branch on the data
        h = h * (limit / peak)
    return torch.relu(h) @ w2


def _inputs(kind: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    x, w1, w2 = torch.randn(16, 32, generator=g), torch.randn(32, 64, generator=g) / 8, torch.randn(64, 8, generator=g)
    if kind == "large":  # activations past the limit: the branch scales them
        w1 = w1 * 10
    if kind == "negative":  # one strongly negative unit: the largest magnitude is not the largest value
        x = x.abs()
        w1[:, 0] = -5.0
    if kind == "zero":  # all zero: the largest magnitude is 0, and limit / 0 is inf
        x = torch.zeros_like(x)
    if kind == "nan":  # one NaN in the input: its row's output is NaN, the others are as they were
        x[3, 5] = math.nan
    return x, w1, w2


_KINDS = (("small", 1), ("large", 2), ("negative", 3), ("large", 4), ("zero", 5), ("nan", 6))


def _same(got, expected) -> bool:
    return isinstance(got, torch.Tensor) and got.shape == expected.shape and torch.allclose(
        got, expected, rtol=1e-4, atol=1e-5, equal_nan=True)


def _differs_on(kind: str, x, w1) -> str:
    """What the inputs of ``kind`` ask of the function, in words."""
    if kind == "zero":
        return ("on an all-zero input (its largest magnitude is 0, so limit / peak is inf: the output must stay 0, not "
                "NaN; arithmetic such as 0 × inf gives NaN where torch.where would pick the other branch)")
    if kind == "nan":
        return ("on an input with one NaN (scaled_mlp leaves the other rows as they are: its `peak > limit` is False "
                "for a NaN peak; a clamp of limit / NaN is NaN and spreads to every row, torch.fmin or torch.where "
                "do not)")
    peak = (x @ w1).abs().max().item()
    return (f"where the activations' largest magnitude ({peak:.3g}) is past the limit, so they must be scaled by "
            "limit / peak" if peak > 4.0 else f"where the activations stay within the limit ({peak:.3g} ≤ 4), so "
            "they must be left as they are")


def _check_graph_break(scaled_mlp_fixed) -> str:
    if not callable(scaled_mlp_fixed):
        raise Wrong("pass your function itself: `q3.check(scaled_mlp_fixed)`")
    for kind, seed in _KINDS:
        x, w1, w2 = _inputs(kind, seed)
        got = scaled_mlp_fixed(x.clone(), w1.clone(), w2.clone())
        expected = scaled_mlp(x, w1, w2)
        if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
            raise Wrong(f"return the MLP's output, a tensor of shape {tuple(expected.shape)}, got {got!r:.80}")
        if not _same(got, expected):
            raise Wrong(f"your function computes something else than scaled_mlp {_differs_on(kind, x, w1)}; keep what "
                        "it computes, change only how (the branch becomes arithmetic on tensors)")
    learner_setting = torch._dynamo.config.capture_scalar_outputs
    torch._dynamo.reset()
    # The default setting: capture_scalar_outputs=True puts .item() in the graph, but the number still goes to Python
    # (on a GPU, a wait for it), which is what the question asks to remove.
    with warnings.catch_warnings(), torch._dynamo.config.patch(capture_scalar_outputs=False):
        warnings.simplefilter("ignore")  # dynamo's own advice on stderr; the breaks are reported below
        explanation = torch._dynamo.explain(scaled_mlp_fixed)(*_inputs("large", 5))
        torch._dynamo.reset()
        if explanation.graph_break_count or explanation.graph_count != 1:
            reasons = [r.reason.splitlines()[0] for r in explanation.break_reasons]
            item = any("item()" in r for r in reasons)
            raise Wrong(f"torch._dynamo.explain still finds {explanation.graph_count} graph(s) and "
                        f"{explanation.graph_break_count} graph break(s) in your function "
                        f"({'; '.join(dict.fromkeys(reasons)) or 'no graph'}). Keep the peak a tensor (no .item()) and "
                        "replace the `if` on data by torch.where"
                        + (". capture_scalar_outputs=True only hides the .item() break: the number still goes to "
                           "Python, a wait for the GPU every call" if item and learner_setting else ""))
        compiled = torch.compile(scaled_mlp_fixed, backend="eager", fullgraph=True)
        for kind, seed in _KINDS:
            x, w1, w2 = _inputs(kind, seed)
            if not _same(compiled(x, w1, w2), scaled_mlp(x, w1, w2)):
                torch._dynamo.reset()
                raise Wrong(f"under torch.compile your function computes something else than it does eagerly "
                            f"{_differs_on(kind, x, w1)}: the compiled path must compute what the eager one does (no "
                            "branch on torch.compiler.is_compiling())")
    torch._dynamo.reset()
    return ("same results as scaled_mlp with and without scaling, on all-zero and NaN inputs, eagerly and compiled, in "
            "one graph: no .item(), no branch on data.")


# ----- the questions ------------------------------------------------------------------------------------------------

q1 = Question(
    lesson="10", number=1, title="find and fix a graph break", checker=_check_graph_break,
    hint_text="`torch._dynamo.explain(scaled_mlp)(x, w1, w2)` lists the breaks: `.item()` and the `if` on its value. "
              "Keep the peak a tensor, `h.abs().amax()`, and write the branch as arithmetic: "
              "`torch.where(peak > limit, h * (limit / peak), h)`. torch.where picks one branch per element, so the "
              "other may hold an inf or a NaN (an all-zero input) without harm; a product with a 0/1 mask, or a clamp "
              "of a NaN, would spread it.",
    solution_text="""
def scaled_mlp_fixed(x, w1, w2, limit=4.0):
    h = x @ w1
    peak = h.abs().amax()                                   # a tensor: no sync, no break
    h = torch.where(peak > limit, h * (limit / peak), h)    # the branch as data
    return torch.relu(h) @ w2
""",
)
