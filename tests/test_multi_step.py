"""Multi-step decode (num_scheduler_steps): several decode steps run back to back in C++, each
step's sampled tokens fed to the next. A user sees the same tokens as from one step at a time,
each with its own time; greedy output follows Hugging Face transformers on a tiny checkpoint; the
run ends early once every request has drawn an end token; requests that need a step of their own
(log-probabilities, a waiting request) still get it; the scheduler reserves the steps' blocks
without preempting anyone; and the C++ loop refuses bad buffers before it runs anything."""

import random
import time

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from greedy_reference import NEAR_TIE, transformers_greedy
from kvflow import LLM, BlockAllocator, SamplingParams, _C
from kvflow.engine.config import EngineConfig
from kvflow.engine.scheduler import Scheduler, SchedulerConfig
from kvflow.engine.sequence import Sequence
from kvflow.entrypoints.cli import build_parser
from kvflow.entrypoints.cli_commands import build_engine_config

VOCAB = 49152
STEPS = 8


@pytest.fixture(scope="module")
def llm():
    """The embedded model as LLM loads it (its quantized weights), 8 decode steps a schedule."""
    return LLM(kv_cache_memory=64 << 20, num_scheduler_steps=STEPS)


def counted_steps(engine):
    """Wraps engine.step to count its calls; returns the counter."""
    calls = [0]
    step = engine.step

    def counting():
        calls[0] += 1
        return step()

    engine.step = counting
    return calls


def generate_with_steps(llm, steps: int, prompts, params):
    llm.engine.config.num_scheduler_steps = steps
    try:
        return llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.engine.config.num_scheduler_steps = STEPS


