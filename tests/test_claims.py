"""`gpulab claims`: figures and verdicts computed from reference rows, and the README's copy kept equal."""

import re

import pandas as pd
import pytest

from gpulab import claims, cli, results

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


def test_memory_and_speed_claims_read_their_lessons_columns():
    half = _rows(remedy=["baseline (Adam)", "autocast float16"], peak_MiB=[100.0, 80.0])
    assert claims._half_memory(half)[1].startswith("not confirmed")
    assert claims._half_memory(half.assign(peak_MiB=[100.0, 50.0]))[1] == "confirmed"
    ckpt = _rows(config=["no checkpointing", "k=1", "k=2"], peak_MiB=[10.0, 4.0, 6.0], step_ms=[1.0, 1.3, 1.2])
    figure, verdict = claims._checkpointing(ckpt)
    assert verdict == "confirmed" and figure.startswith("k=1: peak 0.40×, step time 1.30×")
    acts = _rows(activation=["ReLU", "GELU", "SiLU"], step_ms=[1.0, 1.2, 1.1])
    assert claims._activations(acts)[1] == "not confirmed"
    assert claims._activations(acts.assign(step_ms=[1.0, 1.01, 0.99]))[1] == "no difference within 5 %"
    assert claims._compile(_rows(way=["eager"], step_ms=[1.0])) is None
    assert claims._compile(_rows(way=["eager", "torch.compile"], step_ms=[2.0, 1.0]))[1].startswith("torch.compile confirmed")
    cudnn = _rows(label=["fixed shape, benchmark=False", "fixed shape, benchmark=True",
                         "varying shapes, benchmark=False", "varying shapes, benchmark=True"], step_ms=[2.0, 1.0, 2.0, 9.0])
    assert claims._cudnn_benchmark(cudnn)[1] == "confirmed for fixed shapes; costs time when shapes vary"
    path = _rows(step=["naive baseline", "no sync", "workers"], kept=[True, False, True],
                 vs_baseline=[1.0, 0.99, 6.2], accuracy=[0.95, 0.95, 0.94])
    figure, verdict = claims._capstone(path)
    assert verdict == "confirmed, and larger than claimed" and figure.startswith("the capstone's kept steps: 6.20×")
    assert claims._capstone(path.assign(vs_baseline=[1.0, 0.99, 1.1]))[1] == "not confirmed"
    dp = _rows(method=["DataParallel", "DDP"], gpus=[2, 2], samples_per_s=[1000.0, 1500.0])
    figure, verdict = claims._ddp_over_dp(dp)
    assert verdict == "confirmed" and figure == "DDP trained 1.50× the samples/s of DataParallel on 2 GPUs"
    assert claims._ddp_over_dp(dp.assign(samples_per_s=[1000.0, 1020.0]))[1] == "no difference within 5 %"
    assert claims._ddp_over_dp(dp.assign(samples_per_s=[1000.0, 800.0]))[1] == "not confirmed"


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
    assert re.fullmatch(r"0\d", claim.lesson) and re.fullmatch(r"\d{3}(, \d{3})*", claim.source)
