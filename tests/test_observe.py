import io
import time

import pytest
import torch

from gpulab.questions.observe import observe


def test_sees_every_kind_of_host_read():
    x = torch.randn(64)
    with observe() as seen:
        x.sum().item()
        x.tolist()
        print(x, file=io.StringIO())
        float(x.sum())
        if x.sum() > 0:
            pass
        torch.nonzero(x)
        x[x > 0]
    assert seen.host_reads == ["item", "tolist", "__repr__", "__float__", "__bool__", "nonzero", "index"]
    assert seen.waits == 7


def test_work_that_stays_on_the_device_is_not_a_wait():
    x = torch.randn(64)
    with observe() as seen:
        total = torch.zeros(())
        for _ in range(3):
            total += (x * 2).sum().detach()
        torch.where(x > 0, x, 0.0)
    assert seen.waits == 0 and seen.op_devices["cpu"] > 0


def test_copies_with_their_target_and_non_blocking_flag():
    x = torch.randn(8)
    with observe() as seen:
        x.to("cpu")
        x.to(torch.device("cpu"), non_blocking=True)
        x.to("meta")
        x.to(torch.float16)  # a conversion, not a copy to a device
        torch.empty_like(x).copy_(x, non_blocking=True)
        x.cpu()
    assert [(c.method, c.target, c.non_blocking) for c in seen.copies] == [
        ("to", "cpu", False), ("to", "cpu", True), ("to", "meta", False), ("copy_", "cpu", True), ("cpu", "cpu", False)]
    assert len(seen.blocking_copies()) == 3 and len(seen.blocking_copies("meta")) == 1
    with observe() as seen:
        torch.empty_like(x, device="meta").copy_(x, non_blocking=True)  # a copy's source is its argument
    assert [(c.target, c.source, c.non_blocking) for c in seen.copies] == [("meta", "cpu", True)]


def test_explicit_synchronize_is_recorded_and_harmless_without_a_gpu():
    with observe() as seen:
        torch.cuda.synchronize()
    assert seen.syncs == ["torch.cuda.synchronize()"] and seen.waits == 1
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError):  # outside observe() the real call still needs a GPU
            torch.cuda.synchronize()


def test_product_dtypes_show_what_autocast_chose():
    model = torch.nn.Linear(4, 4)
    with observe() as seen:
        model(torch.randn(2, 4))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(torch.randn(2, 4))
    assert seen.product_dtypes == {torch.float32: 1, torch.bfloat16: 1}


def test_ops_are_counted_per_device():
    with observe() as seen:
        torch.randn(4, device="meta") + 1
        torch.randn(4) + 1
    assert seen.op_devices["meta"] >= 1 and seen.op_devices["cpu"] >= 1


def test_transfers_to_the_host_read_as_zeros_from_the_meta_stand_in():
    loss = torch.randn((), device="meta")
    host = torch.empty(3)
    with observe(fake_meta_reads=True) as seen:
        scalar = loss.item()
        copied = torch.stack([loss, loss]).cpu().numpy()
        host[0] = loss  # a copy into a host tensor, one element at a time
        loss.to("meta")  # stays on the device: not a transfer
    assert seen.to_host == ["_local_scalar_dense", "_to_copy", "copy_"]
    assert scalar == 0.0 and copied.tolist() == [0.0, 0.0] and host[0] == 0
    assert [c.source for c in seen.copies] == ["meta", "meta"]
    with observe() as seen, pytest.raises(RuntimeError):  # without the option, meta data still cannot be read
        loss.item()


def test_product_devices_say_where_a_model_ran():
    model = torch.nn.Linear(4, 2)
    with observe() as seen:
        model(torch.randn(3, 4))
        model.to("meta")(torch.randn(3, 4, device="meta"))
    assert seen.product_devices == {"cpu": 1, "meta": 1}


def test_a_simulated_gpu_makes_an_unsynchronised_clock_wrong():
    from gpulab.questions.observe import simulated_gpu
    from gpulab.questions.stand_in import virtual_clock

    with virtual_clock(), simulated_gpu() as gpu:  # exact times: a busy machine cannot stretch them
        assert torch.cuda.is_available()
        start = time.perf_counter()
        gpu.launch(0.05)  # queued: returns at once
        queued_s = time.perf_counter() - start
        torch.cuda.synchronize()
        done_s = time.perf_counter() - start
    assert queued_s == 0 and done_s == pytest.approx(0.05)


def test_simulated_cuda_events_time_the_queue_and_refuse_early_reads():
    from gpulab.questions.observe import simulated_gpu
    from gpulab.questions.stand_in import virtual_clock

    with virtual_clock(), simulated_gpu() as gpu, observe() as seen:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        gpu.launch(0.04)
        end.record()
        with pytest.raises(RuntimeError, match="not ready"):
            start.elapsed_time(end)  # the GPU has not reached the end marker yet
        end.synchronize()
        elapsed_ms = start.elapsed_time(end)
        torch.cuda.current_stream().synchronize()
    assert elapsed_ms == pytest.approx(40)
    assert seen.syncs == ["Event.synchronize()", "Stream.synchronize()"]
