"""The embedded SmolLM2 model end to end against Hugging Face transformers reading the same GGUF file
in float32: greedy tokens and logits, in float32 and bfloat16; the same weights through a sharded
safetensors directory; the GGUF tensor types and llama.cpp's q/k row order; and the errors a user
gets for what kvflow cannot load or run."""

import copy
import json
import math
import os
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import SMOLLM2_DIR, SMOLLM2_GGUF
from kvflow.attention_metadata import AttentionMetadata
from kvflow.engine.kv_cache import allocate_kv_caches
from kvflow.engine.model_runner import ModelRunner, ScheduledRequest
from kvflow.engine.sampling_params import SamplingParams
from kvflow.loader import load_model
from kvflow.loader.gguf_file import SUPPORTED_TENSOR_TYPES, _dequantize, _unpermute_rows, open_gguf

BLOCK_SIZE = 16
NUM_BLOCKS = 64  # 1,024 cache slots: the longest prompt plus its answer fits
NEW_TOKENS = 64

# A greedy divergence is excused only where Hugging Face's own top two logits are closer than this:
# there a float32 summation-order difference (see FP32_LOGIT_ATOL) can legitimately flip the choice.
NEAR_TIE = 1e-4

# Both sides compute in float32 from the same dequantized weights; they differ only in summation
# order (kvflow's blocked CPU kernels vs. oneDNN/MKL), a few float32 ulps per dot product that 30
# layers grow to a few 1e-5 on logits of magnitude ~30 (measured 2.2e-5 to 5.9e-5 over the prompts).
FP32_LOGIT_ATOL = 2e-4

# bfloat16 weights and activations carry 8 mantissa bits, so logits move by a few tenths (measured
# 0.20 to 0.54 over the prompts); these bounds only catch a broken bfloat16 path (wrong layout, lost
# scale), not the near-tie flips that make its greedy runs part ways with float32.
BF16_LOGIT_SANITY = 2.0
BF16_FIRST_TOKEN_AGREEMENT = 0.75

_PARAGRAPHS = [
    "The printing press, developed by Johannes Gutenberg around 1440, changed how knowledge moved "
    "through Europe. Before it, books were copied by hand, usually by monks, and a single Bible could "
    "take a year to finish. Movable metal type made it possible to print hundreds of identical pages "
    "in a day, and within fifty years presses were running in more than two hundred cities.",
    "Tides are caused mostly by the Moon's gravity pulling on the oceans. Because the pull is stronger "
    "on the side of the Earth facing the Moon and weaker on the far side, the water bulges in two "
    "places at once, which is why most coasts see two high tides and two low tides every day.",
    "To bake a simple loaf of bread, mix five hundred grams of flour with ten grams of salt, seven "
    "grams of dried yeast and about three hundred and fifty millilitres of warm water. Knead the dough "
    "for ten minutes, let it rise for an hour, shape it, let it rise again, and bake it at two hundred "
    "and twenty degrees until the crust is deep brown and the base sounds hollow when tapped.",
    "In 1969 the Apollo 11 mission landed two astronauts on the Moon. Neil Armstrong and Buzz Aldrin "
    "spent about two and a half hours walking on the surface, collecting rocks and setting up "
    "experiments, while Michael Collins orbited overhead in the command module, waiting to bring them home.",
    "A hash table stores key-value pairs in an array and uses a hash function to turn each key into an "
    "index. When two keys land on the same index, the table resolves the collision, for example by "
    "chaining entries in a list or by probing for the next free slot, so lookups stay fast on average.",
    "Honeybees communicate the location of flowers with a waggle dance. The angle of the dance "
    "relative to the vertical tells the other bees the direction of the food compared with the sun, "
    "and the length of the waggle run tells them roughly how far away it is.",
    "The human heart beats around one hundred thousand times a day. Its right side pumps blood to the "
    "lungs, where it picks up oxygen, and its left side pumps that oxygen-rich blood to the rest of "
    "the body through a network of arteries, capillaries and veins.",
    "Many cities are planting trees along their streets to fight summer heat. Shade from a mature tree "
    "can cool the pavement beneath it by more than ten degrees, and the water the leaves release "
    "lowers the air temperature of the whole neighbourhood.",
]

