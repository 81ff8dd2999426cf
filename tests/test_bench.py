import pandas as pd

from gpulab import cli


def test_bench_prints_a_table_and_records_every_test(results_dir, monkeypatch, capsys):
    monkeypatch.setenv("GPULAB_QUICK", "1")
    assert cli.main(["bench", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "TFLOP/s" in out and "launch of a tiny op" in out and "ref: " in out
    recorded = pd.read_csv(results_dir / "bench.csv")
    assert {"matmul 512x512 float32", "launch of a tiny op"} <= set(recorded["test"])
    assert (recorded["value"] > 0).all() and recorded["quick"].all()
