"""A worker rank: loads its shard of the model, then runs every step rank 0 sends until it says stop."""

import logging
import multiprocessing
import os
import sys

import torch

from kvflow.engine.distributed.rank_group import RankGroup, TensorParallelError, free_port, launched_by_torchrun
from kvflow.engine.distributed.step_plan import RankReport, ReportRequest, StepPlan, Stop

logger = logging.getLogger("kvflow")


def rank_report(group: RankGroup, model: torch.nn.Module) -> RankReport:
    return RankReport(group.rank, os.getpid(), {name: p.nbytes for name, p in model.named_parameters()},
                      group.num_all_reduces, group.num_all_gathers, group.collective_seconds)


def serve_steps(config, group: RankGroup) -> None:
    """Loads this rank's shard as rank 0 does (same KV block count), then runs rank 0's messages."""
    from kvflow import platform
    from kvflow.engine.llm_engine import load_engine_model, num_kv_blocks  # the engine imports this module
    from kvflow.engine.model_runner import ModelRunner

    if group.device.type == "cpu":  # every rank's products as rank 0's: invariant, or not
        platform.set_batch_invariant(config.batch_invariant)
    loaded = load_engine_model(config, group.parallel, group.device, group.local_size)
    group.synchronize()  # as rank 0 does before the KV budget
    num_blocks = group.agree_min(num_kv_blocks(config, loaded, None, group.device))
    runner = ModelRunner(loaded.model, loaded.config, num_blocks, config.block_size, group.device, cpu_programs=False)
    while True:
        message = group.receive()
        if isinstance(message, Stop):
            return
        if isinstance(message, ReportRequest):
            group.gather_reports(rank_report(group, loaded.model))
        elif isinstance(message, StepPlan):
            runner.run_plan(message)
        else:
            raise TypeError(f"tensor parallel worker: unknown message {type(message).__name__}")


def run_worker(config, group: RankGroup) -> int:
    """The whole life of a worker rank; its exit status."""
    try:
        serve_steps(config, group)
    except TensorParallelError as error:
        logger.error("kvflow: %s", error)
        return 1
    except Exception:
        logger.exception("kvflow: tensor parallel rank %d failed", group.rank)
        return 1
    finally:
        group.close()
    return 0


def spawned_worker_main(config, rank: int, init_method: str) -> None:
    """Entry point of a worker that rank 0 spawned on this machine."""
    logging.basicConfig(level=logging.WARNING, format=f"kvflow rank {rank}: %(message)s")
    size = config.tensor_parallel_size
    group = RankGroup.join(size, config.device, config.tensor_parallel_timeout, rank=rank, local_rank=rank,
                           local_size=size, init_method=init_method, threads=config.threads)
    sys.exit(run_worker(config, group))


def start_rank_group(config) -> RankGroup:
    """Rank 0's group: under torchrun its ranks are already running (and on the others this
    runs the worker and exits the process when rank 0 stops); otherwise spawns size - 1 workers
    on this machine."""
    size = config.tensor_parallel_size
    if launched_by_torchrun_with(size):
        group = RankGroup.join(size, config.device, config.tensor_parallel_timeout, threads=config.threads)
        if group.rank != 0:
            sys.exit(run_worker(config, group))
        return group
    init_method = f"tcp://127.0.0.1:{free_port()}"
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=spawned_worker_main, args=(config, rank, init_method), daemon=True,
                               name=f"kvflow-tp-rank-{rank}") for rank in range(1, size)]
    for process in workers:
        process.start()
    try:
        group = RankGroup.join(size, config.device, config.tensor_parallel_timeout, rank=0, local_rank=0,
                               local_size=size, init_method=init_method, threads=config.threads)
    except BaseException:
        for process in workers:
            process.kill()
        raise
    group.workers = workers
    return group


def launched_by_torchrun_with(size: int) -> bool:
    """Whether torchrun started this process as one of `size` ranks (a ValueError for another count)."""
    if not launched_by_torchrun():
        return False
    world = int(os.environ["WORLD_SIZE"])
    if world != size:
        raise ValueError(f"tensor_parallel_size is {size} but torchrun started {world} processes "
                         "(WORLD_SIZE): give --nnodes x --nproc-per-node = tensor_parallel_size")
    return True