PLAIN_PROMPTS = {
    "capital": "The capital of France is",
    "code": "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "story": "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "primes": "The first prime numbers are 2, 3, 5, 7,",
    "long_essay": "\n\n".join(_PARAGRAPHS) + "\n\nIn summary, these examples show that",
}
CHAT_PROMPTS = {
    "chat_short": [{"role": "user", "content": "What is 2+2?"}],
    "chat_system": [
        {"role": "system", "content": "You are a concise assistant who answers in one paragraph."},
        {"role": "user", "content": "Explain why the sky is blue."},
    ],
    "chat_multi_turn": [
        {"role": "user", "content": "Give me a name for a black cat."},
        {"role": "assistant", "content": "How about Shadow?"},
        {"role": "user", "content": "Something more playful, please, and tell me why you chose it."},
    ],
    "chat_long": [
        {"role": "user", "content": "Summarize this text in three sentences:\n\n" + "\n\n".join(_PARAGRAPHS[:4])},
    ],
}
PROMPT_NAMES = [*PLAIN_PROMPTS, *CHAT_PROMPTS]


# ------------------------------------------------------------------------- fixtures and helpers


@pytest.fixture(scope="module")
def hf_model():
    return AutoModelForCausalLM.from_pretrained(SMOLLM2_DIR, gguf_file=SMOLLM2_GGUF, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_hf_tokenizer):
    return smollm2_hf_tokenizer


@pytest.fixture(scope="module")
def kv_fp32():
    """The file's weights dequantized to float32, as transformers reads them: the parity reference."""
    return load_model(None, torch.float32, dequantize_weights=True)


@pytest.fixture(scope="module")
def kv_bf16():
    return load_model(None, torch.bfloat16, dequantize_weights=True)


@pytest.fixture(scope="module")
def kv_quantized():
    """As the engine loads it by default: the projections in the file's Q4_1 blocks, the tied
    embedding and LM head in Q8_0, activations in bfloat16."""
    return load_model(None, torch.bfloat16)


@pytest.fixture(scope="module")
def kv_bf16_packed():
    """bfloat16 as the engine runs it on the CPU: products of more than 8 rows read packed copies
    of the weights (kvflow's packed_linear on every instruction set)."""
    lm = load_model(None, torch.bfloat16, dequantize_weights=True)
    assert lm.model.prepack_linear_weights() == 4 * lm.config.num_layers + 1  # and the LM head
    return lm


def hf_prompt_ids(hf_tokenizer, name: str) -> list[int]:
    if name in PLAIN_PROMPTS:
        return hf_tokenizer.encode(PLAIN_PROMPTS[name])
    return hf_tokenizer.apply_chat_template(CHAT_PROMPTS[name], add_generation_prompt=True, tokenize=True,
                                            return_dict=False)


def kvflow_prompt_ids(tokenizer, name: str) -> list[int]:
    if name in PLAIN_PROMPTS:
        return tokenizer.encode(PLAIN_PROMPTS[name])
    return tokenizer.encode(tokenizer.apply_chat_template(CHAT_PROMPTS[name], add_generation_prompt=True))


@dataclass
class HFRun:
    prompt_ids: list[int]
    tokens: list[int]                # greedy continuation, NEW_TOKENS long
    prompt_logits: torch.Tensor      # [vocab] at the last prompt position
    top2_values: torch.Tensor        # [NEW_TOKENS, 2]: the two largest logits before each token
    top2_ids: torch.Tensor           # [NEW_TOKENS, 2]


@pytest.fixture(scope="module")
def hf_reference(hf_model, hf_tokenizer) -> dict[str, HFRun]:
    """Hugging Face's greedy run for every prompt. eos_token_id=[] makes it neither stop at nor mask
    the end token, as kvflow's ignore_eos does (min_new_tokens would mask it, and pick a different
    token wherever the end token is the argmax). The attention mask is explicit: SmolLM2's pad token
    is <|im_end|>, and transformers would otherwise infer a mask that hides every <|im_end|> of a
    chat prompt."""
    runs = {}
    for name in PROMPT_NAMES:
        ids = hf_prompt_ids(hf_tokenizer, name)
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.int64),
                                    do_sample=False, max_new_tokens=NEW_TOKENS,
                                    eos_token_id=[], pad_token_id=hf_tokenizer.pad_token_id,
                                    output_logits=True, return_dict_in_generate=True)
        logits = torch.cat(out.logits).float()  # raw logits, one row per generated token
        top2 = logits.topk(2, dim=-1)
        runs[name] = HFRun(ids, out.sequences[0, len(ids):].tolist(), logits[0].clone(), top2.values, top2.indices)
    lengths = [len(run.prompt_ids) for run in runs.values()]
    assert min(lengths) <= 8 and 450 <= max(lengths) <= 700, f"the prompts should span ~5 to ~500 tokens: {lengths}"
    return runs


