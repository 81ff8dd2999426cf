"""Lesson 09: the text, the GPT and the causal kernels' FLOPs the lesson writes out (gpulab holds the same code for
lessons 10 and 11), and the exercise checks: each question accepts the solution it shows and an unusual right answer,
calls a blank answer "not attempted", and rejects plausible wrong answers with a message that names the mistake. No
check times the learner's code."""

import pytest
import torch
import torch.nn.functional as F

from gpulab import datasheets, flops, text
from gpulab.check import ____
from gpulab.questions import lesson09

from .conftest import checker_values, shown_solution
from .lesson_cells import Cells

LESSON = Cells("09_mfu_and_attention.ipynb")


def blank_function(*args, **kwargs):
    raise NotImplementedError


def right(question, name):
    return shown_solution(question, name, torch=torch)


# ----- the text and the model ---------------------------------------------------------------------------------------

def test_python_source_is_bytes_with_an_end_of_file_token_between_files():
    tokens = text.python_source(max_bytes=300_000)
    assert tokens.dtype == torch.int64 and len(tokens) == 300_000
    assert tokens.min() >= 0 and tokens.max() == text.EOT and (tokens == text.EOT).sum() >= 1
    assert torch.equal(tokens, text.python_source(max_bytes=300_000))  # the same text every time
    first = text.source_files()[0].read_bytes()
    assert bytes(tokens[:len(first)].tolist()) == first and tokens[len(first)] == text.EOT
    assert not any(part in {"test", "site-packages"} for path in text.source_files() for part in path.parts[-3:-1])


