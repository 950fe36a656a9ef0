"""CPU memory in transparent huge pages, for the tensors decode streams through every step: the
weights and the KV cache.

Reading 212 MB of projection weights per token touches 54,000 4-KiB pages, and paged attention
reads KV blocks scattered over the whole pool: with 4-KiB pages most of those reads miss the TLB.
On Linux, anonymous memory advised MADV_HUGEPAGE is backed by 2-MiB pages when the kernel allows it
(`/sys/kernel/mm/transparent_hugepage/enabled` set to `always` or `madvise`). Measured here, the
120 projections of a one-token decode step took 4.9 ms instead of 5.7 ms. Elsewhere this falls
back to ordinary allocations."""

import mmap
import sys

import torch
from torch import nn

from kvflow.layers.linear import PackedWeight

_HUGE_PAGE = 2 << 20
_PAGE = 4096
_ALIGN = _PAGE  # every tensor carved from an arena starts on a page boundary


def _arena(nbytes: int) -> torch.Tensor:
    """nbytes of zeroed, 2-MiB aligned uint8 CPU memory, advised to use huge pages."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(nbytes, dtype=torch.uint8)
    region = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel without transparent huge pages: ordinary pages, still correct
        pass
    raw = torch.frombuffer(region, dtype=torch.uint8)  # keeps the mapping alive while any view lives
    offset = (-raw.data_ptr()) % _HUGE_PAGE
    arena = raw[offset:offset + nbytes]
    # Fault every page in now. Left to first use, the kernel zeroes each 2-MiB page inside
    # whichever step first writes it: 10 ms of a reshape_and_cache call that otherwise takes 15 us.
    arena[::_PAGE].zero_()
    return arena


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def empty_in_huge_pages(shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor]:
    """Zeroed CPU tensors of the given shapes, laid out one after another in one huge-page arena."""
    element = torch.empty((), dtype=dtype).element_size()
    sizes = [_padded(element * max(1, int(torch.Size(shape).numel()))) for shape in shapes]
    arena = _arena(sum(sizes))
    tensors, start = [], 0
    for shape, size in zip(shapes, sizes):
        numel = int(torch.Size(shape).numel())
        tensors.append(arena[start:start + numel * element].view(dtype).view(shape))
        start += size
    return tensors


def copy_into_huge_pages(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of CPU tensors, one after another in a huge-page arena per dtype, in list order."""
    copies: list[torch.Tensor | None] = [None] * len(tensors)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    for dtype, indices in by_dtype.items():
        for i, copy in zip(indices, empty_in_huge_pages([tuple(tensors[i].shape) for i in indices], dtype)):
            copy.copy_(tensors[i])
            copies[i] = copy
    return copies


@torch.no_grad()
def move_parameters_to_huge_pages(module: nn.Module) -> int:
    """Copies every CPU parameter of `module` into a huge-page arena, in registration order (the
    order a forward pass reads them), and points the parameters there; likewise the packed
    copies many-row products read (kvflow.layers.linear.PackedWeight). Returns the bytes moved."""
    parameters = [p for p in module.parameters() if p.device.type == "cpu" and p.numel() > 0]
    for p, copy in zip(parameters, copy_into_huge_pages([p.data for p in parameters])):
        p.data = copy
    packed = [m.packed_weight for m in module.modules()
              if isinstance(getattr(m, "packed_weight", None), PackedWeight)]
    for weight, copy in zip(packed, copy_into_huge_pages([w.data for w in packed])):
        weight.data = copy
    return sum(t.numel() * t.element_size() for t in [p.data for p in parameters] + [w.data for w in packed])