def kvflow_prompt_logits(lm, ids: list[int]) -> torch.Tensor:
    """float32 [vocab] logits at the last prompt position, from one prefill into a fresh cache."""
    num_blocks = -(-len(ids) // BLOCK_SIZE)
    kv_caches = allocate_kv_caches(lm.config, num_blocks, BLOCK_SIZE, lm.dtype, "cpu")
    metadata = AttentionMetadata.build([len(ids)], [len(ids)], [list(range(num_blocks))], BLOCK_SIZE)
    hidden = lm.model(torch.tensor(ids), metadata, kv_caches)
    return lm.model.compute_logits(hidden[-1:])[0].float()


def kvflow_greedy(lm, ids: list[int], max_tokens: int = NEW_TOKENS) -> list[int]:
    """The model alone, without the scheduler: the prompt in one step, then one token a step."""
    runner = ModelRunner(lm.model, lm.config, num_blocks=NUM_BLOCKS)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    block_table = list(range(NUM_BLOCKS))
    output, new_tokens, computed = [], list(ids), 0
    while len(output) < max_tokens:
        step = ScheduledRequest(new_tokens, computed, block_table, params, prompt_token_ids=ids,
                                output_token_ids=output)
        output.append(runner.execute([step])[0][0].token_id)
        computed += len(new_tokens)
        new_tokens = output[-1:]
    return output


def leading_agreement(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# ------------------------------------------------------------------------- parity with transformers


@pytest.mark.parametrize("name", PROMPT_NAMES)
def test_float32_greedy_tokens_match_hugging_face(name, kv_fp32, hf_reference, record_property):
    ref = hf_reference[name]
    ours = kvflow_greedy(kv_fp32, ref.prompt_ids)
    assert len(ours) == len(ref.tokens) == NEW_TOKENS
    diverged = leading_agreement(ours, ref.tokens)
    record_property("greedy_agreement", diverged)
    if diverged == NEW_TOKENS:
        return
    gap = (ref.top2_values[diverged, 0] - ref.top2_values[diverged, 1]).item()
    message = (f"{name}: kvflow and transformers diverge at generated token {diverged} (kvflow {ours[diverged]}, "
               f"transformers {ref.tokens[diverged]}); transformers' top-two logit gap there is {gap:.2e}")
    print(message)
    record_property("divergence", message)
    # A near-tie excuses the flip only between the two tied tokens.
    assert gap < NEAR_TIE and {ours[diverged], ref.tokens[diverged]} == set(ref.top2_ids[diverged].tolist()), message
    warnings.warn(f"excused near-tie: {message}")


@pytest.mark.parametrize("name", PROMPT_NAMES)
def test_float32_prompt_logits_match_hugging_face(name, kv_fp32, hf_reference, record_property):
    ref = hf_reference[name]
    error = (kvflow_prompt_logits(kv_fp32, ref.prompt_ids) - ref.prompt_logits).abs().max().item()
    print(f"{name}: {len(ref.prompt_ids)} prompt tokens, float32 max-abs logit error {error:.2e}")
    record_property("fp32_max_abs_logit_error", error)
    assert error <= FP32_LOGIT_ATOL


def test_bfloat16_stays_close_to_float32_reference(kv_bf16, hf_reference, record_property):
    """Reported, not held to parity: bfloat16 over 30 layers flips genuine near-ties."""
    first_token_agrees = []
    print(f"\n{'prompt':<16}{'tokens':>7}{'greedy agreement':>18}{'max-abs logit error':>21}")
    for name in PROMPT_NAMES:
        ref = hf_reference[name]
        error = (kvflow_prompt_logits(kv_bf16, ref.prompt_ids) - ref.prompt_logits).abs().max().item()
        agreement = leading_agreement(kvflow_greedy(kv_bf16, ref.prompt_ids), ref.tokens)
        first_token_agrees.append(agreement > 0)
        print(f"{name:<16}{len(ref.prompt_ids):>7}{agreement:>12}/{NEW_TOKENS}{error:>21.3f}")
        record_property(f"bf16_greedy_agreement[{name}]", agreement)
        record_property(f"bf16_max_abs_logit_error[{name}]", error)
        assert error < BF16_LOGIT_SANITY, f"{name}: bfloat16 logits off by {error:.3f}"
    assert sum(first_token_agrees) >= math.ceil(BF16_FIRST_TOKEN_AGREEMENT * len(PROMPT_NAMES)), first_token_agrees


def test_bfloat16_with_packed_weights_is_as_close_to_the_reference(kv_bf16, kv_bf16_packed, hf_reference,
                                                                    record_property):
    """The packed path (the prompts longer than 8 tokens take it in prefill) against the float32
    reference, next to the plain bfloat16 path: its logit error is of the same size, and its top
    token agrees with the plain path's wherever the reference's top two are not a near-tie."""
    for name in PROMPT_NAMES:
        ref = hf_reference[name]
        packed = kvflow_prompt_logits(kv_bf16_packed, ref.prompt_ids)
        plain = kvflow_prompt_logits(kv_bf16, ref.prompt_ids)
        packed_error = (packed - ref.prompt_logits).abs().max().item()
        plain_error = (plain - ref.prompt_logits).abs().max().item()
        record_property(f"bf16_packed_max_abs_logit_error[{name}]", packed_error)
        assert packed_error < BF16_LOGIT_SANITY, f"{name}: packed bfloat16 logits off by {packed_error:.3f}"
        assert packed_error < 2 * plain_error + 0.1, f"{name}: packed {packed_error:.3f} vs plain {plain_error:.3f}"
        top2 = ref.prompt_logits.topk(2).values
        if top2[0] - top2[1] > 1.0:
            assert packed.argmax() == plain.argmax() == ref.prompt_logits.argmax(), name


def test_a_float32_model_has_nothing_to_pack_and_warns_of_nothing(caplog):
    """Only bfloat16 weights have packed copies: a float32 load asks for them and makes none,
    without the warning that copies did not fit."""
    with caplog.at_level("WARNING", logger="kvflow"):
        lm = load_model(None, torch.float32, cpu_prepack_weights=True, dequantize_weights=True)
    assert all(m.packed_weight is None for m in lm.model.linear_modules())
    assert "packed copies" not in caplog.text


def test_packing_replaces_weights_and_stops_at_what_fits_in_memory(kv_bf16, hf_reference, monkeypatch, caplog):
    """Packing replaces each projection's weight, but a copy needs room while it is made, and the
    tied LM head's copy stays beside the embedding's table. A machine with room for one projection's
    copy and not for the head's: every projection is packed and released, the head keeps the plain
    table, the load says so, and the prompt logits stay as close to the float32 reference as the
    plain path's."""
    from kvflow.loader import model_loader

    modules = kv_bf16.model.linear_modules()
    table = kv_bf16.model.embed_tokens.weight.nbytes
    room = 2 * max(m.weight.nbytes for m in modules if m is not kv_bf16.model.lm_head)
    assert room < table
    reserved = 3 << 20
    monkeypatch.setattr(model_loader, "available_memory_bytes", lambda: room + reserved + model_loader.PACKING_HEADROOM)
    with caplog.at_level("WARNING", logger="kvflow"):
        lm = load_model(None, torch.bfloat16, cpu_prepack_weights=True, cpu_reserved_bytes=reserved,
                        dequantize_weights=True)
    packed = [m.packed_weight is not None for m in lm.model.linear_modules()]
    assert packed == [True] * (len(packed) - 1) + [False], "every projection, not the tied head"
    assert all(m.weight is None for m in lm.model.linear_modules()[:-1])
    assert f"packed {len(packed) - 1} of {len(packed)} weights" in caplog.text
    for name in PROMPT_NAMES[:2]:
        ref = hf_reference[name]
        partial = kvflow_prompt_logits(lm, ref.prompt_ids)
        plain = kvflow_prompt_logits(kv_bf16, ref.prompt_ids)
        error, plain_error = ((x - ref.prompt_logits).abs().max().item() for x in (partial, plain))
        assert error < 2 * plain_error + 0.1, f"{name}: partly packed {error:.3f} vs plain {plain_error:.3f}"


@pytest.mark.parametrize("name", PROMPT_NAMES)
def test_tokenizer_matches_hugging_face(name, kv_fp32, hf_tokenizer):
    """The parity tests feed transformers' ids to both models; this is what kvflow makes of the same text."""
    if name in CHAT_PROMPTS:
        text = kv_fp32.tokenizer.apply_chat_template(CHAT_PROMPTS[name], add_generation_prompt=True)
        assert text == hf_tokenizer.apply_chat_template(CHAT_PROMPTS[name], add_generation_prompt=True,
                                                        tokenize=False)
    assert kvflow_prompt_ids(kv_fp32.tokenizer, name) == hf_prompt_ids(hf_tokenizer, name)


# ------------------------------------------------------------------------- quantized weights

# The end-to-end bound the quantized path is held to: the file's own weights, dequantized to float32
# (whose logits match transformers', above), give the reference perplexity.
QUANTIZED_PERPLEXITY_RTOL = 0.01


def kvflow_perplexity(lm, ids: list[int]) -> float:
    """exp(mean negative log-likelihood) of ids[1:] given their prefixes, from one prefill."""
    num_blocks = -(-len(ids) // BLOCK_SIZE)
    kv_caches = allocate_kv_caches(lm.config, num_blocks, BLOCK_SIZE, lm.dtype, "cpu")
    metadata = AttentionMetadata.build([len(ids)], [len(ids)], [list(range(num_blocks))], BLOCK_SIZE)
    logits = lm.model.compute_logits(lm.model(torch.tensor(ids), metadata, kv_caches))[:-1].float()
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]))
    return math.exp(nll.item())


