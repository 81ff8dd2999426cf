import nbformat

from gpulab import cli
from gpulab.course import run_course


def _write(path, *sources):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)
    return path


def test_a_failing_lesson_is_reported_and_the_others_still_run(tmp_path):
    plot = _write(tmp_path / "01_plot.ipynb", "%matplotlib inline\nimport matplotlib.pyplot as plt\nplt.plot([1, 2])")
    broken = _write(tmp_path / "02_broken.ipynb", "raise ValueError('nope')")
    fine = _write(tmp_path / "03_fine.ipynb", "print('hello')")
    table = run_course([plot, broken, fine], tmp_path / "build")
    assert table["status"].tolist() == ["passed", "FAILED", "passed"]
    assert "ValueError: nope" in table.loc[1, "error"]
    assert (tmp_path / "build" / "summary.csv").exists()
    for name in ("01_plot", "02_broken", "03_fine"):
        assert (tmp_path / "build" / f"{name}.ipynb").exists() and (tmp_path / "build" / f"{name}.html").exists()
    assert "data:image/png" in (tmp_path / "build" / "01_plot.html").read_text()


def test_cli_exit_status_says_whether_all_passed(tmp_path, capsys):
    fine = _write(tmp_path / "01_fine.ipynb", "x = 1")
    broken = _write(tmp_path / "02_broken.ipynb", "1 / 0")
    assert cli.main(["course", str(fine), "--out", str(tmp_path / "a")]) == 0
    assert cli.main(["course", str(fine), str(broken), "--out", str(tmp_path / "b")]) == 1
    assert "1 of 2 lessons passed" in capsys.readouterr().out


def test_course_runs_are_quiet(tmp_path):
    """No "Kernel is running over TCP without encryption" from each kernel (a plain nbclient kernel prints it)."""
    import subprocess
    import sys

    fine = _write(tmp_path / "01_fine.ipynb", "x = 1")
    run = ("import sys, nbformat\nfrom nbclient import NotebookClient\nfrom gpulab.execute import run_notebook\n"
           "if sys.argv[2] == 'plain':\n    NotebookClient(nbformat.read(sys.argv[1], 4)).execute()\n"
           "else:\n    assert run_notebook(sys.argv[1]).ok\n")
    said = {how: subprocess.run([sys.executable, "-c", run, str(fine), how], capture_output=True, text=True)
            for how in ("plain", "gpulab")}
    assert said["gpulab"].returncode == 0 and said["gpulab"].stderr == "", said["gpulab"].stderr
    assert "without encryption" in said["plain"].stderr  # the warning this guards against, where it comes from


def test_the_kernels_own_messages_go_to_a_log_not_the_terminal(tmp_path, capfd):
    """C++ libraries (torch's profiler, say) write to the kernel process's stderr: kept in a log beside the lesson."""
    native = _write(tmp_path / "01_native.ipynb", "import os\nos.write(2, b'native message\\n')")
    crash = _write(tmp_path / "02_crash.ipynb", "import os\nos.write(2, b'last words\\n')\nos._exit(3)")
    table = run_course([native, crash], tmp_path / "build")
    assert "native message" not in capfd.readouterr().err
    assert (tmp_path / "build" / "01_native.kernel.log").read_text() == "native message\n"
    assert table["status"].tolist() == ["passed", "FAILED"]
    assert "02_crash.kernel.log" in table.loc[1, "error"]
