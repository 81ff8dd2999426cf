"""The CUDA stand-in behaves as the torch.cuda calls it plays do (their errors as aten/src/ATen/cuda/CUDAEvent.h and
c10/cuda/CUDACachingAllocator.cpp word them), and leaves torch as it found it: a fake that does not behave as the real
thing proves nothing."""

import pytest
import torch

import gpulab.device

from .cuda_stand_in import GpuOnly, installed


def test_events_time_on_the_host_clock_and_refuse_as_torch_does(cuda_stand_in):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with pytest.raises(RuntimeError, match="Both events must be recorded"):
        start.elapsed_time(end)
    start.record()
    end.record(torch.cuda.current_stream())
    assert start.elapsed_time(end) >= 0 and isinstance(start.elapsed_time(end), float)  # milliseconds
    untimed = torch.cuda.Event()
    untimed.record()
    with pytest.raises(RuntimeError, match="enable_timing=True"):
        start.elapsed_time(untimed)
    with pytest.raises(TypeError):
        start.record("not a stream")


def test_a_stream_context_sets_the_current_stream_and_restores_it(cuda_stand_in):
    default, side = torch.cuda.current_stream(), torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert torch.cuda.current_stream() is side
        side.wait_stream(default)
    assert torch.cuda.current_stream() is default is torch.cuda.default_stream()
    assert isinstance(side.record_event(), torch.cuda.Event)


def test_pinning_copies_into_memory_that_says_it_is_pinned(cuda_stand_in):
    pageable = torch.ones(4)
    pinned = pageable.pin_memory()
    assert pinned is not pageable and torch.equal(pinned, pageable)
    assert pinned.is_pinned() and not pageable.is_pinned() and pinned.pin_memory() is pinned
    assert torch.empty(3, pin_memory=True).is_pinned()


def test_the_allocator_counts_live_tensors_and_reserves_whole_segments(cuda_stand_in):
    before = torch.cuda.memory_allocated()
    x = torch.empty(2**20, dtype=torch.uint8)  # 1 MiB
    assert torch.cuda.memory_allocated() - before == 2**20
    assert torch.cuda.memory_reserved() % (2 * 2**20) == 0 and torch.cuda.memory_reserved() >= torch.cuda.memory_allocated()
    del x
    assert torch.cuda.memory_allocated() == before and torch.cuda.max_memory_allocated() >= before + 2**20
    torch.cuda.reset_peak_memory_stats()
    assert torch.cuda.max_memory_allocated() == before
    free, total = torch.cuda.mem_get_info()
    assert total == torch.cuda.get_device_properties(0).total_memory and free == total - torch.cuda.memory_reserved()


def test_a_memory_fraction_is_a_budget_beyond_which_an_allocation_is_out_of_memory(cuda_stand_in):
    torch.cuda.set_per_process_memory_fraction(2**20 / torch.cuda.get_device_properties(0).total_memory)
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(2 * 2**20, dtype=torch.uint8)
    with pytest.raises(ValueError, match="Allowed range"):
        torch.cuda.set_per_process_memory_fraction(1.5)


@pytest.mark.parametrize("call", [lambda: torch.cuda.CUDAGraph(), lambda: torch.cuda.graph(None),
                                  lambda: torch.cuda.memory._record_memory_history()])
def test_what_only_a_gpu_can_do_is_refused_not_pretended(cuda_stand_in, call):
    with pytest.raises(GpuOnly, match="needs a real GPU"):
        call()


@pytest.mark.parametrize("card, capability, bf16", [("NVIDIA H200", (9, 0), True), ("Tesla T4", (7, 5), False)])
def test_each_card_is_played_with_its_own_properties_and_torch_is_restored_after(card, capability, bf16):
    real_event, real_pin = torch.cuda.Event, torch.Tensor.pin_memory
    with installed(card):
        assert gpulab.device.STAND_IN == card and torch.cuda.get_device_name() == card
        assert torch.cuda.get_device_capability() == capability and torch.cuda.is_bf16_supported() is bf16
    assert gpulab.device.STAND_IN is None and torch.cuda.Event is real_event and torch.Tensor.pin_memory is real_pin