def test_quantized_weights_stay_in_the_files_blocks(kv_quantized, kv_fp32):
    """Every projection holds the file's Q4_1 blocks and the tied embedding its Q8_0 blocks, byte
    for byte (q and k rows back in Hugging Face's order); together they take less memory than the
    file, a third of the same weights in bfloat16."""
    from kvflow.layers import Linear
    from kvflow.ops.quantized import GGML_Q4_1, GGML_Q4_1_INTERLEAVED, GGML_Q8_0, GGML_Q8_0_INTERLEAVED, deinterleave_rows

    model, config = kv_quantized.model, kv_quantized.config
    projections = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(projections) == 4 * config.num_layers
    # On the CPU the loader interleaves the Q4_1 and Q8_0 rows for the few-row kernel (same bytes).
    assert all(m.ggml_type == GGML_Q4_1_INTERLEAVED and m.weight.dtype == torch.uint8 for m in projections)
    assert model.embed_tokens.ggml_type == GGML_Q8_0_INTERLEAVED and model.lm_head.ggml_type == GGML_Q8_0_INTERLEAVED
    for ours, reference in [(model.layers[3].self_attn.qkv_proj.weight, kv_fp32.model.layers[3].self_attn.qkv_proj.weight),
                            (model.layers[0].mlp.down_proj.weight, kv_fp32.model.layers[0].mlp.down_proj.weight)]:
        values = gguf.quants.dequantize(deinterleave_rows(ours, GGML_Q4_1).numpy(), gguf.GGMLQuantizationType.Q4_1)
        assert torch.equal(torch.from_numpy(values), reference)
    embedding = gguf.quants.dequantize(deinterleave_rows(model.embed_tokens.weight, GGML_Q8_0).numpy(),
                                       gguf.GGMLQuantizationType.Q8_0)
    assert torch.equal(torch.from_numpy(embedding), kv_fp32.model.embed_tokens.weight)
    resident = sum(p.nbytes for p in model.parameters())
    assert resident <= os.path.getsize(kv_quantized.path)
    assert sum(p.nbytes for p in kv_fp32.model.parameters()) / 2 > 2.5 * resident  # bfloat16 would be half of float32