def test_batches_are_windows_and_their_next_tokens_and_decode_reads_them():
    tokens = text.python_source(max_bytes=50_000)
    train, val = text.split(tokens, 0.1)
    assert len(train) == 45_000 and torch.equal(torch.cat([train, val]), tokens)
    x, y = text.batch(train, 4, 32, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (4, 32) and torch.equal(x[:, 1:], y[:, :-1])
    x2, _ = text.batch(train, 4, 32, torch.Generator().manual_seed(0))
    assert torch.equal(x, x2)
    assert text.decode([104, 105, text.EOT, 33]) == "hi\n<EOT>\n!"


def lesson_model():
    """The lesson's GPTConfig and GPT, as its two model cells define them."""
    import dataclasses
    import math

    from torch.utils.checkpoint import checkpoint

    scope = {"__name__": "lesson09_cell", "math": math, "torch": torch, "nn": torch.nn, "F": torch.nn.functional,
             "text": text, "dataclass": dataclasses.dataclass, "checkpoint": checkpoint}
    LESSON.run(scope, "def manual_attention")
    source = LESSON.code("class GPT(nn.Module)").split("\ncfg = GPTConfig(**SIZE)")[0]
    exec(compile(source, "<lesson 09's model cell>", "exec"), scope)
    return scope["GPTConfig"], scope["GPT"]


@pytest.mark.parametrize("options", [{}, {"attention": "sdpa", "checkpoint": True}, {"padded_vocab": 320}])
def test_the_gpt_the_lesson_writes_out_is_gpulabs(options):
    """The exercise checks and these tests build gpulab.text.GPT; the lesson writes it out in a cell: the same model."""
    GPTConfig, GPT = lesson_model()
    size = dict(seq_len=32, n_layer=2, n_head=2, n_embd=32, **options)
    ours, theirs = text.GPT(text.GPTConfig(**size), seed=3), GPT(GPTConfig(**size), seed=3)
    idx = torch.randint(0, text.VOCAB, (2, 32))
    assert torch.equal(ours(idx), theirs(idx)) and ours(idx).shape == (2, 32, text.VOCAB)
    assert torch.equal(ours(idx, idx), theirs(idx, idx))


def test_the_causal_kernel_flops_the_lesson_writes_out_are_gpulabs():
    """Lessons 10 and 11 count HFU with gpulab.flops.kernel_flops; lesson 09 writes it out: the same count."""
    scope = {"flops": flops}
    LESSON.define(scope, "def kernel_flops", "FUSED_ATTENTION", "kernel_flops")
    assert scope["FUSED_ATTENTION"] == flops.FUSED_ATTENTION
    q, k, v = (torch.randn(1, 2, 128, 16, requires_grad=True) for _ in range(3))
    counted = flops.count(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward())
    assert scope["kernel_flops"](counted, 128) == flops.kernel_flops(counted, 128) < counted.total


def test_padding_the_vocabulary_changes_no_weight_and_no_loss():
    cfg = dict(seq_len=32, n_layer=2, n_head=2, n_embd=32)
    plain, padded = text.GPT(text.GPTConfig(**cfg)), text.GPT(text.GPTConfig(**cfg, padded_vocab=320))
    assert padded.wte.weight.shape == (320, 32) and torch.equal(padded.wte.weight[:text.VOCAB], plain.wte.weight)
    idx = torch.randint(0, text.VOCAB, (2, 32))
    assert torch.allclose(plain(idx, idx), padded(idx, idx))


# ----- q1: FLOPs per token ----------------------------------------------------------------------------------------------

def per_token_from_the_rule(n_layer, n_head, n_embd, seq_len, vocab_size):
    """Unusual but right: 6·N + 12·L·d·T with N counted parameter by parameter, biases and LayerNorms included."""
    per_block = (3 * n_embd * n_embd + 3 * n_embd) + (n_embd * n_embd + n_embd) + (4 * n_embd * n_embd + 4 * n_embd) \
        + (4 * n_embd * n_embd + n_embd) + 4 * n_embd
    n = n_layer * per_block + 2 * n_embd + vocab_size * n_embd
    return 6 * n + 12 * n_layer * n_embd * seq_len


def params(n_layer, n_embd, vocab_size):
    return n_layer * (12 * n_embd**2 + 13 * n_embd) + 2 * n_embd + vocab_size * n_embd


def six_n_only(n_layer, n_head, n_embd, seq_len, vocab_size):
    return 6 * params(n_layer, n_embd, vocab_size)


def forward_only(n_layer, n_head, n_embd, seq_len, vocab_size):
    return 2 * params(n_layer, n_embd, vocab_size) + 4 * n_layer * n_embd * seq_len


def causal_half(n_layer, n_head, n_embd, seq_len, vocab_size):
    return 6 * params(n_layer, n_embd, vocab_size) + 6 * n_layer * n_embd * seq_len


def with_position_embedding(n_layer, n_head, n_embd, seq_len, vocab_size):
    return 6 * (params(n_layer, n_embd, vocab_size) + seq_len * n_embd) + 12 * n_layer * n_embd * seq_len


def head_counted_twice(n_layer, n_head, n_embd, seq_len, vocab_size):
    return 6 * (params(n_layer, n_embd, vocab_size) + vocab_size * n_embd) + 12 * n_layer * n_embd * seq_len


def head_left_out(n_layer, n_head, n_embd, seq_len, vocab_size):
    return 6 * params(n_layer, n_embd, 0) + 12 * n_layer * n_embd * seq_len


def heads_multiply(n_layer, n_head, n_embd, seq_len, vocab_size):
    return 6 * params(n_layer, n_embd, vocab_size) + 12 * n_layer * n_embd * seq_len * n_head


TWO_NUMBERS = torch.full((2,), 1e9)  # made before the check: no tensor operation runs inside the answer


def per_sequence(n_layer, n_head, n_embd, seq_len, vocab_size):
    return seq_len * per_token_from_the_rule(n_layer, n_head, n_embd, seq_len, vocab_size)


def counts_with_flop_counter_mode(n_layer, n_head, n_embd, seq_len, vocab_size):
    """Right number, wrong way: the question asks for the formula."""
    return lesson09.counted_flops_per_token.__wrapped__(n_layer, n_head, n_embd, seq_len, vocab_size)


def as_a_tensor(n_layer, n_head, n_embd, seq_len, vocab_size):
    """Right, returned as a 0-d tensor: arithmetic on single numbers is still working it out on paper."""
    weights = torch.tensor(n_layer * 12 * n_embd**2 + n_embd * vocab_size, dtype=torch.float64)
    return 3 * (2 * weights + 4 * n_layer * seq_len * n_embd)


@pytest.mark.parametrize("answer", [lambda: right(lesson09.q1, "flops_per_token"), lambda: per_token_from_the_rule,
                                    lambda: as_a_tensor,
                                    lambda: lambda *cfg: torch.tensor(per_token_from_the_rule(*cfg))],
                         ids=["shown", "rule-of-thumb", "0-d tensor arithmetic", "torch.tensor(value)"])
def test_q1_accepts_right_answers(answer):
    lesson09.q1.check(answer())
    assert lesson09.q1.last.status == "correct", lesson09.q1.last.message


@pytest.mark.parametrize("wrong, says", [
    (six_n_only, "leaves out attention"),
    (forward_only, "forward pass only"),
    (causal_half, "halves attention for the causal mask"),
    (with_position_embedding, "position embedding"),
    (head_counted_twice, "counted once"),
    (head_left_out, "head's matmul is missing"),
    (heads_multiply, "heads split d"),
    (per_sequence, "per sequence"),
    (counts_with_flop_counter_mode, "on paper"),
    (lambda *cfg: "6N", "return a number"),
    (lambda *cfg: TWO_NUMBERS, "return a number"),
    (42, "pass your function itself"),
])
def test_q1_rejects_plausible_wrong_answers(wrong, says):
    lesson09.q1.check(wrong)
    assert lesson09.q1.last.status == "wrong"
    assert says in lesson09.q1.last.message, lesson09.q1.last.message


# ----- q2: MFU against the right peak ---------------------------------------------------------------------------------

H100_PEAKS = dict(datasheets.SHEETS["H100 SXM"].tflops)
MEASURED = (2.4e9, 0.03, {})  # a CPU's step: no datasheet peaks, so only the hand-made steps are checked
ON_AN_H100 = (2.0e13, 0.12, H100_PEAKS)  # a step on an H100, with its dense peaks


@pytest.fixture
def on_an_h100(monkeypatch):
    """The check sees an H100 SXM as this machine's card (the step itself is the test's)."""
    monkeypatch.setattr(lesson09, "_device_peaks", lambda: dict(H100_PEAKS))


def precision_of(autocast_dtype, tf32, peaks):
    names = {torch.bfloat16: "bf16", torch.float16: "fp16"}
    return names.get(autocast_dtype) or ("tf32" if tf32 and "tf32" in peaks else "fp32")


def mfu_by_lookup(flops_per_step, seconds_per_step, autocast_dtype, tf32, peaks_tflops):
    """Unusual but right: a table from the dtype to the precision."""
    return flops_per_step / seconds_per_step / 1e12 / peaks_tflops[precision_of(autocast_dtype, tf32, peaks_tflops)]


def tf32_whenever_it_is_on(flops_per_step, seconds_per_step, autocast_dtype, tf32, peaks_tflops):
    """torchtitan #668: a bf16 run divided by the TF32 peak."""
    if tf32 and "tf32" in peaks_tflops:
        return flops_per_step / seconds_per_step / (peaks_tflops["tf32"] * 1e12)
    return mfu_by_lookup(flops_per_step, seconds_per_step, autocast_dtype, tf32, peaks_tflops)


def tf32_taken_for_granted(flops_per_step, seconds_per_step, autocast_dtype, tf32, peaks_tflops):
    """TF32 whenever the switch is on, on a card without TF32 too (a T4)."""
    names = {torch.bfloat16: "bf16", torch.float16: "fp16"}
    precision = names.get(autocast_dtype) or ("tf32" if tf32 else "fp32")
    return flops_per_step / seconds_per_step / (peaks_tflops[precision] * 1e12)


def an_h100s_peaks_on_every_card(flops_per_step, seconds_per_step, autocast_dtype, tf32, peaks_tflops):
    """One card's datasheet constants, whatever card the step ran on."""
    return mfu_by_lookup(flops_per_step, seconds_per_step, autocast_dtype, tf32, H100_PEAKS)


def sparse_peak(*args):
    return mfu_by_lookup(*args) / 2


def as_percentage(*args):
    return 100 * mfu_by_lookup(*args)


def tflops_not_scaled(*args):
    return mfu_by_lookup(*args) * 1e12


def fastest_peak(flops_per_step, seconds_per_step, autocast_dtype, tf32, peaks_tflops):
    return flops_per_step / seconds_per_step / (max(peaks_tflops.values()) * 1e12)


def ignores_autocast(flops_per_step, seconds_per_step, autocast_dtype, tf32, peaks_tflops):
    return mfu_by_lookup(flops_per_step, seconds_per_step, None, tf32, peaks_tflops)


@pytest.mark.parametrize("answer", [lambda: right(lesson09.q2, "step_mfu"), lambda: mfu_by_lookup],
                         ids=["shown", "lookup"])
def test_q2_accepts_right_answers_on_hand_made_steps_and_a_cpus(answer):
    lesson09.q2.check(answer(), *MEASURED)
    assert lesson09.q2.last.status == "correct", lesson09.q2.last.message
    assert "no vendor's datasheet peak" in lesson09.q2.last.message
    lesson09.q2.check(answer())
    assert lesson09.q2.last.status == "correct"


def test_q2_checks_the_learners_own_step_against_this_cards_dense_peak(on_an_h100):
    lesson09.q2.check(right(lesson09.q2, "step_mfu"), *ON_AN_H100)
    assert lesson09.q2.last.status == "correct", lesson09.q2.last.message
    assert "on yours" in lesson09.q2.last.message and "dense fp32 peak" in lesson09.q2.last.message


@pytest.mark.parametrize("wrong, says", [
    (tf32_whenever_it_is_on, "TF32 peak"),
    (tf32_taken_for_granted, "'tf32' peak the T4 does not have"),
    (an_h100s_peaks_on_every_card, "another card's"),
    (sparse_peak, "'with sparsity'"),
    (as_percentage, "percentage"),
    (tflops_not_scaled, "multiply by 1e12"),
    (fastest_peak, "fastest peak"),
    (ignores_autocast, "under autocast the matmuls run in bf16"),
    (lambda *args: None, "as a fraction"),
])
def test_q2_rejects_plausible_wrong_answers(wrong, says):
    lesson09.q2.check(wrong, *MEASURED)
    assert lesson09.q2.last.status == "wrong"
    assert says in lesson09.q2.last.message, lesson09.q2.last.message


@pytest.mark.parametrize("peaks, says", [
    ([67.0], "as a dict of TFLOP/s"),
    ({"fp32": "67"}, "positive numbers of TFLOP/s"),
    ({"fp32": None}, "positive numbers of TFLOP/s"),
    ({p: flops.Ceiling(p, 0.9 * t) for p, t in H100_PEAKS.items()}, "measured ceilings"),
    ({p: 2 * t for p, t in H100_PEAKS.items()}, "'with sparsity' figures"),
    (dict(datasheets.SHEETS["A100 SXM 80GB"].tflops), "not this card's dense datasheet peaks"),
])
def test_q2_says_what_is_wrong_with_the_peaks_passed_in_never_blaming_the_learners_code(on_an_h100, peaks, says):
    """The check's own conversions never surface as "your code raised": a Ceiling, a string, None, another card's
    or a sparse figure each get their own message."""
    lesson09.q2.check(right(lesson09.q2, "step_mfu"), 2.0e13, 0.12, peaks)
    assert lesson09.q2.last.status == "wrong"
    assert says in lesson09.q2.last.message and "your code raised" not in lesson09.q2.last.message, \
        lesson09.q2.last.message


def test_q2_on_a_cpu_refuses_another_cards_peaks():
    lesson09.q2.check(right(lesson09.q2, "step_mfu"), 2.4e9, 0.03, H100_PEAKS)
    assert lesson09.q2.last.status == "wrong" and "no datasheet lists this device" in lesson09.q2.last.message


# ----- q3: which attention backend ran ------------------------------------------------------------------------------------

def by_operator(names):
    """Unusual but right: the operator SDPA called, looked up by its name's end."""
    ends = {"_cudnn_attention": "cudnn", "_flash_attention": "flash", "_flash_attention_for_cpu": "flash",
            "_efficient_attention": "efficient", "_attention_math": "math"}
    for name in names:
        for end, backend in ends.items():
            if name.startswith("aten::_scaled_dot_product") and name.endswith(end):
                return backend
    raise ValueError("no attention operator in the profile")


def flash_first(names):
    joined = " ".join(names).lower()
    for word, backend in (("flash", "flash"), ("cudnn", "cudnn"), ("efficient", "efficient")):
        if word in joined:
            return backend
    return "math"


def kernels_only(names):
    joined = " ".join(names).lower()
    if "pytorch_flash" in joined:
        return "flash"
    if "fmha" in joined:
        return "efficient"
    if "cudnn" in joined:
        return "cudnn"
    return "math"


def any_attention_is_flash(names):
    return "flash" if any("scaled_dot_product_attention" in n for n in names) else "math"


def efficient_forgotten(names):
    joined = " ".join(names).lower()
    if "cudnn" in joined:
        return "cudnn"
    return "flash" if "flash" in joined else "math"


@pytest.mark.parametrize("answer", [lambda: right(lesson09.q3, "attention_backend"), lambda: by_operator],
                         ids=["shown", "by-operator"])
def test_q3_accepts_right_answers(answer):
    lesson09.q3.check(answer())
    assert lesson09.q3.last.status == "correct", lesson09.q3.last.message


@pytest.mark.parametrize("wrong, says", [
    (flash_first, "'flash' in their names too"),
    (kernels_only, "CPU profile"),
    (any_attention_is_flash, "fmha_cutlassF"),
    (efficient_forgotten, "fmha_cutlassF"),
    (lambda names: 1, "the backend that ran is"),
    ("flash", "pass your function itself"),
])
def test_q3_rejects_plausible_wrong_answers(wrong, says):
    lesson09.q3.check(wrong)
    assert lesson09.q3.last.status == "wrong"
    assert says in lesson09.q3.last.message, lesson09.q3.last.message


def test_the_profiles_recorded_here_name_the_forced_backend():
    assert lesson09.profile_names("efficient", "cpu") is None  # not on a CPU
    assert any(n.endswith("_attention_math") for n in lesson09.profile_names("math", "cpu"))
    assert any(n.endswith("_flash_attention_for_cpu") for n in lesson09.profile_names(None, "cpu"))



def test_the_checks_reference_names_the_backend_each_recorded_profile_was_forced_to():
    for profiles in (lesson09._GPU_PROFILES, lesson09._CPU_PROFILES):
        for backend, names in profiles.items():
            assert lesson09.backend_that_ran(names) == backend
    assert lesson09.backend_that_ran(lesson09.profile_names("math", "cpu")) == "math"
    assert lesson09.backend_that_ran(["aten::scaled_dot_product_attention", "aten::bmm"]) is None


# ----- answers that walk up the stack to the checks' own values -------------------------------------------------------

def walking(reference, fallback):
    """An answer that walks up the stack to the check's frames and returns the right answer (``reference`` of its
    arguments) if any value there equals it, else ``fallback``; ``.found`` keeps what it found."""
    def answer(*args, **kwargs):
        right_answer = reference(*args, **kwargs)
        found = [v for v in checker_values() if type(v) is type(right_answer) and _same(v, right_answer)]
        answer.found += found
        return found[-1] if found else fallback
    answer.found = []
    return answer


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and bool(torch.allclose(a, b))
    return a == b or (isinstance(a, float) and abs(a - b) <= 1e-9 * abs(b))


@pytest.mark.parametrize("question, reference, fallback, args", [
    (lesson09.q1, lambda *cfg: float(lesson09.counted_flops_per_token(*cfg)), 0.0, ()),
    (lesson09.q2, lesson09.expected_mfu, -1.0, MEASURED),
    (lesson09.q3, lesson09.backend_that_ran, "none", ()),
], ids=["q1", "q2", "q3"])
def test_stack_walking_answers_find_no_expected_value(question, reference, fallback, args):
    answer = walking(reference, fallback)
    question.check(answer, *args)
    assert question.last.status == "wrong" and answer.found == [], (question.last.message, answer.found[:3])

@pytest.mark.gpu
def test_q3_is_right_on_this_gpus_own_profiles():
    lesson09.q3.check(right(lesson09.q3, "attention_backend"))
    assert lesson09.q3.last.status == "correct" and "your machine's" in lesson09.q3.last.message


# ----- blanks ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("question, blank", [
    (lesson09.q1, (blank_function,)), (lesson09.q1, (____,)),
    (lesson09.q2, (blank_function, *MEASURED)), (lesson09.q2, (____, *MEASURED)),
    (lesson09.q3, (blank_function,)),
])
def test_blank_answers_are_not_attempted(question, blank):
    question.check(*blank)
    assert question.last.status == "not attempted"
