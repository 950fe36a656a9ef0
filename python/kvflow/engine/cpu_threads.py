"""Fewer CPU threads while another process takes a core.

A decode step runs its threads in one parallel region that meets at a barrier between kernels
(the CPU executor, csrc/cpu/executor.cpp). When another busy process shares a core with one of those threads,
the thread runs only part of the time, and every barrier waits for it: the step then takes longer
than on one thread alone. The region counts its threads' time at the barriers; where that share
rises far above the few percent of a machine to itself, the engine steps on one thread for a while,
then tries all of them again. Measurements are in docs/benchmarks.md.
"""

import time

import torch

from kvflow import _C


class CpuThreadGovernor:
    WINDOW_STEPS = 8          # one-region steps judged together
    MAX_WAIT_SHARE = 0.35     # of the threads' time at the barriers; a machine to itself: under 0.1
    ONE_THREAD_SECONDS = 2.0  # before all threads are tried again

    def __init__(self, threads: int):
        self.threads = threads
        self.reduced_until: float | None = None
        self._mark = _C.executor_region_stats()

    @property
    def reduced(self) -> bool:
        return self.reduced_until is not None

    def begin_step(self) -> bool:
        """Before an engine step, on the thread that runs the steps. Returns whether the step runs
        on one thread (while reduced); end_step takes that answer back."""
        if self.reduced_until is not None and time.monotonic() >= self.reduced_until:
            self.reduced_until = None
            self._mark = _C.executor_region_stats()
        if self.reduced_until is None:
            return False
        torch.set_num_threads(1)
        return True

    def end_step(self, one_thread: bool) -> None:
        """After the step, failed or not: torch's thread count restored (nothing outside a step
        sees the change), or the region's waits judged."""
        if one_thread:
            torch.set_num_threads(self.threads)
        else:
            self._judge()

    def _judge(self) -> None:
        if self.threads < 2:
            return
        stats = _C.executor_region_stats()
        if stats[0] - self._mark[0] < self.WINDOW_STEPS:
            return
        thread_seconds, waited = stats[2] - self._mark[2], stats[3] - self._mark[3]
        self._mark = stats
        if thread_seconds > 0 and waited / thread_seconds > self.MAX_WAIT_SHARE:
            self.reduced_until = time.monotonic() + self.ONE_THREAD_SECONDS