# What a fresh process may gain in resident memory by loading the embedded model beyond its
# weights: the tokenizer's vocabulary and merges, the graph's modules, the modules imported to load
# (the figures, before and after the loader hands freed memory back: docs/benchmarks.md).
LOAD_OVERHEAD_BYTES = 80e6

RSS_GAINED_BY_LOADING = """
import sys, torch
from kvflow.loader import load_model
def rss():
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS")) * 1024
before = rss()
lm = load_model(None, torch.bfloat16, dequantize_weights=sys.argv[1] == "1")
print(rss() - before, sum(p.nbytes for p in lm.model.parameters()))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the resident memory from Linux's /proc")
@pytest.mark.parametrize("dequantize", [False, True])
def test_loading_takes_the_weights_memory_and_little_more(dequantize):
    """A quantized GGUF takes about its file's size in memory once loaded, not its bf16 size: the
    resident memory a fresh process gains is its weights plus the tokenizer and code, whatever
    the loading parsed, copied and dropped on the way."""
    result = subprocess.run([sys.executable, "-c", RSS_GAINED_BY_LOADING, "1" if dequantize else "0"],
                            capture_output=True, text=True, timeout=300, check=True)
    gained, weights = map(int, result.stdout.split()[-2:])
    assert gained <= weights + LOAD_OVERHEAD_BYTES, f"{gained / 1e6:.0f} MB for {weights / 1e6:.0f} MB of weights"
    if not dequantize:
        assert gained <= os.path.getsize(SMOLLM2_DIR / SMOLLM2_GGUF) + LOAD_OVERHEAD_BYTES


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantized_perplexity_is_within_one_percent_of_float32(dtype, kv_quantized, kv_fp32, hf_tokenizer,
                                                                record_property):
    """The embedded model on a fixed text (the eight paragraphs, ~500 tokens) through the quantized
    kernels, activations in dtype: its perplexity is within 1% of the same weights dequantized to
    float32."""
    lm = kv_quantized if dtype == torch.bfloat16 else load_model(None, torch.float32)
    ids = hf_prompt_ids(hf_tokenizer, "long_essay")
    reference = kvflow_perplexity(kv_fp32, ids)
    quantized = kvflow_perplexity(lm, ids)
    print(f"perplexity over {len(ids)} tokens: float32 {reference:.4f}, quantized ({dtype}) {quantized:.4f}")
    record_property(f"quantized_perplexity[{dtype}]", quantized)
    assert abs(quantized / reference - 1) <= QUANTIZED_PERPLEXITY_RTOL


def test_quantized_greedy_output_stays_close_to_float32(kv_quantized, hf_reference):
    """Greedy answers through the quantized kernels start as the float32 ones do on most prompts
    (int8 activations move logits by about as much as bfloat16 does), and their prompt logits stay
    within the bfloat16 path's sanity bound."""
    first_token_agrees = []
    for name in PROMPT_NAMES:
        ref = hf_reference[name]
        error = (kvflow_prompt_logits(kv_quantized, ref.prompt_ids) - ref.prompt_logits).abs().max().item()
        assert error < BF16_LOGIT_SANITY, f"{name}: quantized logits off by {error:.3f}"
        first_token_agrees.append(kvflow_greedy(kv_quantized, ref.prompt_ids, max_tokens=4)[0] == ref.tokens[0])
    assert sum(first_token_agrees) >= math.ceil(BF16_FIRST_TOKEN_AGREEMENT * len(PROMPT_NAMES)), first_token_agrees


