"""Lesson 00's plan: the matmul sweep on the GPU and the CPU, the crossover compared in interleaved pairs, and the
CPU's threads."""

from .card import Card
from .lesson_plan import LessonPlan, Part, Regime, target_minutes
from .predict import bench_s, compare_s, cpu_matmul_s, matmul_s

LADDER = [2**i for i in range(4, 14)]  # 16 ... 8192
CALL_S = 0.25  # no single product in the sweep takes longer: a size past it adds seconds, not insight
START_S = 10.0  # imports, device facts, NVML, nvidia-smi and the doctor (estimate)


def plan(card: Card, *, quick: bool = False) -> LessonPlan:
    if quick:  # the sizes the lesson chose before it was planned; the CPU-GPU pairs took 0.5 s in both modes
        sizes = dict(matmul_sizes=[16, 32, 64, 128, 256, 512], cpu_max=4096, min_time=0.05, compare_min_time=0.5,
                     threads_min_time=0.3, threads_pairs=5)
        return LessonPlan("00", TITLE, card, True, sizes)
    fits = [n for n in LADDER if 3 * n * n * 4 <= card.usable_gb() * 1e9 and matmul_s(card, n) <= CALL_S]
    cpu_fits = [n for n in LADDER if n <= 4096 and cpu_matmul_s(card, n) <= CALL_S]
    sizes = dict(matmul_sizes=fits, cpu_max=cpu_fits[-1], min_time=0.3, compare_min_time=0.5, threads_min_time=1.0,
                 threads_pairs=None)
    why = {"matmul_sizes": f"up to the largest fp32 product that takes at most {CALL_S} s here and fits its memory",
           "cpu_max": f"the CPU's largest product within {CALL_S} s on {card.cpu_cores} cores"}
    gpu = [matmul_s(card, n) for n in fits]
    cpu = [cpu_matmul_s(card, n) for n in fits if n <= sizes["cpu_max"]]
    parts = (
        Part("start", START_S, "imports, device facts, NVML, the doctor (estimate)"),
        Part("matmul sweep on the GPU", sum(bench_s(s, min_time=0.3) for s in gpu), f"{len(gpu)} sizes, 0.3 s each"),
        Part("matmul sweep on the CPU", sum(bench_s(s, min_time=0.3) for s in cpu), f"{len(cpu)} sizes"),
        Part("CPU vs GPU, interleaved", sum(compare_s(c, g, min_time=0.5) for c, g in zip(cpu, gpu)),
             f"{len(cpu)} sizes, 0.5 s of pairs each"),
        Part("one thread vs every core", compare_s(cpu_matmul_s(card, 512) * card.cpu_cores, cpu_matmul_s(card, 512),
                                                   min_time=1.0), "a 512² product, 1 s of pairs"),
    )
    crossover = next((n for n, c, g in zip(fits, cpu, gpu) if g < c / 2), None)
    regimes = (Regime("the GPU wins within the sweep", crossover is not None,
                      f"predicted twice the CPU's speed from n = {crossover}" if crossover else
                      "the GPU never predicted twice as fast as the CPU up to the CPU's largest size"),)
    return LessonPlan("00", TITLE, card, False, sizes, why, parts, memory_gb=3 * fits[-1] ** 2 * 4 / 1e9,
                      regimes=regimes, target_minutes=target_minutes(card))


TITLE = "Setup and diagnostics"
