"""Lesson 11's exercise checks: one block's activation memory worked out on paper, and a tensor scaled into fp8. Each
accepts the solution it shows and an unusual right answer, calls a blank answer "not attempted", and rejects
plausible wrong answers with a message that names the mistake. No check times the learner's code."""

import pytest
import torch

from gpulab import text
from gpulab.check import ____
from gpulab.memory import MemoryTracker
from gpulab.questions import lesson11

from .conftest import checker_values, shown_solution


def blank_function(*args, **kwargs):
    raise NotImplementedError


def right(question, name):
    return shown_solution(question, name, torch=torch)


# ----- q1: one block's activation memory ------------------------------------------------------------------------------

def term_by_term(batch, seq_len, n_embd, n_head, attention):
    """Unusual but right: each kept tensor named, in bytes."""
    d, tokens, written_out = n_embd, batch * seq_len, attention == "manual"
    per_token = {"input": d, "LayerNorm outputs": 2 * d, "LayerNorm statistics": 4, "q, k, v": 3 * d,
                 "attention output": d, "residual after attention": d, "MLP hidden, before and after GELU": 8 * d,
                 "attention's own": n_head * seq_len if written_out else n_head}
    return 4 * tokens * sum(per_token.values()) + (seq_len**2 if written_out else 0)


def without_statistics(batch, seq_len, n_embd, n_head, attention):
    """Right within the tolerance: the LayerNorms' statistics and the log-sum-exp are about 1 % of a block's bytes."""
    written_out = attention == "manual"
    return 4 * batch * seq_len * (16 * n_embd + (n_head * seq_len if written_out else 0)) + (seq_len**2 if written_out
                                                                                            else 0)


def numbers_not_bytes(batch, seq_len, n_embd, n_head, attention):
    return term_by_term(batch, seq_len, n_embd, n_head, attention) / 4


def no_probabilities(batch, seq_len, n_embd, n_head, attention):
    return 4 * batch * seq_len * (16 * n_embd + 4) + (seq_len**2 if attention == "manual" else 0)


def probabilities_for_sdpa_too(batch, seq_len, n_embd, n_head, attention):
    return term_by_term(batch, seq_len, n_embd, n_head, "manual") - seq_len**2


def t_squared_per_token(batch, seq_len, n_embd, n_head, attention):
    own = seq_len * seq_len if attention == "manual" else n_head
    return 4 * batch * seq_len * (16 * n_embd + 4 + own) + (seq_len**2 if attention == "manual" else 0)


def no_mlp_hidden(batch, seq_len, n_embd, n_head, attention):
    return term_by_term(batch, seq_len, n_embd, n_head, attention) - 4 * batch * seq_len * 8 * n_embd


def per_token(batch, seq_len, n_embd, n_head, attention):
    return term_by_term(batch, seq_len, n_embd, n_head, attention) / (batch * seq_len)


def measured_here(batch, seq_len, n_embd, n_head, attention):
    """Right number, wrong way: the question asks for the formula, not a measurement."""
    kept = []
    for layers in (1, 2):
        model = text.GPT(text.GPTConfig(seq_len=seq_len, n_layer=layers, n_head=n_head, n_embd=n_embd,
                                        attention=attention))
        with MemoryTracker() as tracker:
            loss = model(torch.zeros(batch, seq_len, dtype=torch.long), torch.zeros(batch, seq_len, dtype=torch.long))
        kept.append(tracker.current)
        del loss
    return kept[1] - kept[0]


TWO_NUMBERS = torch.full((2,), 1e6)  # made before the check: no tensor operation runs inside the answer


@pytest.mark.parametrize("answer", [lambda: right(lesson11.q1, "activation_bytes"), lambda: term_by_term,
                                    lambda: without_statistics,
                                    lambda: lambda *cfg: torch.tensor(term_by_term(*cfg))],
                         ids=["shown", "term by term", "within the tolerance", "torch.tensor(value)"])
def test_q1_accepts_right_answers(answer):
    lesson11.q1.check(answer())
    assert lesson11.q1.last.status == "correct", lesson11.q1.last.message


@pytest.mark.parametrize("wrong, says", [
    (numbers_not_bytes, "numbers, not bytes"),
    (no_probabilities, "leaves out attention's probabilities"),
    (probabilities_for_sdpa_too, "never keeps the probabilities"),
    (t_squared_per_token, "not T² per token"),
    (no_mlp_hidden, "misses the MLP's hidden layer"),
    (per_token, "per token"),
    (measured_here, "on paper"),
    (lambda *cfg: "16d", "return a number of bytes"),
    (lambda *cfg: TWO_NUMBERS, "return a number of bytes"),
    (42, "pass your function itself"),
])
def test_q1_rejects_plausible_wrong_answers(wrong, says):
    lesson11.q1.check(wrong)
    assert lesson11.q1.last.status == "wrong"
    assert says in lesson11.q1.last.message, lesson11.q1.last.message