# ------------------------------------------------------------------------- safetensors directories


@pytest.fixture(scope="module")
def safetensors_dir(hf_model, hf_tokenizer, tmp_path_factory) -> Path:
    """The embedded model as transformers saves it: float32 shards of at most 50 MB, an index, the
    config.json transformers 5 writes, and the tokenizer."""
    directory = tmp_path_factory.mktemp("smollm2-safetensors")
    config = copy.deepcopy(hf_model.config)
    del config.quantization_config  # transformers refuses to save a model it loaded from GGUF
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(hf_model.state_dict(), strict=True)
    plain.save_pretrained(directory, max_shard_size="50MB")
    hf_tokenizer.save_pretrained(directory)
    return directory


def test_sharded_safetensors_directory_runs_like_the_gguf(safetensors_dir, kv_fp32, hf_tokenizer):
    with open(safetensors_dir / "model.safetensors.index.json") as f:
        shards = set(json.load(f)["weight_map"].values())
    assert len(shards) >= 2 and shards == {p.name for p in safetensors_dir.glob("*.safetensors")}

    lm = load_model(str(safetensors_dir), torch.float32)
    assert lm.config == kv_fp32.config  # read from transformers 5's config.json (rope_parameters)
    # transformers' own GGUF conversion (dequantize, undo the q/k permutation) gives the same
    # float32 weights as kvflow's.
    gguf_params = dict(kv_fp32.model.named_parameters())
    for name, param in lm.model.named_parameters():
        assert torch.equal(param, gguf_params[name]), name
    for name in ("story", "chat_system"):
        ids = kvflow_prompt_ids(lm.tokenizer, name)  # the tokenizer transformers saved
        assert ids == hf_prompt_ids(hf_tokenizer, name)
        assert kvflow_greedy(lm, ids, 32) == kvflow_greedy(kv_fp32, ids, 32)


# ------------------------------------------------------------------------- GGUF tensor types


