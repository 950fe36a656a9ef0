"""python -m kvflow env: what to paste into a bug report. The machine, what kvflow found on it, what it
chose and why, and which compute paths will run."""

import os
import platform as system_platform
import sys
from pathlib import Path

import torch

import kvflow
from kvflow import platform


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return "not available"


def _cuda_devices() -> list[str]:
    if not torch.cuda.is_available():
        return [f"none (torch CUDA build: {torch.version.cuda or 'no'}, kvflow built with CUDA: "
                f"{'yes' if kvflow._C.built_with_cuda else 'no'})"]
    return [f"cuda:{i}: {torch.cuda.get_device_name(i)}, capability {'.'.join(map(str, torch.cuda.get_device_capability(i)))}"
            for i in range(torch.cuda.device_count())]


def report() -> str:
    cpu = platform.current()
    found = [name for name, present in cpu.features.items() if present]
    absent = [name for name, present in cpu.features.items() if not present]
    lines = [
        f"kvflow {kvflow.__version__}, torch {torch.__version__}, Python {sys.version.split()[0]}, "
        f"{system_platform.system()} {system_platform.release()} {system_platform.machine()}",
        f"CPU: {cpu.model}; {os.cpu_count()} logical CPUs, {len(os.sched_getaffinity(0))} usable by this process",
        f"CPU features found: {', '.join(found) or 'none of those kvflow asks about'}",
        f"CPU features absent: {', '.join(absent) or 'none'}",
        f"kernel instruction sets this CPU can run: {', '.join(cpu.supported_isas)}",
        f"instruction set chosen: {cpu.isa} ({cpu.reason})",
        f"threads: {torch.get_num_threads()} (torch intra-op; set with --threads or OMP_NUM_THREADS)",
        f"transparent huge pages: {_read('/sys/kernel/mm/transparent_hugepage/enabled')}",
        f"torch oneDNN bf16 ops usable here: {'yes' if cpu.torch_onednn_bf16 else 'no'} (kvflow calls none)",
        "CUDA devices: " + "; ".join(_cuda_devices()),
        "compute paths on the CPU:",
    ]
    lines += [f"  {what}: {how}" for what, how in cpu.compute_paths().items()]
    return "\n".join(lines)


def main() -> int:
    print(report())
    return 0
