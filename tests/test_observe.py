import io

import pytest
import torch

from gpulab.observe import observe


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