def _f16_round(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _safe(x: np.ndarray) -> np.ndarray:
    return np.where(x == 0, 1, x)


# gguf.quants.quantize has no K-quant quantizers, so these pack blocks by hand after ggml's
# block_q4_K / block_q5_K / block_q6_K layouts (ggml-quants.c), with a plain min/max scale choice.
def _pack_q4_k_q5_k(w: np.ndarray, bits: int) -> np.ndarray:
    """Super-blocks of 256 = 8 sub-blocks of 32, x ~= d*sc*q - dmin*m with 6-bit sc, m.
    Bytes: d f16, dmin f16, scales[12], (Q5_K: qh[32]), qs[128]."""
    rows = w.shape[0]
    x = w.reshape(-1, 8, 32)
    n = x.shape[0]
    low, high = np.minimum(x.min(-1), 0), x.max(-1)
    d = _f16_round((high - low).max(-1) / (2**bits - 1) / 63)
    dmin = _f16_round((-low).max(-1) / 63)
    sc = np.clip(np.round((high - low) / (2**bits - 1) / _safe(d)[:, None]), 0, 63).astype(np.uint8)
    m = np.clip(np.round(-low / _safe(dmin)[:, None]), 0, 63).astype(np.uint8)
    step, offset = d[:, None] * sc, dmin[:, None] * m
    q = np.clip(np.round((x + offset[..., None]) / _safe(step)[..., None]), 0, 2**bits - 1).astype(np.uint8)
    q = q.reshape(n, 4, 2, 32)  # per 64 values: the first 32 go to low nibbles, the next 32 to high ones
    qs = (q[:, :, 0] & 0xF) | ((q[:, :, 1] & 0xF) << 4)
    scales = np.concatenate([sc[:, :4] | ((sc[:, 4:] >> 4) << 6), m[:, :4] | ((m[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)], axis=1)
    parts = [_f16_bytes(d), _f16_bytes(dmin), scales]
    if bits == 5:
        qh = np.zeros((n, 32), np.uint8)
        for chunk in range(4):
            qh |= ((q[:, chunk, 0] >> 4) << (2 * chunk)) | ((q[:, chunk, 1] >> 4) << (2 * chunk + 1))
        parts.append(qh)
    parts.append(qs.reshape(n, 128))
    return np.concatenate(parts, axis=1).reshape(rows, -1)


def _pack_q6_k(w: np.ndarray) -> np.ndarray:
    """Super-blocks of 256 = 16 sub-blocks of 16, x ~= d*sc*(q - 32) with int8 sc, 6-bit q.
    Bytes: ql[128] (low 4 bits), qh[64] (high 2 bits), scales[16] int8, d f16."""
    rows = w.shape[0]
    x = w.reshape(-1, 16, 16)
    n = x.shape[0]
    sub_scale = np.abs(x).max(-1) / 31
    d = _f16_round(sub_scale.max(-1) / 127)
    sc = np.clip(np.round(sub_scale / _safe(d)[:, None]), -128, 127).astype(np.int8)
    step = d[:, None] * sc
    q = (np.clip(np.round(x / _safe(step)[..., None]), -32, 31) + 32).astype(np.uint8)
    q = q.reshape(n, 2, 4, 32)  # two halves of 128, each four runs of 32
    ql = np.concatenate([(q[:, :, 0] & 0xF) | ((q[:, :, 2] & 0xF) << 4),
                         (q[:, :, 1] & 0xF) | ((q[:, :, 3] & 0xF) << 4)], axis=2)
    qh = (q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6)
    return np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8), _f16_bytes(d)],
                          axis=1).reshape(rows, -1)


def _encode(w: np.ndarray, type_name: str) -> np.ndarray:
    if type_name == "F32":
        return w
    if type_name == "F16":
        return w.astype(np.float16)
    if type_name == "Q6_K":
        return _pack_q6_k(w)
    if type_name in ("Q4_K", "Q5_K"):
        return _pack_q4_k_q5_k(w, int(type_name[1]))
    return gguf.quants.quantize(w, gguf.GGMLQuantizationType[type_name])


# Relative RMS error bound of each type for Gaussian weights (measured error about half of it): a
# uniform b-bit code over a block's range leaves ~range / 2^b / sqrt(12); 16-bit floats round once.
TYPE_RMS_BOUNDS = {
    "F32": 0.0, "F16": 5e-4, "BF16": 4e-3, "Q8_0": 0.01, "Q6_K": 0.03,
    "Q5_0": 0.08, "Q5_1": 0.08, "Q5_K": 0.08, "Q4_0": 0.15, "Q4_1": 0.15, "Q4_K": 0.15,
}


def test_every_supported_type_is_covered():
    assert set(TYPE_RMS_BOUNDS) == set(SUPPORTED_TENSOR_TYPES)


def write_gguf(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, str | None]]) -> Path:
    """A GGUF file holding `tensors`: name -> (array, raw ggml type name or None for float arrays)."""
    writer = gguf.GGUFWriter(str(path), arch)
    for name, (array, raw_type) in tensors.items():
        raw_dtype = gguf.GGMLQuantizationType[raw_type] if raw_type else None
        writer.add_tensor(name, array, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("type_name", list(TYPE_RMS_BOUNDS))
def test_gguf_tensor_type_dequantizes_to_the_original_weights(type_name, tmp_path):
    rows, cols = 7, 512  # odd rows, so a transposed or misshapen result cannot pass
    weight = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32)
    encoded = _encode(weight, type_name)
    raw_type = None if type_name in ("F32", "F16") else type_name
    path = write_gguf(tmp_path / f"{type_name}.gguf", "llama", {"blk.0.attn_v.weight": (encoded, raw_type)})

    (tensor,) = open_gguf(str(path)).tensors
    assert tensor.tensor_type.name == type_name
    result = _dequantize(tensor).float()
    assert result.shape == (rows, cols)
    reference = torch.from_numpy(weight)
    relative_rms = ((result - reference).square().mean() / reference.square().mean()).sqrt().item()
    assert relative_rms <= TYPE_RMS_BOUNDS[type_name]


