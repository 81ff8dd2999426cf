"""`gpulab claims`: figures and verdicts computed from reference rows, and the README's copy kept equal."""

import re

import pandas as pd
import pytest

from gpulab import results
from gpulab.commands import claims, cli

from .conftest import ROOT


def _rows(device="GPU A", **columns):
    frame = pd.DataFrame(columns)
    return frame.assign(device_name=device)


def test_sync_each_step_verdict_follows_the_slowdown():
    def rows(sync_ms):
        return _rows(label=["train_sync_every_step", "train_transfer_once"] * 2, width=[64, 64, 4096, 4096],
                     ms_per_step=[sync_ms[0], 1.0, sync_ms[1], 1.0])
    assert claims._sync_in_a_loop(rows([3.0, 2.0]))[1] == "confirmed"
    assert claims._sync_in_a_loop(rows([3.0, 1.0]))[1] == "depends on the work per step"
    assert claims._sync_in_a_loop(rows([1.1, 1.0]))[1] == "not confirmed"


def test_pinned_memory_verdicts():
    def rows(pinned):
        return _rows(direction="H2D", memory=["pageable", "pinned"] * 2, nbytes=[4096, 4096, 2**30, 2**30],
                     gbps=[1.0, pinned[0], 10.0, pinned[1]])
    assert claims._pinned_memory(rows([1.5, 50.0]))[1] == "confirmed, and larger than claimed"
    assert claims._pinned_memory(rows([1.1, 50.0]))[1] == "depends on the copy's size"
    assert claims._pinned_memory(rows([1.1, 11.0]))[1] == "not confirmed"


FASTER, NOISE, SLOWER = (1.4, 1.3, 1.5, "faster"), (1.0, 0.9, 1.1, "within noise"), (0.8, 0.7, 0.85, "slower")


def compared(*comparisons) -> dict:
    """The columns Comparison.row() records, one value per comparison given as (speedup, low, high, verdict)."""
    return dict(zip(("speedup", "speedup_low", "speedup_high", "verdict"), map(list, zip(*comparisons))))


def test_memory_claim_reads_the_peaks():
    half = _rows(remedy=["baseline (Adam)", "autocast float16"], peak_MiB=[100.0, 80.0])
    assert claims._half_memory(half)[1].startswith("not confirmed")
    assert claims._half_memory(half.assign(peak_MiB=[100.0, 50.0]))[1] == "confirmed"


@pytest.mark.parametrize("judge, rows, verdicts", [
    (claims._activations, lambda a, b: _rows(activation=["GELU", "SiLU"], **compared(a, b)),
     [((FASTER, FASTER), "confirmed"), ((FASTER, SLOWER), "not confirmed"),
      ((FASTER, NOISE), "within noise: not supported")]),
    (claims._compile, lambda a, b: _rows(way=["torch.compile"], **compared(a)),
     [((FASTER, None), "torch.compile confirmed; TorchScript not measured (deprecated)"),
      ((NOISE, None), "torch.compile: within noise; TorchScript not measured (deprecated)")]),
    (claims._checkpointing,
     lambda a, b: _rows(config=["k=1"], peak_MiB=[40.0], baseline_peak_MiB=[100.0], **compared(a)),
     [((SLOWER, None), "confirmed"), ((NOISE, None), "saves memory; its compute cost is within noise")]),
    (claims._cudnn_benchmark,
     lambda a, b: _rows(label=["first step at a new shape (autotuning included)", "steady state, one shape"],
                        **compared(b, a)),
     [((FASTER, SLOWER), "confirmed for fixed shapes; costs time when shapes change"),
      ((NOISE, SLOWER), "within noise: not supported"), ((SLOWER, SLOWER), "not confirmed")]),
    (claims._ddp_over_dp, lambda a, b: _rows(method=["DDP vs DataParallel"], gpus=[2], **compared(a)),
     [((FASTER, None), "confirmed"), ((NOISE, None), "within noise: not supported"), ((SLOWER, None), "not confirmed")]),
])
def test_speed_claims_follow_the_recorded_comparisons_verdict_never_a_bare_ratio(judge, rows, verdicts):
    for (a, b), verdict in verdicts:
        figure, said = judge(rows(a, b or a))
        assert said == verdict and "×, " in figure