def test_several_steps_run_per_schedule(llm):
    assert EngineConfig().num_scheduler_steps == 1  # the default: a step at a time
    calls = counted_steps(llm.engine)
    replays = llm.engine.runner.cpu_programs.replays
    out = llm.generate(["The capital of Italy is"], SamplingParams(temperature=0, max_tokens=33, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 33
    # The prompt's step draws token 0; the other 32 come from 4 runs of 8 decode steps.
    assert llm.engine.runner.cpu_programs.replays - replays == 32
    assert calls[0] == 1 + 4
    del llm.engine.step


def test_same_tokens_as_one_step_at_a_time(llm):
    """Greedy and seeded sampling, end tokens, stop strings and max_tokens that no multiple of 8
    reaches, in one batch: every request's tokens, text and finish reason as with single steps."""
    prompts = ["Once upon a time, a young fox found a lantern in the forest and", "Water boils at",
               "def is_even(n):\n", "The three primary colours are", "Here is a short poem about the sea:\n"]
    params = [SamplingParams(temperature=0, max_tokens=29),
              SamplingParams(temperature=0.8, top_p=0.9, max_tokens=41, seed=7),
              SamplingParams(temperature=1.0, top_k=20, max_tokens=19, seed=3, stop=["\n\n"]),
              SamplingParams(temperature=0, max_tokens=50, stop=["."]),
              SamplingParams(temperature=0.7, max_tokens=64, seed=11, ignore_eos=True)]
    single = generate_with_steps(llm, 1, prompts, params)
    replays, calls = llm.engine.runner.cpu_programs.replays, counted_steps(llm.engine)
    several = generate_with_steps(llm, STEPS, prompts, params)
    del llm.engine.step
    assert calls[0] < llm.engine.runner.cpu_programs.replays - replays  # some schedules ran several steps
    for one, many in zip(single, several):
        assert many.outputs[0].token_ids == one.outputs[0].token_ids
        assert many.outputs[0].text == one.outputs[0].text
        assert many.outputs[0].finish_reason == one.outputs[0].finish_reason
    assert {o.outputs[0].finish_reason for o in single} == {"stop", "length"}


def test_a_run_stops_at_the_models_context():
    """max_model_len 40: a run never draws past the context; the request ends there as with
    single steps."""
    small = LLM(max_model_len=40, kv_cache_memory=8 << 20, num_scheduler_steps=STEPS)
    prompt = list(range(1000, 1029))  # 29 tokens: 11 more fit
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    single = generate_with_steps(small, 1, [prompt], params)[0].outputs[0]
    several = generate_with_steps(small, STEPS, [prompt], params)[0].outputs[0]
    assert len(single.token_ids) == 11 and single.finish_reason == "length"
    assert several.token_ids == single.token_ids and several.finish_reason == "length"


def test_a_runs_blocks_serve_the_prefix_cache(llm):
    """A follow-up whose prompt is a finished request's prompt and output finds as many cached
    tokens as after single steps: the blocks a run filled are cached when the request ends.
    16 prompt tokens and 33 out: the last run of 8 steps fills positions 41-48, block 2's last."""
    prompt = list(range(1000, 1016))
    params = SamplingParams(temperature=0, max_tokens=33, ignore_eos=True)
    cached = {}
    for steps in (1, STEPS):
        llm.engine.allocator.reset_prefix_cache()
        first = generate_with_steps(llm, steps, [prompt], params)[0]
        follow_up = prompt + first.outputs[0].token_ids + [42]
        cached[steps] = generate_with_steps(llm, steps, [follow_up], params)[0].metrics.num_cached_prompt_tokens
    assert cached[STEPS] == cached[1] == 48


def test_each_token_keeps_the_time_of_its_own_step(llm):
    """Tokens of one run reach the user together, yet each is timed at the end of its own step:
    no two share a time, the run's steps are spread over its span, and the first token's time is
    the prompt step's."""
    before = time.perf_counter()
    out = llm.generate(["Water boils at"], SamplingParams(temperature=0, max_tokens=25, ignore_eos=True),
                       use_tqdm=False)[0]
    m = out.metrics
    times = m.token_times
    assert len(times) == 25 and times[0] == m.first_token_time
    assert before < times[0] and times[-1] <= m.finished_time
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert min(gaps) > 0
    # Runs 1-8, 9-16, 17-24: within a run the gaps are a step each, never the whole run at once.
    assert max(gaps) < 8 * sorted(gaps)[len(gaps) // 2]


def test_a_run_ends_once_every_request_has_drawn_an_end_token(llm):
    prompt = "The capital of Italy is"
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    reference = generate_with_steps(llm, 1, [prompt], greedy)[0].outputs[0].token_ids
    end = next(i for i in range(2, STEPS) if reference[i] not in reference[:i])  # drawn first at step `end`
    replays = llm.engine.runner.cpu_programs.replays
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                                stop_token_ids=[reference[end]]), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == reference[:end + 1]
    assert out.outputs[0].finish_reason == "stop"
    # Tokens 1..end from one run that stopped after that many steps, not after 8.
    assert llm.engine.runner.cpu_programs.replays - replays == end


def test_requests_that_need_a_step_of_their_own_get_it(llm):
    """Log-probabilities come from each step's logits, and a request queued behind max_num_seqs
    waits for a place: both run a step at a time, with the same tokens."""
    prompts = ["Water boils at", "The capital of Italy is"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    single = generate_with_steps(llm, 1, prompts, params)
    several = generate_with_steps(llm, STEPS, prompts, params)
    for one, many in zip(single, several):
        assert many.outputs[0].token_ids == one.outputs[0].token_ids
        assert many.outputs[0].logprobs == one.outputs[0].logprobs  # every step's own, none missing
        assert all(None not in step.values() for step in many.outputs[0].logprobs)
    calls = counted_steps(llm.engine)
    llm.engine.scheduler.config.max_num_seqs = 1
    try:
        queued = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    finally:
        llm.engine.scheduler.config.max_num_seqs = 256
        del llm.engine.step
    assert [o.outputs[0].token_ids for o in queued] == [o.outputs[0].token_ids for o in single]
    # The first request decodes a step at a time while the second waits (11 steps after its
    # prompt's), then the second runs 8 + 3 steps in two schedules.
    assert calls[0] == (1 + 11) + (1 + 2)


def test_without_cpu_programs_no_blocks_are_reserved_ahead():
    """enforce_eager (and CUDA, and tensor parallelism) run no programs: a schedule takes one step
    and reserves only its own block, the same tokens as ever."""
    eager = LLM(enforce_eager=True, kv_cache_memory=8 << 20, enable_prefix_caching=False, num_scheduler_steps=STEPS)
    assert eager.engine.config.num_scheduler_steps == STEPS and not eager.engine.runner.runs_several_steps(1)
    reserved = []  # blocks in the request's table as each step runs
    execute = eager.engine.runner.execute

    def recording(batch, block_copies=None):
        reserved.append(len(batch[0].block_table))
        return execute(batch, block_copies)

    eager.engine.runner.execute = recording
    prompt = list(range(1000, 1015))  # 15 tokens: the 2nd block is needed at the 2nd decode step
    out = eager.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4
    assert reserved == [1, 1, 2, 2]  # had a run's blocks been taken, the 2nd step would hold 2


def test_a_failed_run_ends_its_requests_and_the_engine_goes_on(llm):
    """A fault inside a multi-step run ends that schedule's requests with the error, counted, and
    frees their blocks (the run's reserved ones too); the next request gets its usual output."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    expected = llm.generate(["Water boils at"], params, use_tqdm=False)[0].outputs[0].token_ids
    failures = engine.stats()["step_failures"]

    def broken(batch, steps, stop_token_ids):
        raise RuntimeError("injected fault in a multi-step run")

    engine.runner.execute_steps = broken
    try:
        with pytest.raises(RuntimeError, match="injected fault in a multi-step run"):
            llm.generate(["Water boils at", "The capital of Italy is"], params, use_tqdm=False)
    finally:
        del engine.runner.execute_steps
    assert engine.stats()["step_failures"] == failures + 1
    assert not engine.has_unfinished_requests() and engine.allocator.num_used_blocks == 0
    assert llm.generate(["Water boils at"], params, use_tqdm=False)[0].outputs[0].token_ids == expected


def test_greedy_follows_transformers(tmp_path, smollm2_hf_tokenizer):
    """A tiny random Llama checkpoint, float32: the tokens of several multi-step runs (max_tokens
    that 8 does not divide, prompts of different lengths in one batch) are transformers' greedy
    ones up to the first near tie."""
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                         bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    reference = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, parameter in reference.named_parameters():
            if "norm" in name:
                parameter.uniform_(0.5, 1.5)
            else:
                parameter.normal_(0.0, 0.1)
    reference.save_pretrained(tmp_path)
    smollm2_hf_tokenizer.save_pretrained(tmp_path)
    engine = LLM(model=str(tmp_path), dtype="float32", max_model_len=512, kv_cache_memory=16 << 20,
                 num_scheduler_steps=STEPS)
    calls = counted_steps(engine.engine)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (5, 40, 150)]
    lengths = (21, 13, 30)
    outputs = engine.generate(prompts, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths],
                              use_tqdm=False)
    assert calls[0] < 1 + 29  # some schedules ran several steps
    for ids, n, output in zip(prompts, lengths, outputs):
        tokens, _, margins = transformers_greedy(reference, ids, n, 2)
        got = output.outputs[0].token_ids
        assert len(got) == n
        for step, (want, margin) in enumerate(zip(tokens, margins)):
            if got[step] != want:
                assert margin < NEAR_TIE, f"prompt of {len(ids)}: step {step} gave {got[step]}, transformers {want}"
                break


def decoding(sched, prompt_len: int, max_tokens: int) -> Sequence:
    """A sequence past its prompt, decoding its first output token."""
    seq = Sequence("r", list(range(10, 10 + prompt_len)), SamplingParams(max_tokens=max_tokens), seed=0)
    sched.add(seq)
    plan = sched.schedule()
    seq.output_token_ids.append(7)
    sched.on_step_done(plan.scheduled)
    return seq


def test_scheduler_reserves_the_steps_blocks_or_nothing():
    pool = BlockAllocator(6, 4)
    sched = Scheduler(SchedulerConfig(4, 64, 1024, 4, False), pool)
    seq = decoding(sched, 7, 17)  # positions 0-6 in 2 blocks; the next token goes to position 7
    plan = sched.schedule()
    assert len(seq.block_table) == 2
    assert sched.reserve_steps(plan, 6)  # positions 7-12: blocks 1-3
    assert len(seq.block_table) == 4 and plan.scheduled[0].num_steps == 6
    seq.output_token_ids += [1, 2, 3, 4, 5, 6]
    sched.on_step_done(plan.scheduled)
    assert seq.num_computed_tokens == 13
    plan = sched.schedule()  # position 13, in block 3
    free = pool.num_free_blocks
    assert not sched.reserve_steps(plan, 4 * (free + 1) + 1)  # one block more than the pool has
    assert pool.num_free_blocks == free and plan.scheduled[0].num_steps == 1 and len(seq.block_table) == 4
    assert sched.running == [seq] and not plan.preempted


def test_run_decode_steps_refuses_bad_buffers_before_running(llm):
    programs = llm.engine.runner.cpu_programs
    captured = programs.programs[1]
    static = programs.buffers[1]
    m = static.metadata
    replays = programs.replays

    def call(**change):
        args = dict(token_ids=static.token_ids, positions=m.positions, slot_mapping=m.slot_mapping,
                    seq_lens=m.seq_lens, block_tables=m.block_tables, offsets=static.offsets,
                    sampled=captured.outputs[1], rows=1, steps=4, block_size=programs.block_size,
                    max_seq_len=programs.max_seq_len, stop_token_ids=torch.zeros(0, dtype=torch.int64),
                    tokens_out=torch.empty(4, 1, dtype=torch.int64))
        args.update(change)
        _C.run_decode_steps(captured.program, **args)

    with pytest.raises(RuntimeError, match="seq_lens must be a contiguous CPU Int"):
        call(seq_lens=m.seq_lens.to(torch.int64))
    with pytest.raises(RuntimeError, match=r"tokens_out must be .* \[4, 1\]"):
        call(tokens_out=torch.empty(3, 1, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="rows must be in"):
        call(rows=2)
    positions = static._columns["positions"]  # the program's own buffer, written as fill does
    saved = positions[0]
    try:
        positions[0] = programs.max_seq_len - 2  # its fourth step would pass the context
        with pytest.raises(RuntimeError, match="would reach position"):
            call()
    finally:
        positions[0] = saved
    assert programs.replays == replays


def test_num_scheduler_steps_is_validated_and_reaches_the_config():
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="num_scheduler_steps"):
            EngineConfig(num_scheduler_steps=bad)
    args = build_parser().parse_args(["generate", "hi", "--num-scheduler-steps", "4"])
    assert build_engine_config(args).num_scheduler_steps == 4
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "hi", "--num-scheduler-steps", "0"])
