"""The ranks of one tensor-parallel engine and how they talk, over torch.distributed.

Two process groups:
- compute: the all-reduces and all-gathers inside a model step (gloo on the CPU, NCCL on CUDA),
  with the step timeout, so that a rank that died or hangs fails the step within it;
- control: rank 0's messages (step plans, report requests, stop), pickled and broadcast over
  gloo; rank 0 sends within the step timeout, the others wait without one, so that an idle
  server's ranks may wait for the next step as long as it takes. A broadcast over
  torch.distributed reaches ranks on other nodes, which a shared-memory ring would not; a step's
  plan is a few kilobytes.

Ranks come from torchrun (its environment: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT), across nodes too, or are spawned by rank 0 on this machine."""

import datetime
import logging
import os
import pickle
import socket
import threading
import time

import torch
import torch.distributed as dist

from kvflow.layers.tensor_parallel import TensorParallel

logger = logging.getLogger("kvflow")

CONTROL_TIMEOUT = datetime.timedelta(days=365)
# On the CPU an all-reduce of up to this many values (in all) is an all-gather and a local sum.
GATHERED_SUM_MAX_VALUES = 1 << 20


class TensorParallelError(RuntimeError):
    """A rank died, hung past the timeout, or failed: the engine cannot run another step."""


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "LOCAL_RANK" in os.environ
                                                   and "WORLD_SIZE" in os.environ)


def free_port() -> int:
    """A loopback TCP port nobody listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def rank_cores(local_rank: int, local_size: int) -> list[int]:
    """This rank's share of the cores this process may run on: the ranks on one machine split
    them, so that each rank's OpenMP pool has cores of its own."""
    cores = sorted(os.sched_getaffinity(0))
    share = len(cores) // local_size
    if share == 0:
        return cores
    return cores[local_rank * share:(local_rank + 1) * share]