def test_the_mixed_precision_claim_reads_the_waterfalls_races():
    def rows(tf32, autocast):
        return _rows(step=["naive fp32", "TF32", "autocast bfloat16", "SDPA"], vs_previous=[None, tf32[0], autocast[0], 1.5],
                     low=[None, tf32[1], autocast[1], 1.4], high=[None, tf32[2], autocast[2], 1.6],
                     verdict=[None, tf32[3], autocast[3], "faster"])
    figure, verdict = claims._mixed_precision(rows(FASTER, FASTER))
    assert verdict == "confirmed" and "TF32 1.40× (1.30–1.50×, faster)" in figure and "SDPA" not in figure
    assert claims._mixed_precision(rows(FASTER, NOISE))[1] == "within noise: not supported"
    assert claims._mixed_precision(rows(SLOWER, FASTER))[1] == "not confirmed"
    skipped = _rows(step=["naive fp32", "TF32"], vs_previous=[None, None], low=[None, None], high=[None, None],
                    verdict=[None, None])
    assert claims._mixed_precision(skipped) is None


def test_the_flash_memory_claim_reads_the_growth_with_sequence_length():
    def rows(flash_peaks):
        lengths = [1024, 2048, 4096]
        return _rows(way=["written out"] * 3 + ["SDPA, flash forced"] * 3, seq_len=lengths * 2,
                     peak_MiB=[100.0, 400.0, None, *flash_peaks], out_of_memory=[False, False, True, False, False, False])
    figure, verdict = claims._flash_memory(rows([10.0, 20.0, 40.0]))
    assert verdict == "confirmed" and "T^1.00 with flash attention (up to T = 4096)" in figure
    assert "T^2.00 written out (up to T = 2048)" in figure
    assert claims._flash_memory(rows([10.0, 40.0, 160.0]))[1] == "not confirmed"
    assert claims._flash_memory(rows([10.0, None, None])) is None

def test_the_capstone_claim_needs_its_whole_interval_above_the_claimed_gain():
    def rows(low, high, verdict="faster"):
        return _rows(step=["optimised vs naive"], accuracy=[0.9], **compared(((low + high) / 2, low, high, verdict)))
    assert claims._capstone(rows(1.6, 2.0))[1] == "confirmed, and larger than claimed"
    assert claims._capstone(rows(1.35, 1.45))[1] == "confirmed"
    assert claims._capstone(rows(1.2, 1.6))[1] == "within noise of the claim"
    assert claims._capstone(rows(1.05, 1.2))[1] == "not confirmed"
    assert claims._capstone(_rows(step=["naive baseline"], accuracy=[0.9])) is None
    timed = rows(1.6, 2.0).assign(time_to_target_naive_s=[12.0], time_to_target_s=[1.5])
    assert "12 s → 1.5 s to the target accuracy" in claims._capstone(timed)[0]


def test_one_row_per_gpu_and_a_plain_note_where_nothing_ships(monkeypatch, tmp_path):
    monkeypatch.setattr(results, "REFERENCE_DIR", tmp_path)
    pd.concat([_rows("GPU A", remedy=["baseline (Adam)", "autocast bfloat16"], peak_MiB=[100.0, 90.0]),
               _rows("GPU B", remedy=["baseline (Adam)", "autocast bfloat16"], peak_MiB=[100.0, 40.0])]
              ).to_csv(tmp_path / "05_remedies.csv", index=False)
    table = claims.table([c for c in claims.CLAIMS if c.reference in ("05_remedies", "06_activations")])
    memory = table[table["lesson"] == "05"]
    assert memory["measured"].str.split(":").str[0].tolist() == ["GPU A", "GPU B"]
    assert memory["verdict"].tolist()[1] == "confirmed"
    assert table[table["lesson"] == "06"]["verdict"].tolist() == [claims.NOT_YET]


def test_the_readme_holds_the_commands_table(capsys):
    assert cli.main(["claims", "--markdown"]) == 0
    printed = capsys.readouterr().out.strip()
    readme = (ROOT / "README.md").read_text()
    shown = re.search(r"<!-- claims: begin -->\n(.*?)\n<!-- claims: end -->", readme, re.S)
    assert shown, "the README has no claims section"
    assert shown.group(1) == printed, "the README's claims table is stale: paste `gpulab claims --markdown` into it"


@pytest.mark.parametrize("claim", claims.CLAIMS, ids=lambda c: c.reference)
def test_every_claim_names_a_lesson_and_a_source(claim):
    assert re.fullmatch(r"\d\d", claim.lesson) and re.fullmatch(r"\d{3}(, \d{3})*", claim.source)
