"""Colab is a first-class machine: the setup says when it runs there, the load caveat says what the load means on its
2 vCPUs and gives no advice a learner there cannot follow, and a 70 W card's power limit is stated as its normal
state, not flagged as a fault."""

import pytest

import gpulab
from gpulab.colab import on_colab
from gpulab.conditions import Conditions


@pytest.fixture
def colab(monkeypatch):
    monkeypatch.setenv("COLAB_RELEASE_TAG", "release-colab_20261201-060000_RC00")


def test_colab_is_recognised_by_its_runtimes_environment(colab):
    assert on_colab()


def test_elsewhere_it_is_not_colab(monkeypatch):
    monkeypatch.delenv("COLAB_RELEASE_TAG", raising=False)
    assert not on_colab()


def test_on_colab_the_load_caveat_says_what_the_load_means_and_advises_nothing(colab):
    busy = Conditions(load_avg=3.4, cpu_cores=2)
    assert busy.caveats() == ["the CPU was oversubscribed (load average 3.4 on this Colab runtime's 2 vCPUs: threads "
                              "waited for a core, this notebook's own among them)"]
    assert busy.advice() == ""


def test_elsewhere_a_busy_machine_is_told_to_rerun_on_a_quiet_one(monkeypatch):
    monkeypatch.delenv("COLAB_RELEASE_TAG", raising=False)
    busy = Conditions(load_avg=3.4, cpu_cores=2)
    assert busy.caveats() == ["the CPU was oversubscribed (load average 3.4 on 2 cores)"]
    assert busy.advice() == "rerun on a quiet machine before trusting it"


T4_AT_ITS_LIMIT = dict(gpu=True, sm_clock_mhz=900, sm_clock_low_mhz=585, sm_clock_high_mhz=1590, sm_clock_max_mhz=1590,
                       gpu_power_w=70.2, gpu_power_limit_w=70, throttle=("SW power cap",))


def test_a_70_w_cards_power_limit_is_its_normal_state():
    t4 = Conditions(load_avg=0.5, cpu_cores=2, **T4_AT_ITS_LIMIT)
    assert t4.caveats() == ["the GPU ran at its 70 W power limit (SW power cap; SM clock 585–1590 MHz of 1590), as a 70 W "
                            "card runs any sustained work"]
    assert t4.advice() == ""


def test_a_700_w_cards_power_limit_is_said_as_dense_works():
    h200 = Conditions(load_avg=0.5, cpu_cores=16, **{**T4_AT_ITS_LIMIT, "gpu_power_w": 698, "gpu_power_limit_w": 700})
    assert h200.caveats()[0].endswith("as long, dense work does")


def test_the_setup_names_colab_a_70_w_card_and_how_to_choose_quick_mode(colab, monkeypatch, capsys, results_dir):
    from .cuda_stand_in import installed

    monkeypatch.setenv("GPULAB_QUICK", "0")
    with installed("Tesla T4"):
        gpulab.setup()
    out = capsys.readouterr().out
    assert "Google Colab runtime with" in out and "vCPUs" in out
    assert "A 70 W card: it runs any sustained work at its power limit" in out
    assert "%env GPULAB_QUICK=1" in out
    # the measuring page, the solutions and the exercises run this setup too, and print no plan
    assert "in a lesson, the plan printed next says how many minutes" in out
    with installed("NVIDIA H200"):
        gpulab.setup()
    assert "W card" not in capsys.readouterr().out
