"""Weights and KV cache in huge-page arenas: same values, page-aligned, laid out in the order the
forward pass reads them, zeroed where fresh, backed by huge pages where the kernel allows, and
moved there without holding two copies of the weights."""

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from kvflow.loader.huge_pages import empty_in_huge_pages, move_parameters_to_huge_pages


def test_parameters_keep_their_values_and_follow_registration_order():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 32, bias=False), nn.Embedding(50, 16)).to(torch.bfloat16)
    model.requires_grad_(False)
    before = [p.detach().clone() for p in model.parameters()]
    nbytes = move_parameters_to_huge_pages(model)
    assert nbytes == sum(p.numel() * p.element_size() for p in model.parameters())
    after = list(model.parameters())
    for old, new in zip(before, after):
        assert torch.equal(old, new)
    addresses = [p.data_ptr() for p in after]
    assert addresses == sorted(addresses), "the arena holds them in registration order"
    assert all(address % 4096 == 0 for address in addresses)
    x = torch.randn(3, 64).to(torch.bfloat16)
    assert model[1](model[0](x)).shape == (3, 32)


def test_fresh_tensors_are_zeroed_and_separate():
    tensors = empty_in_huge_pages([(4, 16, 3, 64), (4, 16, 3, 64), (7,)], torch.float32)
    assert [tuple(t.shape) for t in tensors] == [(4, 16, 3, 64), (4, 16, 3, 64), (7,)]
    assert all(torch.count_nonzero(t) == 0 for t in tensors)
    tensors[0].fill_(1.0)
    assert torch.count_nonzero(tensors[1]) == 0 and torch.count_nonzero(tensors[2]) == 0
    ends = [t.data_ptr() + t.numel() * t.element_size() for t in tensors]
    assert ends[0] <= tensors[1].data_ptr() and ends[1] <= tensors[2].data_ptr()


def test_large_arenas_get_huge_pages_where_the_kernel_offers_them():
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read()
    except OSError:
        mode = ""
    if "[never]" in mode or not mode:
        # No transparent huge pages here: the arena is still ordinary, usable memory.
        (t,) = empty_in_huge_pages([(8 << 20,)], torch.uint8)
        t.fill_(1)
        assert int(t.sum()) == 8 << 20
        return

    def anon_huge_kb():
        with open("/proc/self/smaps_rollup") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages:"))

    before = anon_huge_kb()
    (t,) = empty_in_huge_pages([(64 << 20,)], torch.uint8)
    t.fill_(1)  # touch every page
    assert anon_huge_kb() - before >= 2 << 10, "a 64 MiB arena should get 2 MiB pages"


MOVE_PEAK = """
import torch
from torch import nn
from kvflow.loader.huge_pages import move_parameters_to_huge_pages
def status(key):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(key)) * 1024
model = nn.ParameterList([nn.Parameter(torch.ones(16 << 20, dtype=torch.uint8), requires_grad=False) for _ in range(16)])
before = status("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak (VmHWM) starts again from the current resident memory
move_parameters_to_huge_pages(model)
print(status("VmHWM") - before, status("VmRSS") - before)
assert all(bool((p == 1).all()) for p in model)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="resets and reads Linux's peak resident memory")
def test_moving_weights_never_holds_two_copies_of_them():
    """Each weight is freed as soon as it is copied into the arena, so moving 256 MB of weights
    takes a few tensors' worth of memory beyond them at its peak, not another 256 MB: on a machine
    where the weights take most of the memory, that is the difference between loading or not."""
    result = subprocess.run([sys.executable, "-c", MOVE_PEAK], capture_output=True, text=True, timeout=120, check=True)
    peak, after = map(int, result.stdout.split()[-2:])
    assert peak <= 64 << 20, f"moving 256 MB of weights peaked {peak / 2**20:.0f} MiB above where it started"
    assert after <= 16 << 20