def test_q1s_measurement_is_the_lessons_prediction():
    """The check's reference, what autograd keeps for one block on the CPU, is the lesson's count, term by term."""
    for cfg in lesson11._CONFIGS:
        assert lesson11.measured_bytes(*cfg) == term_by_term(*cfg)


# ----- q2: a tensor scaled into fp8 ----------------------------------------------------------------------------------

def by_division(t, dtype):
    """Unusual but right: divided by the step between the format's largest and the tensor's, a Python float back."""
    step = t.abs().max().clamp(min=1e-12) / torch.finfo(dtype).max
    return (t / step).to(dtype), step.item()


def unscaled(t, dtype):
    return t.to(dtype), torch.ones(())


def signed_peak(t, dtype):
    scale = torch.finfo(dtype).max / t.amax().float().clamp(min=1e-12)
    return (t.float() * scale).to(dtype), scale.reciprocal()


def e4m3_everywhere(t, dtype):
    scale = 448.0 / t.abs().amax().float().clamp(min=1e-12)
    return (t.float() * scale).to(dtype), scale.reciprocal()


def unclamped(t, dtype):
    scale = torch.finfo(dtype).max / t.abs().amax().float()
    return (t.float() * scale).to(dtype), scale.reciprocal()


def the_scale_itself(t, dtype):
    scale = torch.finfo(dtype).max / t.abs().amax().float().clamp(min=1e-12)
    return (t.float() * scale).to(dtype), scale


def kept_in_bf16(t, dtype):
    return right(lesson11.q2, "to_fp8")(t, dtype)[0].to(torch.bfloat16), 1.0


@pytest.mark.parametrize("answer", [lambda: right(lesson11.q2, "to_fp8"), lambda: by_division],
                         ids=["shown", "by division"])
def test_q2_accepts_right_answers(answer):
    lesson11.q2.check(answer())
    assert lesson11.q2.last.status == "correct", lesson11.q2.last.message


@pytest.mark.parametrize("wrong, says", [
    (unscaled, "casts without scaling"),
    (signed_peak, "largest value, not the largest magnitude"),
    (e4m3_everywhere, "scales to e4m3's largest"),
    (unclamped, "clamp it before dividing"),
    (the_scale_itself, "returns the scale itself"),
    (kept_in_bf16, "cast to float8_e4m3fn"),
    (lambda t, dtype: t.to(dtype), "return two things"),
    (lambda t, dtype: (t.to(dtype), "1"), "return one number"),
    ("to_fp8", "pass your function itself"),
])
def test_q2_rejects_plausible_wrong_answers(wrong, says):
    lesson11.q2.check(wrong)
    assert lesson11.q2.last.status == "wrong"
    assert says in lesson11.q2.last.message, lesson11.q2.last.message


# ----- answers that walk up the stack to the checks' own values -------------------------------------------------------

def walking(reference, fallback):
    """An answer that returns the right answer (``reference`` of its arguments) if any value on the check's frames
    equals it, else ``fallback``; ``.found`` keeps what it found."""
    def answer(*args):
        right_answer = reference(*args)
        found = [v for v in checker_values() if type(v) is type(right_answer) and _same(v, right_answer)]
        answer.found += found
        return found[-1] if found else fallback
    answer.found = []
    return answer


def _same(a, b) -> bool:
    if isinstance(a, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a.float(), b.float()))
    return a == b


@pytest.mark.parametrize("question, reference, fallback", [
    (lesson11.q1, lambda *cfg: lesson11.measured_bytes.__wrapped__(*cfg), 0),
    (lesson11.q2, lesson11.fp8_scaled, (torch.zeros(64, 32), 1.0)),
], ids=["q1", "q2"])
def test_stack_walking_answers_find_no_expected_value(question, reference, fallback):
    answer = walking(reference, fallback)
    question.check(answer)
    assert question.last.status == "wrong" and answer.found == [], (question.last.message, answer.found[:3])


@pytest.mark.parametrize("question, blank", [
    (lesson11.q1, (blank_function,)), (lesson11.q1, (____,)), (lesson11.q2, (blank_function,)), (lesson11.q2, (____,)),
])
def test_blank_answers_are_not_attempted(question, blank):
    question.check(*blank)
    assert question.last.status == "not attempted"