@pytest.mark.parametrize("num_heads, rows", [(9, 576), (3, 192)])  # SmolLM2's q and k projections
def test_unpermute_rows_inverts_llama_cpp_permute(num_heads, rows):
    weight = torch.randn(rows, 576)

    def llama_cpp_permute(w, n_head):  # convert_hf_to_gguf.py's LlamaModel.permute
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    permuted = llama_cpp_permute(weight, num_heads)
    assert not torch.equal(permuted, weight)
    assert torch.equal(_unpermute_rows(permuted, num_heads), weight)


# ------------------------------------------------------------------------- errors


def test_unknown_gguf_architecture(tmp_path):
    path = write_gguf(tmp_path / "neox.gguf", "gptneox", {"token_embd.weight": (np.zeros((8, 64), np.float32), None)})
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gptneox'"):
        load_model(str(path), torch.float32)


def _tiny_config(architecture: str) -> dict:
    return {"architectures": [architecture], "hidden_size": 128, "num_attention_heads": 2,
            "num_key_value_heads": 1, "intermediate_size": 256, "num_hidden_layers": 2, "vocab_size": 256}


def test_unknown_config_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_tiny_config("FooForCausalLM")))
    with pytest.raises(ValueError, match="unsupported model architecture 'FooForCausalLM'"):
        load_model(str(tmp_path), torch.float32)


@pytest.mark.parametrize("type_name", ["Q2_K", "IQ2_XXS"])
def test_unsupported_gguf_tensor_type(type_name, tmp_path):
    qtype = gguf.GGMLQuantizationType[type_name]
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(0).integers(0, 256, (4, 512 // block_values * block_bytes), dtype=np.uint8)
    path = write_gguf(tmp_path / "q.gguf", "llama", {"blk.0.attn_v.weight": (raw, type_name)})
    (tensor,) = open_gguf(str(path)).tensors
    with pytest.raises(ValueError, match=rf"'blk\.0\.attn_v\.weight' has type {type_name}, which kvflow cannot load"):
        _dequantize(tensor)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no-such-model.gguf"):
        load_model(str(tmp_path / "no-such-model.gguf"), torch.float32)


def test_truncated_gguf(tmp_path):
    source = SMOLLM2_DIR / SMOLLM2_GGUF
    path = tmp_path / "half.gguf"
    with open(source, "rb") as f:
        path.write_bytes(f.read(os.path.getsize(source) // 2))
    with pytest.raises(ValueError, match="half.gguf is a damaged GGUF file: is it truncated"):
        load_model(str(path), torch.float32)


def test_file_that_is_not_gguf(tmp_path):
    path = tmp_path / "notes.gguf"
    path.write_text("these are not weights\n" * 100)
    with pytest.raises(ValueError, match="notes.gguf is not a GGUF file"):
        load_model(str(path), torch.float32)


def test_config_without_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_tiny_config("LlamaForCausalLM")))
    with pytest.raises(FileNotFoundError, match=r"has no \*\.safetensors weights"):
        load_model(str(tmp_path), torch.float32)


def _linked_copy(source: Path, target: Path) -> Path:
    """The saved directory again, without copying its 500 MB: hard links, so a file is changed by
    replacing it, never by writing into it."""
    target.mkdir()
    for entry in source.iterdir():
        os.link(entry, target / entry.name)
    return target


def test_truncated_safetensors_shard(safetensors_dir, tmp_path):
    directory = _linked_copy(safetensors_dir, tmp_path / "model")
    shard = sorted(directory.glob("*.safetensors"))[1]
    data = shard.read_bytes()
    shard.unlink()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=rf"cannot read .*{shard.name}.*is it truncated"):
        load_model(str(directory), torch.float32)


def test_checkpoint_missing_a_tensor(safetensors_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    directory = _linked_copy(safetensors_dir, tmp_path / "model")
    index_path = directory / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    removed = "model.layers.3.mlp.down_proj.weight"
    shard = directory / index["weight_map"].pop(removed)
    tensors = load_file(shard)
    del tensors[removed]
    shard.unlink()
    save_file(tensors, shard, metadata={"format": "pt"})
    index_path.unlink()
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"checkpoint lacks weights for 1 parameter\(s\) of the model: layers\.3\.mlp\.down_proj\.weight"):
        load_model(str(directory), torch.float32)


def test_a_step_longer_than_the_context_is_refused_before_running(kv_fp32):
    context = kv_fp32.config.max_position_embeddings
    runner = ModelRunner(kv_fp32.model, kv_fp32.config, num_blocks=NUM_BLOCKS)
    params = SamplingParams(temperature=0, max_tokens=8)
    for length in (context + 1, context + 100):
        step = ScheduledRequest([1] * length, 0, list(range(NUM_BLOCKS)), params)
        with pytest.raises(ValueError, match=rf"a request of {length} tokens exceeds the model's context of {context}"):
            runner.execute([step])
