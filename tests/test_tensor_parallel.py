"""Tensor parallelism on two CPU ranks over gloo: tiny random checkpoints of two families (Llama
with KV heads split, Qwen2 with q/k/v biases and its one KV head replicated) give the float32
greedy tokens of one process and logprobs within LOGPROB_ATOL; each rank holds half of every
sharded weight; a decode step makes two all-reduces per layer; the server answers; a worker that
dies or hangs ends the engine with a clear error; two torchrun "nodes" on this machine run it."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from test_hf_checkpoints import (QUANTIZED_LOGPROB_ATOL, QUANTIZED_NEAR_TIE, SHAPE, as_gguf,
                                 quantization_plan, random_ids, save_randomised)
from kvflow import LLM, SamplingParams
from kvflow.engine.llm_engine import EngineDeadError
from kvflow.ops.quantized import BLOCK_VALUES, INTERLEAVED_TYPES

# Summing two ranks' float32 partial products rounds differently from one product over all the
# features; over 4 layers that moves logprobs by a few 1e-6.
LOGPROB_ATOL = 1e-4
STEPS = 12
TP_SHAPE = dict(SHAPE, hidden_size=256, intermediate_size=512, num_attention_heads=4)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, smollm2_hf_tokenizer):
    root = tmp_path_factory.mktemp("tp")
    tokenizer = smollm2_hf_tokenizer
    llama = save_randomised(LlamaForCausalLM(LlamaConfig(**dict(TP_SHAPE, num_key_value_heads=2),
                                                         tie_word_embeddings=False)), root / "llama", tokenizer)
    # An odd vocabulary (the tokenizer's 49152 ids and 3 more rows): the last rank's table is padded.
    qwen2 = save_randomised(Qwen2ForCausalLM(Qwen2Config(**dict(TP_SHAPE, num_key_value_heads=1, vocab_size=49155),
                                                         tie_word_embeddings=True)), root / "qwen2", tokenizer)
    del llama, qwen2
    return {"llama": root / "llama", "qwen2": root / "qwen2"}


def make_llm(directory: Path, tensor_parallel_size: int, **options) -> LLM:
    return LLM(model=str(directory), dtype="float32", max_model_len=512, kv_cache_memory=16 << 20,
               tensor_parallel_size=tensor_parallel_size, **options)


def greedy(llm: LLM):
    prompts = [random_ids(n, seed) for seed, n in enumerate((5, 40, 150))]
    params = SamplingParams(temperature=0, max_tokens=STEPS, logprobs=5, ignore_eos=True)
    return llm.generate(prompts, params, use_tqdm=False)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_two_ranks_give_the_tokens_of_one(family, checkpoints):
    one = make_llm(checkpoints[family], 1)
    expected = greedy(one)
    sizes = {name: p.nbytes for name, p in one.engine.runner.model.named_parameters()}
    del one
    llm = make_llm(checkpoints[family], 2)
    try:
        outputs = greedy(llm)
        reports = llm.engine.parallel_reports()
    finally:
        llm.engine.shutdown()
    for want, got in zip(expected, outputs):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        for step, top in enumerate(want.outputs[0].logprobs):
            for token, logprob in top.items():
                assert abs(got.outputs[0].logprobs[step][token] - logprob) < LOGPROB_ATOL, (step, token)
    assert [r.rank for r in reports] == [0, 1] and reports[0].pid != reports[1].pid
    for report in reports:
        for name, full in sizes.items():
            held = report.parameter_bytes[name]
            if "norm" in name or name.endswith("o_proj.bias") or name.endswith("down_proj.bias"):
                assert held == full, name  # replicated
            elif family == "qwen2" and name.endswith("qkv_proj.weight"):
                # q split, the one KV head held whole on both ranks: (4 + 1 + 1) heads -> (2 + 1 + 1)
                assert held == full * 4 // 6, name
            elif family == "qwen2" and name.endswith("qkv_proj.bias"):
                assert held == full * 4 // 6, name
            elif name == "embed_tokens.weight" and family == "qwen2":
                row = TP_SHAPE["hidden_size"] * 4
                assert held == (49155 + 1) // 2 * row, name  # 24578 rows each, the last rank's padded
            else:
                assert held == full // 2, name


@pytest.mark.parametrize("kind", ["legacy", "k_quants"])
def test_gguf_blocks_shard_by_whole_blocks(kind, checkpoints, tmp_path, smollm2_hf_tokenizer):
    """A Qwen2 GGUF whose projections, embedding and LM head stay in their blocks (the types as
    quantization_plan mixes them): at two ranks each rank holds half of every quantized tensor's
    bytes (a quantized o_proj's 128 input features per rank are whole Q8_0 or Q5_0 blocks but not
    whole 256-value K-quant blocks: those are dequantized at load), and greedy tokens are those of
    one process wherever its top two logprobs are not within QUANTIZED_NEAR_TIE."""
    config = Qwen2Config(**dict(TP_SHAPE, num_key_value_heads=2), tie_word_embeddings=False, use_sliding_window=False)
    reference = save_randomised(Qwen2ForCausalLM(config), tmp_path / "hf", smollm2_hf_tokenizer)
    path = as_gguf(reference, tmp_path / "model.gguf", "qwen2", quantized=quantization_plan(reference.config, kind),
                   with_vocabulary=True)
    one = make_llm(path, 1)
    expected = greedy(one)
    sizes = {name: p.nbytes for name, p in one.engine.runner.model.named_parameters()}
    quantized = {name: module.ggml_type for name, module in one.engine.runner.model.named_modules()
                 if getattr(module, "ggml_type", None) is not None and hasattr(module, "weight")}
    del one
    llm = make_llm(path, 2)
    try:
        outputs = greedy(llm)
        reports = llm.engine.parallel_reports()
    finally:
        llm.engine.shutdown()
    assert quantized  # blocks were kept at one rank
    file_types = {layout: base for base, layout in INTERLEAVED_TYPES.items()}  # the loader interleaves on the CPU
    for name, ggml_type in quantized.items():
        held = reports[1].parameter_bytes[name + ".weight"]
        full = sizes[name + ".weight"]
        if name.endswith("o_proj") and (TP_SHAPE["hidden_size"] // 2) % BLOCK_VALUES.get(file_types.get(ggml_type, ggml_type), 32):
            assert held > full, name  # float32 columns instead of blocks
        else:
            assert held * 2 == full, name
    for want, got in zip(expected, outputs):
        for step, token in enumerate(want.outputs[0].token_ids):
            top = sorted(want.outputs[0].logprobs[step].values(), reverse=True)
            if got.outputs[0].token_ids[step] != token:
                assert top[0] - top[1] < QUANTIZED_NEAR_TIE, step
                break
            for candidate, logprob in want.outputs[0].logprobs[step].items():
                if candidate in got.outputs[0].logprobs[step]:
                    assert abs(got.outputs[0].logprobs[step][candidate] - logprob) < QUANTIZED_LOGPROB_ATOL


def test_a_decode_step_makes_two_all_reduces_per_layer(checkpoints):
    """Every layer's o_proj and down_proj reduce their partial products (a replicated model would
    make none); the vocab-parallel embedding adds one, the LM head gathers the logits once."""
    llm = make_llm(checkpoints["llama"], 2)
    engine = llm.engine
    try:
        engine.add_request("r", random_ids(20, 7), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        engine.step()  # the prompt
        before = engine.stats()["tensor_parallel"]
        engine.step()  # one decode step
        after = engine.stats()["tensor_parallel"]
        reports = engine.parallel_reports()
    finally:
        engine.shutdown()
    layers = engine.model_config.num_layers
    assert after["all_reduces"] - before["all_reduces"] == 2 * layers + 1
    assert after["all_gathers"] - before["all_gathers"] == 1
    assert reports[1].num_all_reduces == reports[0].num_all_reduces  # the worker made the same ones


def test_head_counts_that_do_not_divide_are_an_error_naming_them():
    """The embedded model has 9 heads and 3 KV heads: two ranks cannot share them."""
    with pytest.raises(ValueError, match=r"num_attention_heads \(9\) is not divisible by tensor_parallel_size \(2\)"):
        LLM(tensor_parallel_size=2, kv_cache_memory=16 << 20)


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="tensor_parallel_timeout"):
        LLM(tensor_parallel_size=2, tensor_parallel_timeout=0)


def _kill_and_step(llm: LLM, signal_number: int) -> float:
    """Two requests in flight, a worker signalled, then steps until the engine gives up; returns
    how long the failing step took."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    engine.add_request("a", random_ids(10, 1), params)
    engine.add_request("b", random_ids(30, 2), params)
    engine.step()
    worker = engine.ranks.workers[0]
    os.kill(worker.pid, signal_number)
    start = time.perf_counter()
    with pytest.raises(EngineDeadError, match="tensor parallel"):
        for _ in range(50):
            engine.step()
    elapsed = time.perf_counter() - start
    if worker.is_alive():
        os.kill(worker.pid, signal.SIGKILL)
    assert not engine.has_unfinished_requests()  # every request in flight was ended
    assert engine.stats()["finished_requests"]["abort"] == 2
    with pytest.raises(EngineDeadError):
        engine.add_request("c", random_ids(5, 3), params)
    with pytest.raises(EngineDeadError):
        engine.step()
    return elapsed


