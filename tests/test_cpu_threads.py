"""The engine steps on one thread while another process takes a core, and returns to all of its
threads afterwards (kvflow.engine.cpu_threads), judged from the decode region's barrier waits;
and the region's own accounts of its time, in all and by op."""

import time
import types

import torch

import kvflow
from kvflow.engine import cpu_threads
from kvflow.engine.cpu_threads import CpuThreadGovernor


class FakeRegion:
    """executor_region_stats as the region would count them: steps, wall, thread and waiting seconds."""

    def __init__(self):
        self.stats = (0, 0.0, 0.0, 0.0)

    def run(self, steps: int, wait_share: float, threads: int = 2, seconds: float = 0.01):
        s, wall, busy, wait = self.stats
        self.stats = (s + steps, wall + steps * seconds, busy + steps * seconds * threads,
                      wait + steps * seconds * threads * wait_share)

    def executor_region_stats(self):
        return self.stats


def test_governor_steps_on_one_thread_while_barriers_wait_and_comes_back(monkeypatch):
    region = FakeRegion()
    clock = [100.0]
    monkeypatch.setattr(cpu_threads, "_C", types.SimpleNamespace(executor_region_stats=region.executor_region_stats))
    monkeypatch.setattr(cpu_threads.time, "monotonic", lambda: clock[0])
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    governor = CpuThreadGovernor(2)

    def step(wait_share: float, steps: int = CpuThreadGovernor.WINDOW_STEPS) -> int:
        """One engine step, standing for `steps` region steps; the threads it ran with."""
        one_thread = governor.begin_step()
        inside = torch.get_num_threads()
        assert one_thread == (inside == 1)
        if inside > 1:
            region.run(steps, wait_share)
        governor.end_step(one_thread)
        assert torch.get_num_threads() == 2, "outside a step torch keeps all its threads"
        return inside

    try:
        for _ in range(3):  # a machine to itself: a few percent at the barriers
            assert step(0.05) == 2
        assert not governor.reduced
        assert step(0.6, CpuThreadGovernor.WINDOW_STEPS - 1) == 2
        assert not governor.reduced, "judged only over a whole window"
        assert step(0.6, 1) == 2
        assert governor.reduced
        assert step(0.6) == 1
        clock[0] += CpuThreadGovernor.ONE_THREAD_SECONDS / 2
        assert step(0.6) == 1
        clock[0] += CpuThreadGovernor.ONE_THREAD_SECONDS
        assert step(0.05) == 2  # tried again: the core is free, so all threads stay
        assert step(0.05) == 2 and not governor.reduced
    finally:
        torch.set_num_threads(threads)


def test_decode_region_counts_its_steps_and_waits():
    if torch.get_num_threads() < 2:
        torch.set_num_threads(2)
    before = kvflow._C.executor_region_stats()
    llm = kvflow.LLM(kv_cache_memory=1 << 24, max_model_len=256)
    llm.generate(["Hello"], kvflow.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    steps, wall, busy, waited, _ = (a - b for a, b in zip(kvflow._C.executor_region_stats(), before))
    assert steps >= 5  # every decode step of one request runs in the region
    assert 0 < wall and wall * 1.5 <= busy <= wall * torch.get_num_threads() * 1.01 + 1e-3
    assert 0 <= waited < busy


def test_op_timing_splits_the_decode_steps_by_op_and_stops_when_switched_off():
    if torch.get_num_threads() < 2:
        torch.set_num_threads(2)
    llm = kvflow.LLM(kv_cache_memory=1 << 24, max_model_len=256)
    params = kvflow.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm.generate(["Hello"], params, use_tqdm=False)  # programs captured with timing off
    before = {(op, phase): (runs, run, wait) for op, phase, runs, run, wait in kvflow._C.executor_op_times()}
    kvflow._C.set_executor_op_timing(True)
    try:
        start = time.perf_counter()
        llm.generate(["Hello"], params, use_tqdm=False)
        wall = time.perf_counter() - start
    finally:
        kvflow._C.set_executor_op_timing(False)
    after = kvflow._C.executor_op_times()
    delta = {}
    for op, phase, runs, run, wait in after:
        runs0, run0, wait0 = before.get((op, phase), (0, 0.0, 0.0))
        if runs > runs0:
            delta[op, phase] = (runs - runs0, run - run0, wait - wait0)
    layers = llm.engine.model_config.num_layers
    attention_runs = delta["paged_attention", 0][0]
    assert attention_runs % layers == 0 and attention_runs >= 5 * layers  # every layer of every decode step
    assert delta["reshape_and_cache", 0][0] == attention_runs
    products = [v for (op, _), v in delta.items() if op in ("quantized_linear", "small_linear", "packed_linear")]
    assert products and all(run > 0 for _, run, _ in products)
    assert all(run >= 0 and wait >= 0 for _, run, wait in delta.values())
    # What the threads spent, by op, cannot exceed what they had: the wall time of the request.
    assert 0 < sum(run + wait for _, run, wait in delta.values()) <= wall * torch.get_num_threads()

    llm.generate(["Hello"], params, use_tqdm=False)
    assert kvflow._C.executor_op_times() == after  # off: nothing more counted
