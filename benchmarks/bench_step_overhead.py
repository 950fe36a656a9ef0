"""Where a decode step's time goes on the CPU, one request at a time on the embedded model: the
executor's parallel region (every kernel of the forward, embedding through the LM head), the rest
of ModelRunner.execute around it (metadata, static buffers, the sampler), and the engine's own
work (scheduling, detokenizing, stop checks). Medians over the decode steps of a few requests.
Then the region by op, over as many requests again with the executor's op timing on: each op
phase's running time and its threads' wait at the barrier before it, per step. Last, those
requests' mean step against its bytes floor (the weights and the KV cache a step reads, over the
read bandwidth measured right before and after them): what the products take beyond their share
of the floor, and what attention, the rest of the region and the host add.

    python benchmarks/bench_step_overhead.py [--requests 4] [--tokens 128] [--model FILE.gguf]

Run with PYTHONPATH=<another checkout>/python to measure another build: one from before the
executor counts its one-region decode steps (decode_region_stats) instead.
"""

import argparse
import random
import statistics
import time

import torch

from kvflow import LLM, SamplingParams, _C
from timing import kv_read_per_token, read_bandwidth, weights_read_per_token

_PRODUCT_OPS = {"small_linear", "packed_linear", "packed_silu_and_mul", "quantized_linear"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--model", default=None, help="a GGUF file or model directory (default: the embedded model)")
    args = parser.parse_args()

    llm = LLM(model=args.model, num_scheduler_steps=1)  # a region and the host's work around it, every step
    engine, runner = llm.engine, llm.engine.runner
    rng = random.Random(0)
    vocab = llm.tokenizer.vocab_size
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    llm.generate([[rng.randrange(100, vocab - 100) for _ in range(128)]], params, use_tqdm=False)  # warm-up

    region_stats = getattr(_C, "executor_region_stats", None) or getattr(_C, "decode_region_stats")
    samples = []  # (step, execute, region) seconds of each decode step that ran in one region
    execute_seconds = [0.0]
    run_execute, run_step = runner.execute, engine.step

    def timed_execute(*a, **k):
        start = time.perf_counter()
        try:
            return run_execute(*a, **k)
        finally:
            execute_seconds[0] = time.perf_counter() - start

    def timed_step():
        regions_before, region_before = region_stats()[:2]
        start = time.perf_counter()
        outputs = run_step()
        step = time.perf_counter() - start
        regions, region = region_stats()[:2]
        if regions == regions_before + 1:
            samples.append((step, execute_seconds[0], region - region_before))
        return outputs

    runner.execute, engine.step = timed_execute, timed_step
    for _ in range(args.requests):
        llm.generate([[rng.randrange(100, vocab - 100) for _ in range(128)]], params, use_tqdm=False)

    step, execute, region = (statistics.median(column) for column in zip(*samples))
    around = statistics.median(s - r for s, _, r in samples)
    print(f"{len(samples)} decode steps in one region, {_C.cpu_isa()}, medians in ms:")
    print(f"  engine step {1e3 * step:.3f}   ModelRunner.execute {1e3 * execute:.3f}   region {1e3 * region:.3f}")
    print(f"  around the region: in execute {1e3 * (execute - region):.3f}, in the engine step "
          f"{1e3 * (step - execute):.3f}, together {1e3 * around:.3f}")
    if hasattr(_C, "executor_op_times"):
        print_op_times(llm, rng, vocab, params, args.requests, around, args.tokens)


def print_op_times(llm: LLM, rng: random.Random, vocab: int, params: SamplingParams, requests: int,
                   host_seconds: float, tokens: int) -> None:
    """The region by op phase, per decode step: microseconds running and waiting, summed over the
    threads (a phase split among the threads counts each thread's part), and the share of the
    region's thread time. Prefill runs op by op, outside these figures."""
    bandwidth_before = read_bandwidth("cpu")
    steps_before, wall_before, threads_before = _C.executor_region_stats()[:3]
    before = {(op, phase): (runs, run, wait) for op, phase, runs, run, wait in _C.executor_op_times()}
    _C.set_executor_op_timing(True)
    tpots = []
    try:
        for _ in range(requests):
            outputs = llm.generate([[rng.randrange(100, vocab - 100) for _ in range(128)]], params, use_tqdm=False)
            tpots.append(outputs[0].metrics.tpot)
    finally:
        _C.set_executor_op_timing(False)
    steps_after, wall_after, threads_after = _C.executor_region_stats()[:3]
    bandwidth = (bandwidth_before + read_bandwidth("cpu")) / 2
    steps, thread_seconds = steps_after - steps_before, threads_after - threads_before
    rows = []
    for op, phase, runs, run, wait in _C.executor_op_times():
        runs0, run0, wait0 = before.get((op, phase), (0, 0.0, 0.0))
        if runs > runs0:
            rows.append((f"{op} [{phase}]", (runs - runs0) / steps, (run - run0) / steps, (wait - wait0) / steps))
    print(f"\nthe region by op, {steps} steps with op timing on, per step (thread-microseconds, summed over "
          f"{torch.get_num_threads()} threads; region {1e6 * thread_seconds / steps:.0f}):")
    print(f"  {'op [phase]':32} {'calls':>6} {'running':>9} {'waiting':>9} {'share':>6}")
    for name, calls, run, wait in sorted(rows, key=lambda row: -(row[2] + row[3])):
        share = (run + wait) / (thread_seconds / steps)
        print(f"  {name:32} {calls:6.0f} {1e6 * run:9.1f} {1e6 * wait:9.1f} {share:6.1%}")

    # The products' phases run on every thread at once, so their wall time is their thread time
    # over the threads; so is attention's. The LM head is one of the products; a quantized
    # product's phase 0 quantizes its input, row-local.
    threads = torch.get_num_threads()
    weights = weights_read_per_token(llm.engine.runner.model)
    kv = kv_read_per_token(llm, 128, tokens)
    products = sum(run for name, _, run, _ in rows
                   if name.split(" [")[0] in _PRODUCT_OPS and name != "quantized_linear [0]") / threads
    attention = sum(run + wait for name, _, run, wait in rows if name.split(" [")[0] == "paged_attention") / threads
    region = (wall_after - wall_before) / steps
    tpot = statistics.mean(tpots)
    floor = (weights + kv) / (bandwidth * 1e9)
    print(f"\nthose steps against their bytes floor, {bandwidth:.1f} GB/s read (mean of the probes before and after), "
          f"{weights / 1e6:.1f} MB of weights and {kv / 1e6:.1f} MB of K and V a step:")
    print(f"  TPOT {1e3 * tpot:.3f} ms = {tpot / floor:.2f}x the floor {1e3 * floor:.3f} ms; of the excess "
          f"{1e3 * (tpot - floor):.3f} ms:")
    print(f"  products {1e3 * products:.3f} ms ({weights / products / 1e9:.1f} GB/s): "
          f"{1e3 * (products - weights / (bandwidth * 1e9)):+.3f} over their share of the floor")
    print(f"  attention {1e3 * attention:.3f} ms (its barrier waits included): "
          f"{1e3 * (attention - kv / (bandwidth * 1e9)):+.3f} over the K and V share")
    print(f"  the rest of the region {1e3 * (region - products - attention):.3f} ms (row-local ops, their waits, "
          f"sampling); host {1e3 * host_seconds:.3f} ms (the median of the first requests' steps)")


if __name__ == "__main__":
    main()