def test_a_worker_that_dies_ends_the_engine_with_an_error(checkpoints):
    elapsed = _kill_and_step(make_llm(checkpoints["llama"], 2), signal.SIGKILL)
    assert elapsed < 30


def test_a_worker_that_hangs_ends_the_engine_within_the_timeout(checkpoints):
    elapsed = _kill_and_step(make_llm(checkpoints["llama"], 2, tensor_parallel_timeout=3.0), signal.SIGSTOP)
    assert elapsed < 30


def test_server_at_two_ranks_answers_then_reports_unhealthy_when_a_worker_dies(checkpoints):
    import httpx
    from conftest import running_server

    from kvflow.engine.async_engine import AsyncLLMEngine
    from kvflow.entrypoints.openai.api_server import build_app

    prompt = random_ids(12, 5)
    expected = make_llm(checkpoints["llama"], 1).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0].outputs[0].text
    llm = make_llm(checkpoints["llama"], 2)
    body = {"model": "m", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    try:
        with running_server(build_app(AsyncLLMEngine(llm.engine), "m")) as url:
            assert httpx.get(url + "/health").status_code == 200
            answer = httpx.post(url + "/v1/completions", json=body, timeout=120).json()
            assert answer["choices"][0]["text"] == expected
            os.kill(llm.engine.ranks.workers[0].pid, signal.SIGKILL)
            failed = httpx.post(url + "/v1/completions", json=body, timeout=120)
            assert failed.status_code >= 500
            assert httpx.get(url + "/health").status_code == 503
            again = httpx.post(url + "/v1/completions", json=body, timeout=120)
            assert again.status_code == 503 and "tensor parallel" in again.json()["error"]["message"]
    finally:
        llm.engine.shutdown()


def test_two_torchrun_nodes_generate_the_text_of_one_process(checkpoints, tmp_path):
    """Two `torchrun --nnodes 2 --node-rank {0,1}` launches on this machine stand in for two nodes."""
    model = str(checkpoints["llama"])
    command = ["generate", "--model", model, "--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory",
               "16MiB", "--temperature", "0", "--max-tokens", "8", "--ignore-eos", "--quiet", "Once upon a time"]
    single = subprocess.run([sys.executable, "-m", "kvflow", *command], capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stderr
    with __import__("socket").socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(rank),
                               "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                               f"127.0.0.1:{port}", "-m", "kvflow", *command, "--tensor-parallel-size", "2"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    results = [node.communicate(timeout=300) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], [err[-3000:] for _, err in results]
    outputs = sorted(out for out, _ in results)
    assert outputs[-1] == single.stdout  # one node printed the text, the other nothing
    assert outputs[0] == ""


def _assert_same_greedy(expected, outputs, atol: float) -> None:
    """Greedy tokens equal, except after a step whose top two logprobs are within atol (where a
    device's rounding may pick either); logprobs within atol."""
    for want, got in zip(expected, outputs):
        for step, token in enumerate(want.outputs[0].token_ids):
            top = sorted(want.outputs[0].logprobs[step].values(), reverse=True)
            for candidate, logprob in want.outputs[0].logprobs[step].items():
                if candidate in got.outputs[0].logprobs[step]:
                    assert abs(got.outputs[0].logprobs[step][candidate] - logprob) < atol, (step, candidate)
            if got.outputs[0].token_ids[step] != token:
                assert top[0] - top[1] < atol, step
                break


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_one_rank_on_cuda_gives_the_cpu_tokens(checkpoints):
    """What the GPU check runs of tensor parallelism on a machine of one GPU: the engine at
    tensor_parallel_size 1 on CUDA, float32, against the CPU."""
    expected = greedy(make_llm(checkpoints["llama"], 1))
    _assert_same_greedy(expected, greedy(make_llm(checkpoints["llama"], 1, device="cuda")), 1e-3)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (NCCL ranks)")
def test_two_cuda_ranks_over_nccl_give_the_cpu_tokens(checkpoints):
    expected = greedy(make_llm(checkpoints["qwen2"], 1))
    llm = make_llm(checkpoints["qwen2"], 2, device="cuda")
    try:
        _assert_same_greedy(expected, greedy(llm), 1e-3)
    finally:
        llm.engine.shutdown()