class RankGroup:
    """One rank's view of the group; implements kvflow.layers.tensor_parallel.Communicator."""

    def __init__(self, rank: int, size: int, local_rank: int, local_size: int, device: torch.device,
                 timeout_s: float, restore=None):
        self.rank = rank
        self.local_size = local_size  # the ranks on this machine
        self._restore = restore  # puts back the process's cores and threads (close)
        self._send_lock = threading.Lock()  # shutdown may come from another thread than the steps
        self.size = size
        self.local_rank = local_rank
        self.device = device
        self.timeout_s = timeout_s
        self.control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
        self.parallel = TensorParallel(rank, size, self)
        self.num_all_reduces = 0
        self.num_all_gathers = 0
        self.collective_seconds = 0.0
        self.failure: str | None = None
        self.workers: list = []  # the processes rank 0 spawned (none under torchrun)

    @classmethod
    def join(cls, size: int, device: str, timeout_s: float, rank: int | None = None, local_rank: int | None = None,
             local_size: int | None = None, init_method: str = "env://", threads: int | None = None) -> "RankGroup":
        """Joins the group of `size` ranks (rank etc. from torchrun's environment where None),
        pinning this process to its share of the cores and giving torch that many threads (or
        `threads`) on the CPU, or choosing its GPU on CUDA."""
        env = os.environ
        rank = int(env["RANK"]) if rank is None else rank
        local_rank = int(env.get("LOCAL_RANK", rank)) if local_rank is None else local_rank
        local_size = int(env.get("LOCAL_WORLD_SIZE", size)) if local_size is None else local_size
        torch_device = torch.device(device)
        affinity, num_threads = os.sched_getaffinity(0), torch.get_num_threads()
        joiner, joiner_ident = threading.get_native_id(), threading.get_ident()

        def restore():  # the pinning and OpenMP's thread count belong to the thread that joined
            os.sched_setaffinity(joiner, affinity)
            if threading.get_ident() == joiner_ident:  # another thread cannot set them for it
                torch.set_num_threads(num_threads)

        if torch_device.type == "cuda":
            torch_device = torch.device("cuda", local_rank)
            torch.cuda.set_device(torch_device)
            backend = "nccl"
        else:
            cores = rank_cores(local_rank, local_size)
            os.sched_setaffinity(0, cores)
            torch.set_num_threads(threads or len(cores))
            backend = "gloo"
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        return cls(rank, size, local_rank, local_size, torch_device, timeout_s, restore)

    # ------------------------------------------------------------ Communicator (inside a step)

    def all_reduce_(self, tensor: torch.Tensor) -> None:
        start = time.perf_counter()
        if self.device.type == "cpu" and (self.size == 2 or tensor.numel() * self.size <= GATHERED_SUM_MAX_VALUES):
            # gloo's all-reduce takes two rounds of messages, an all-gather one: each rank sums
            # the gathered parts in rank order, so every rank gets the same bits.
            parts = self._gather_rows(tensor.contiguous()).view(self.size, *tensor.shape)
            torch.sum(parts, dim=0, out=tensor)
        else:
            self._collective("all-reduce", dist.all_reduce, tensor)
        self.num_all_reduces += 1
        self.collective_seconds += time.perf_counter() - start

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        rows, columns = tensor.shape
        gathered = self._gather_rows(tensor.contiguous())
        self.num_all_gathers += 1
        self.collective_seconds += time.perf_counter() - start
        return gathered.view(self.size, rows, columns).transpose(0, 1).reshape(rows, self.size * columns)

    def _gather_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """The ranks' tensors stacked along the first dimension, rank after rank."""
        gathered = tensor.new_empty((self.size * tensor.shape[0], *tensor.shape[1:]))
        self._collective("all-gather", getattr(dist, "all_gather_single", dist.all_gather_into_tensor), gathered, tensor)
        return gathered

    def _collective(self, name: str, function, *args) -> None:
        if self.failure is not None:
            raise TensorParallelError(self.failure)
        try:
            function(*args)
        except Exception as error:
            self.fail(f"tensor parallel rank {self.rank}: the {name} failed (a rank died, or did not answer "
                      f"within {self.timeout_s:g} s): {type(error).__name__}: {error}")
            raise TensorParallelError(self.failure) from error

    def fail(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason
            logger.error("kvflow: %s", reason)

    # ------------------------------------------------------------ control (between steps)

    def broadcast(self, message) -> None:
        """Rank 0: sends message to every other rank."""
        if self.failure is not None:
            raise TensorParallelError(self.failure)
        dead = [p.pid for p in self.workers if not p.is_alive()]
        if dead:
            self.fail(f"tensor parallel worker process(es) {dead} exited")
            raise TensorParallelError(self.failure)
        payload = torch.frombuffer(bytearray(pickle.dumps(message)), dtype=torch.uint8)
        timeout = datetime.timedelta(seconds=self.timeout_s)
        try:
            with self._send_lock:
                for tensor in (torch.tensor([payload.numel()], dtype=torch.int64), payload):
                    dist.broadcast(tensor, src=0, group=self.control, async_op=True).wait(timeout)
        except Exception as error:
            self.fail(f"tensor parallel: sending the step to the ranks failed (a rank died, or did not answer "
                      f"within {self.timeout_s:g} s): {type(error).__name__}: {error}")
            raise TensorParallelError(self.failure) from error

    def receive(self):
        """A worker rank: the next message from rank 0 (waiting as long as rank 0 is idle)."""
        length = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(length, src=0, group=self.control)
        payload = torch.empty(int(length.item()), dtype=torch.uint8)
        dist.broadcast(payload, src=0, group=self.control)
        return pickle.loads(payload.numpy().tobytes())

    def gather_reports(self, report) -> list:
        """Rank 0 (after broadcasting a ReportRequest) and every worker: each rank's report, on rank 0."""
        reports = [None] * self.size if self.rank == 0 else None
        dist.gather_object(report, reports, dst=0, group=self.control)
        return reports

    def synchronize(self) -> None:
        """Waits for every rank (on the control group: loading may take the ranks different times)."""
        dist.barrier(group=self.control)

    def agree_min(self, value: int) -> int:
        """The smallest of the ranks' values (the KV blocks that fit on every rank)."""
        tensor = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.control)
        return int(tensor.item())

    def stats(self) -> dict:
        return {"size": self.size, "all_reduces": self.num_all_reduces, "all_gathers": self.num_all_gathers,
                "collective_seconds": self.collective_seconds, "failure": self.failure}

    def close(self, stop_message=None) -> None:
        """Rank 0: tells the ranks to stop (unless the group failed), waits for spawned workers
        (ending those that do not stop), then leaves the group. Workers: leaves the group."""
        if self.rank == 0 and stop_message is not None and self.failure is None:
            try:
                self.broadcast(stop_message)
            except TensorParallelError:
                pass  # failed, and said so
        deadline = time.monotonic() + (10.0 if self.failure is None else 0.0)
        for process in self.workers:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()
        self.workers = []
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as error:  # a failed group may not tear down cleanly; the process goes on
                logger.warning("kvflow: leaving the tensor parallel group: %s", error)
        if self._restore is not None:
            self._restore()
            self._restore = None
