"""How much memory this process may still take: what the kernel reports as available, and less
where a cgroup (a container's memory limit) allows less; and handing back what it freed."""

import ctypes
import gc
from pathlib import Path


def available_memory_bytes() -> int | None:
    """MemAvailable, capped by the cgroup v2 limit minus its usage; None where neither is known."""
    candidates = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                candidates.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
            candidates.append(max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return min(candidates) if candidates else None


def return_freed_memory() -> None:
    """Returns the heap memory this process has freed to the kernel, where the C library can
    (glibc's malloc_trim; elsewhere nothing happens). glibc keeps freed memory for later
    allocations, so what loading parsed and dropped (the GGUF reader's metadata, tensors that
    were replaced) would otherwise stay in the process's resident memory for good."""
    gc.collect()  # objects in reference cycles are freed only by the collector
    trim_heap()


def trim_heap() -> None:
    """glibc's malloc_trim(0): the heap's free pages back to the kernel; nothing elsewhere."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    trim(0)
