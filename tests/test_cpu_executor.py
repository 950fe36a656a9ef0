"""The CPU executor (kvflow._C.CpuProgram, captured by kvflow.engine.cpu_programs): a decode step
replayed from the model's own op calls must equal the same step run op by op, bit for bit (logits
and every KV cache), for every layer kind (Qwen3's QK-norm, SmolLM3's layers without rope and
Gemma's scaled embeddings and (1 + w) norms, Gemma 2's sandwich norms and soft caps, Gemma 3's two
rotations among them, Phi-4-mini's partial rotary), on plain, packed and quantized weights (every
GGUF type kept in blocks), at 1, 2 and 3 threads and on every instruction set; and both must
equal plain PyTorch written from the formulas (float32 and bfloat16, within stated bounds), so
that the two cannot agree on a wrong answer. A layer written in Python only (QK-norm, GELU) runs
through the executor too. A bad step is refused before any node writes."""

import math

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import random_blocks
from kvflow import ops
from kvflow.attention_metadata import AttentionMetadata
from kvflow.engine.cpu_programs import CpuDecodePrograms, capture, program_batch_size
from kvflow.engine.kv_cache import allocate_kv_caches
from kvflow.engine.model_runner import ScheduledRequest
from kvflow.engine.sampling_params import SamplingParams
from kvflow.layers import Linear, MergedLinear, RMSNorm
from kvflow.models.config import ModelConfig
from kvflow.models.gemma import GemmaForCausalLM
from kvflow.models.gemma2 import Gemma2ForCausalLM
from kvflow.models.gemma3 import Gemma3ForCausalLM
from kvflow.models.llama import LlamaForCausalLM
from kvflow.models.olmo2 import Olmo2ForCausalLM
from kvflow.models.qwen3 import Qwen3ForCausalLM
from kvflow.ops.quantized import (BLOCK_VALUES, GGML_Q4_0, GGML_Q4_0_INTERLEAVED, GGML_Q4_1, GGML_Q4_1_INTERLEAVED,
                                  GGML_Q4_K, GGML_Q4_K_INTERLEAVED, GGML_Q5_K_INTERLEAVED, GGML_Q6_K_INTERLEAVED, GGML_Q5_0, GGML_Q5_1, GGML_Q5_K, GGML_Q6_K, GGML_Q8_0, GGML_Q8_0_INTERLEAVED,
                                  INTERLEAVED_TYPES, deinterleave_rows, interleave_rows)

BLOCK = 16
VARIANTS = {
    "llama": {},
    "qkv_bias": {"attention_bias": True},  # Qwen2
    "all_biases_gelu": {"attention_bias": True, "o_proj_bias": True, "mlp_bias": True, "hidden_act": "gelu"},
    "gelu_tanh": {"hidden_act": "gelu_pytorch_tanh"},
    "sliding_window": {"layer_sliding_windows": [None, 24]},
    "qwen3_qk_norm": {},  # Qwen3ForCausalLM: an RMS norm over each head of q and k
    "no_rope_layer": {"layer_uses_rope": [True, False]},  # SmolLM3's NoPE layers
    "gemma": {"hidden_act": "gelu_pytorch_tanh"},  # GemmaForCausalLM: scaled embeddings, (1 + w) norms
    # Gemma2ForCausalLM: norms after each sublayer too, query_pre_attn_scalar, caps on both logits
    "gemma2": {"hidden_act": "gelu_pytorch_tanh", "attention_scale": 256 ** -0.5, "layer_sliding_windows": [24, None],
               "attention_logit_soft_cap": 5.0, "final_logit_soft_cap": 5.0},
    # Gemma3ForCausalLM: (1 + w) QK-norm, the windowed layer rotating with its own base, linear
    # scaling on the other only
    "gemma3": {"hidden_act": "gelu_pytorch_tanh", "layer_sliding_windows": [24, None], "local_rope_theta": 100.0,
               "rope_scaling": {"rope_type": "linear", "factor": 4.0}, "final_logit_soft_cap": 5.0},
    "olmo2": {},  # Olmo2ForCausalLM: norms after each sublayer added into the stream, QK-norm over all heads
    # Granite's multipliers (its residual one is folded into the weights at load, which these
    # models skip: see tests/test_hf_checkpoints.py)
    "granite": {"attention_scale": 0.05, "embedding_multiplier": 3.0, "logits_scaling": 2.5},
    "head_dim_96": {"head_dim": 96},  # Phi-3 / Phi-4-mini's head size: not a power of two
    "partial_rotary": {"head_dim": 96, "rotary_dim": 72},  # Phi-4-mini: partial_rotary_factor 0.75
}


def small_model(dtype, variant="llama", tie=False, **overrides):
    shape = dict(vocab_size=97, hidden_size=192, intermediate_size=320, num_layers=2, num_heads=6, num_kv_heads=2,
                 head_dim=64, max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0)
    config = ModelConfig("LlamaForCausalLM", tie_word_embeddings=tie, **(shape | VARIANTS[variant] | overrides))
    torch.manual_seed(0)
    graph = {"qwen3_qk_norm": Qwen3ForCausalLM, "gemma": GemmaForCausalLM, "olmo2": Olmo2ForCausalLM,
             "gemma2": Gemma2ForCausalLM, "gemma3": Gemma3ForCausalLM}.get(variant, LlamaForCausalLM)
    model = graph(config, dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn(p.shape) if "norm" in name else torch.randn(p.shape) / p.shape[-1] ** 0.5)
    return model


def decode_step(model, context_lens, dtype, seed=0):
    """Caches holding random context, and the metadata and token ids of one decode token each."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = max(32, sum(-(-(c + 1) // BLOCK) for c in context_lens))
    kv = allocate_kv_caches(model.config, num_blocks, BLOCK, dtype, "cpu")
    for key_cache, value_cache in kv:
        key_cache.copy_(torch.randn(key_cache.shape, generator=g))
        value_cache.copy_(torch.randn(value_cache.shape, generator=g))
    tables, next_block = [], 0
    for c in context_lens:
        blocks = -(-(c + 1) // BLOCK)
        tables.append(list(range(next_block, next_block + blocks))[::-1])  # out of order on purpose
        next_block += blocks
    md = AttentionMetadata.build([1] * len(context_lens), [c + 1 for c in context_lens], tables, BLOCK,
                                 num_blocks=num_blocks)
    ids = torch.randint(0, model.config.vocab_size, (len(context_lens),), generator=g)
    return ids, md, kv


def requests_of(ids, md, sampling=None):
    """The step as the runner hands it to the programs: one ScheduledRequest per decode token
    (greedy unless sampling gives each row's parameters, seed and output offset)."""
    n = len(ids)
    params, seeds, offsets = sampling or ([SamplingParams(temperature=0.0)] * n, [0] * n, [0] * n)
    return [ScheduledRequest([token], position, table[:-(-(position + 1) // BLOCK)], p, seed,
                             output_token_ids=[0] * offset)
            for token, position, table, p, seed, offset in zip(ids.tolist(), md.positions.tolist(),
                                                               md.block_tables.tolist(), params, seeds, offsets)]


def op_by_op(model, ids, md, kv):
    with torch.inference_mode():
        return model.compute_logits(model(ids, md, kv))


def sampling_of(batch, seed=0):
    """Each row's sampling parameters (greedy, plain, top-k, top-p and min-p rows in turn), seed
    and output offset."""
    kinds = [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.7, top_k=5),
             dict(temperature=1.3, top_p=0.8), dict(temperature=0.9, min_p=0.05, top_k=40)]
    params = [SamplingParams(**kinds[i % len(kinds)]) for i in range(batch)]
    return params, [seed + 1000 * i for i in range(batch)], [3 * i + 1 for i in range(batch)]


def op_by_op_tokens(logits, params, seeds, offsets):
    def column(name, dtype):
        return torch.tensor([getattr(p, name) for p in params], dtype=dtype)

    return ops.sample(logits, column("temperature", torch.float32), column("top_k", torch.int32),
                      column("top_p", torch.float32), column("min_p", torch.float32), torch.tensor(seeds),
                      torch.tensor(offsets))


def run_program(programs, requests):
    """A program step's logits (copied out of the arena) and tokens, as tensors."""
    result = programs.run(requests)
    return result.logits.clone(), torch.tensor(result.token_ids)


def replay(model, ids, md, kv, times=2, sampling=None):
    """The step captured (its first run) and replayed `times` times on fresh copies of the caches;
    returns the last replay's logits and tokens, and the programs."""
    programs = CpuDecodePrograms(model, kv, BLOCK, model.config.max_position_embeddings)
    saved = [(k.clone(), v.clone()) for k, v in kv]
    logits = tokens = None
    for _ in range(1 + times):
        for (k, v), (k0, v0) in zip(kv, saved):
            k.copy_(k0)
            v.copy_(v0)
        logits, tokens = run_program(programs, requests_of(ids, md, sampling))
    assert programs.refusals == {}
    return logits, tokens, programs


def assert_replay_equals_op_by_op(model, ids, md, kv):
    """Logits, sampled tokens and every cache, bit for bit."""
    kv_replayed = [(k.clone(), v.clone()) for k, v in kv]
    expected = op_by_op(model, ids, md, kv)
    sampling = sampling_of(len(ids))
    logits, tokens, programs = replay(model, ids, md, kv_replayed, sampling=sampling)
    assert programs.replays == 2  # replayed, not run op by op
    assert torch.equal(logits, expected)
    assert torch.equal(tokens, op_by_op_tokens(expected, *sampling))
    for (k, v), (k1, v1) in zip(kv, kv_replayed):
        assert torch.equal(k, k1) and torch.equal(v, v1)


@pytest.fixture(params=[1, 2, 3])
def threads(request):
    """1, 2 and 3 threads (3 on a 2-core machine: one thread at a time is descheduled)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("context_lens", [[37], [5, 240, 0], [200, 3, 90, 17, 64, 1, 9, 33]])
def test_replay_equals_op_by_op(dtype, variant, context_lens, threads, cpu_isa):
    """A few rows on the plain weights (small_linear); 200 keys or more split the attention."""
    model = small_model(dtype, variant)
    assert_replay_equals_op_by_op(model, *decode_step(model, context_lens, dtype))


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("batch", [1, 5, 9, 13, 40])
def test_replay_on_packed_weights_equals_op_by_op(variant, batch, threads, cpu_isa):
    """Prepacked bfloat16 weights (packed_linear, packed_silu_and_mul) at few rows, and at more
    than 8 in a class padded to a multiple of 8: the padding rows write no cache slot."""
    model = small_model(torch.bfloat16, variant, tie=True)
    model.prepack_linear_weights()
    context_lens = [(7 * i) % 130 for i in range(batch)]
    assert batch <= 8 or program_batch_size(batch) % 8 == 0
    assert_replay_equals_op_by_op(model, *decode_step(model, context_lens, torch.bfloat16))


def quantized_activations(x):
    """x as quantized_linear multiplies it, from the formula (docs/ops.md): each block of 32
    values becomes int8 codes q = round(127 x / max|x|) times the scale max|x| / 127."""
    blocks = x.reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    codes = torch.where(amax > 0, torch.round(127 * blocks / amax), torch.zeros_like(blocks))
    return (codes * (amax / 127)).reshape(x.shape)


def dequantized_weight(module):
    """A quantized Linear's weight in float32, dequantized by the gguf package."""
    blocks = module.weight.data
    base = {layout: base for base, layout in INTERLEAVED_TYPES.items()}.get(module.ggml_type, module.ggml_type)
    if base != module.ggml_type:
        blocks = deinterleave_rows(blocks, base)
    values = gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType(base))
    return torch.from_numpy(values.copy()).reshape(module.out_features, module.in_features)


def reference_logits(model, ids, md, kv):
    """The decode step in plain float32 PyTorch from the formulas: each request's past keys and
    values read from the caches through its block table."""
    config = model.config
    heads, kv_heads, d = config.num_heads, config.num_kv_heads, config.head_dim
    act = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}[
        config.hidden_act]

    offset = getattr(model.layer_class, "norm_weight_offset", 0.0)  # Gemma: (1 + w)
    post_norms = isinstance(model, Olmo2ForCausalLM)  # OLMo 2: stream += norm(sublayer(stream))
    scale = config.attention_scale or 1 / math.sqrt(d)
    sandwich_norms = isinstance(model, Gemma2ForCausalLM)  # Gemma 2 and 3: a norm on each sublayer's output
    qk_offset = 1.0 if isinstance(model, Gemma3ForCausalLM) else 0.0  # Gemma 3's QK-norm: (1 + w)

    def soft_cap(x, cap):
        return x if cap is None else cap * torch.tanh(x / cap)

    rotary_dim = config.rotary_dim or d  # Phi-4-mini: only the leading features of each head rotate

    def rotation(i):
        """cos, sin [tokens, rotary_dim / 2]: Gemma 3's windowed layers rotate with
        local_rope_theta, unscaled."""
        local = config.local_rope_theta is not None and config.sliding_window_of(i) is not None
        base = config.local_rope_theta if local else config.rope_theta
        assert config.rope_scaling is None or config.rope_scaling["rope_type"] == "linear"
        factor = 1.0 if local or config.rope_scaling is None else config.rope_scaling["factor"]
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim
        angles = torch.outer(positions.double() / factor, base ** -exponents)
        return angles.cos().float(), angles.sin().float()

    def rms(x, w, offset=0.0):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps) * (w.float() + offset)

    def linear(x, module):
        bias = None if module.bias is None else module.bias.float()
        parts = getattr(module, "quantized_parts", None)
        if parts is not None:  # a merged projection whose parts hold different types
            out = torch.cat([F.linear(quantized_activations(x), dequantized_weight(part)) for part in parts], -1)
            return out if bias is None else out + bias
        if getattr(module, "ggml_type", None) is None:
            return F.linear(x, module.weight.float(), bias)
        return F.linear(quantized_activations(x), dequantized_weight(module), bias)

    positions = md.positions
    residual = model.embed_tokens.weight.float()[ids] * model.embed_tokens.scale
    hidden = torch.zeros_like(residual)
    for i, (layer, (key_cache, value_cache)) in enumerate(zip(model.layers, kv)):
        residual = residual + hidden
        x = residual if post_norms else rms(residual, layer.input_layernorm.weight, offset)
        attn = layer.self_attn
        q, k, v = linear(x, attn.qkv_proj).split([attn.q_size, attn.kv_size, attn.kv_size], -1)
        if post_norms:  # OLMo 2's QK-norm: all heads together
            q, k = rms(q, attn.q_norm.weight), rms(k, attn.k_norm.weight)
        elif hasattr(attn, "q_norm"):  # QK-norm: each head on its own
            q = rms(q.view(len(positions), heads, d), attn.q_norm.weight, qk_offset).reshape(len(positions), -1)
            k = rms(k.view(len(positions), kv_heads, d), attn.k_norm.weight, qk_offset).reshape(len(positions), -1)
        cos, sin = rotation(i)

        def rotate(t, n):
            t = t.view(len(positions), n, d)
            a, b = t[..., :rotary_dim].chunk(2, -1)
            return torch.cat([a * cos[:, None] - b * sin[:, None], b * cos[:, None] + a * sin[:, None],
                              t[..., rotary_dim:]], -1)

        if config.uses_rope(i):
            q, k = rotate(q, heads), rotate(k, kv_heads)
        else:
            q, k = q.view(len(positions), heads, d), k.view(len(positions), kv_heads, d)
        v = v.view(len(positions), kv_heads, d)
        window = config.sliding_window_of(i)
        outputs = []
        for b in range(len(ids)):
            pos = int(positions[b])
            table = md.block_tables[b].tolist()
            slots = [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(pos)]
            keys = torch.cat([key_cache.view(-1, kv_heads, d)[slots].float(), k[b:b + 1]])
            values = torch.cat([value_cache.view(-1, kv_heads, d)[slots].float(), v[b:b + 1]])
            if window:
                keys, values = keys[-window:], values[-window:]
            keys = keys.repeat_interleave(heads // kv_heads, 1)
            values = values.repeat_interleave(heads // kv_heads, 1)
            scores = soft_cap(torch.einsum("hd,khd->hk", q[b], keys) * scale, config.attention_logit_soft_cap)
            outputs.append(torch.einsum("hk,khd->hd", scores.softmax(-1), values).reshape(-1))
        attended = linear(torch.stack(outputs), attn.o_proj)
        if post_norms:
            residual = residual + rms(attended, layer.post_attention_layernorm.weight)
            gate, up = linear(residual, layer.mlp.gate_up_proj).chunk(2, -1)
            hidden = rms(linear(act(gate) * up, layer.mlp.down_proj), layer.post_feedforward_layernorm.weight)
            continue
        if sandwich_norms:
            residual = residual + rms(attended, layer.post_attention_layernorm.weight, offset)
            x = rms(residual, layer.pre_feedforward_layernorm.weight, offset)
            gate, up = linear(x, layer.mlp.gate_up_proj).chunk(2, -1)
            hidden = rms(linear(act(gate) * up, layer.mlp.down_proj), layer.post_feedforward_layernorm.weight, offset)
            continue
        residual = residual + attended
        x = rms(residual, layer.post_attention_layernorm.weight, offset)
        gate, up = linear(x, layer.mlp.gate_up_proj).chunk(2, -1)
        hidden = linear(act(gate) * up, layer.mlp.down_proj)
    x = rms(residual + hidden, model.norm.weight, offset)
    head = model.lm_head.tied_to.weight if model.lm_head.tied_to is not None else model.lm_head.weight
    return soft_cap(F.linear(x, head.float()) / config.logits_scaling, config.final_logit_soft_cap)


# How far a step's logits may be from plain float32 PyTorch on the same weights, as a fraction of
# the logits' range: float32 differs in summation order only; bfloat16 rounds every activation
# and cache entry (2^-9 relative) through two layers.
PLAIN_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2}
# With quantized weights the activations are rounded to 8 bits a block (1/254 of the block's
# largest value): where the reference's float32 sums differ in their last bit, a value on a
# rounding boundary takes the neighbouring code, and in bfloat16 many values do. In float32 such
# a flip is rare, but the layers after it carry it on: over 5 weight seeds of 4 formats at 1, 2
# and 3 threads, most steps matched within 1e-6 of the range and a few reached 3.7e-3 (the
# threads change which of the reference's last bits differ, so which values flip).
QUANTIZED_TOLERANCE = {torch.float32: 1e-2, torch.bfloat16: 1e-1}


def assert_matches_plain_pytorch(model, context_lens, dtype, tolerance=PLAIN_TOLERANCE, weights_of=None):
    """Op by op and the replay against reference_logits, and the replay's greedy tokens wherever
    the reference's top two logits are further apart than the tolerance. weights_of: a model with
    the same weights unpacked (packing releases the plain ones), for the reference to read."""
    ids, md, kv = decode_step(model, context_lens, dtype)
    expected = reference_logits(weights_of or model, ids, md, kv)
    kv_replayed = [(k.clone(), v.clone()) for k, v in kv]
    bound = tolerance[dtype] * float(expected.max() - expected.min())
    torch.testing.assert_close(op_by_op(model, ids, md, kv).float(), expected, rtol=0, atol=bound)
    logits, tokens, programs = replay(model, ids, md, kv_replayed, times=1)
    assert programs.replays == 1
    torch.testing.assert_close(logits.float(), expected, rtol=0, atol=bound)
    top2 = expected.topk(2).values
    clear = top2[:, 0] - top2[:, 1] > 2 * bound  # rows whose argmax no rounding can change
    assert torch.equal(tokens[clear], expected.argmax(-1)[clear])  # greedy rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("context_lens", [[37], [5, 240, 30]])
def test_op_by_op_and_replay_match_plain_pytorch(variant, context_lens, dtype, threads, cpu_isa):
    assert_matches_plain_pytorch(small_model(dtype, variant), context_lens, dtype)


QUANTIZED_LAYER_TYPES = [GGML_Q4_0_INTERLEAVED, GGML_Q4_1_INTERLEAVED, GGML_Q8_0_INTERLEAVED, GGML_Q8_0, GGML_Q5_0, GGML_Q5_1, GGML_Q4_K,
                         GGML_Q5_K, GGML_Q6_K, GGML_Q4_K_INTERLEAVED, GGML_Q5_K_INTERLEAVED, GGML_Q6_K_INTERLEAVED]


def quantized_model(dtype, ggml_type, qkv_types=None):
    """A Qwen2-like small_model (q/k/v biases) whose every layer projection holds random GGUF
    blocks of ggml_type (interleaved as the loader does for the interleaved types); widths are
    multiples of 256, the K-quants' block. qkv_types: q, k and v each in its own type instead
    (GGUF ids, as a Q4_K_M file's v in Q6_K beside q and k in Q4_K), in the same layout."""
    model = small_model(dtype, "qkv_bias", hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2)
    base = {layout: base for base, layout in INTERLEAVED_TYPES.items()}.get(ggml_type, ggml_type)
    rng = np.random.default_rng(ggml_type)

    interleaved = base != ggml_type

    def fill(module, base):
        blocks = random_blocks(base, module.out_features, module.in_features, rng)
        module.weight.data.copy_(torch.from_numpy(scaled_blocks(blocks, base, module.in_features ** -0.5)))
        if interleaved:
            assert module.interleave_rows()

    for module in list(model.layers.modules()):
        if qkv_types is not None and isinstance(module, MergedLinear) and len(module.part_sizes) == 3:
            assert module.hold_quantized_parts(qkv_types)
            for part, part_type in zip(module.quantized_parts, qkv_types):
                fill(part, part_type)
        elif isinstance(module, Linear):
            assert module.hold_quantized(base)
            fill(module, base)
    return model


# Where each format keeps the float16 scales that multiply every weight of a block (d, and the
# offsets m or dmin): scaling them scales the block's weights.
BLOCK_SCALE_BYTES = {GGML_Q4_0: [(0, 2)], GGML_Q5_0: [(0, 2)], GGML_Q8_0: [(0, 2)], GGML_Q4_1: [(0, 4)],
                     GGML_Q5_1: [(0, 4)], GGML_Q4_K: [(0, 4)], GGML_Q5_K: [(0, 4)], GGML_Q6_K: [(208, 210)]}


def scaled_blocks(blocks, ggml_type, rms):
    """random_blocks' weights (up to a few units) scaled to about the given root mean square, as
    a trained model's are: softmax over scores of a few units, not saturated."""
    values = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(ggml_type))
    factor = rms / float(np.sqrt(np.mean(values.astype(np.float64) ** 2)))
    blocks = blocks.reshape(-1, blocks.shape[-1] // (values.shape[-1] // BLOCK_VALUES[ggml_type])).copy()
    for begin, end in BLOCK_SCALE_BYTES[ggml_type]:
        scales = np.ascontiguousarray(blocks[:, begin:end]).view(np.float16)
        blocks[:, begin:end] = (scales.astype(np.float32) * factor).astype(np.float16).view(np.uint8)
    return blocks.reshape(values.shape[0], -1)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("rows", [1, 3, 12])
def test_packed_weights_match_plain_pytorch(variant, rows, threads):
    """Every product on the packed bfloat16 weights, at few rows and at many."""
    model = small_model(torch.bfloat16, variant, tie=True)
    model.prepack_linear_weights()
    assert all(m.weight is None for m in model.linear_modules() if m is not model.lm_head)
    assert_matches_plain_pytorch(model, [(11 * i) % 130 for i in range(rows)], torch.bfloat16,
                                 weights_of=small_model(torch.bfloat16, variant, tie=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ggml_type", QUANTIZED_LAYER_TYPES)
def test_replay_on_quantized_weights_equals_op_by_op(ggml_type, dtype, threads, cpu_isa):
    model = quantized_model(dtype, ggml_type)
    assert_replay_equals_op_by_op(model, *decode_step(model, [5, 240, 30], dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ggml_type", QUANTIZED_LAYER_TYPES)
def test_quantized_layers_match_plain_pytorch(ggml_type, dtype):
    """reference_logits multiplies the gguf package's dequantized weights by the activations
    quantized as the formula says (quantized_activations). float32 is the sharp check (1e-2 of
    the logits' range, for the rare flipped activation code: QUANTIZED_TOLERANCE), bfloat16 a
    coarse one."""
    assert_matches_plain_pytorch(quantized_model(dtype, ggml_type), [5, 240, 30], dtype, QUANTIZED_TOLERANCE)


@pytest.mark.parametrize("ggml_type", [GGML_Q4_K_INTERLEAVED, GGML_Q4_K])
@pytest.mark.parametrize("rows,dtype", [(1, torch.float32), (3, torch.float32), (1, torch.bfloat16),
                                        (3, torch.bfloat16), (40, torch.bfloat16)])
def test_mixed_type_qkv_replays_and_matches_plain_pytorch(ggml_type, rows, dtype, threads):
    """q and k in Q4_K, v in Q6_K, as a Q4_K_M file stores them: each part's product goes into its
    columns of the q|k|v output (a column slice as the op's out), in the program as op by op,
    against the plain formula on the parts' dequantized weights. At 40 bfloat16 rows the Q6_K
    part takes the dequantized panels on AVX-512 BF16."""
    qkv_types = [GGML_Q4_K, GGML_Q4_K, GGML_Q6_K]
    model = quantized_model(dtype, ggml_type, qkv_types)
    assert all(layer.self_attn.qkv_proj.weight is None for layer in model.layers)
    model.prepack_linear_weights()  # the bfloat16 LM head, which past 8 rows a program takes packed only
    context_lens = [(37 * i) % 200 + 5 for i in range(rows)]
    assert_replay_equals_op_by_op(model, *decode_step(model, context_lens, dtype))
    assert_matches_plain_pytorch(model, context_lens, dtype, QUANTIZED_TOLERANCE,
                                 weights_of=quantized_model(dtype, ggml_type, qkv_types))


@pytest.mark.parametrize("ggml_type", [GGML_Q4_1_INTERLEAVED, GGML_Q8_0_INTERLEAVED, GGML_Q5_K_INTERLEAVED,
                                       GGML_Q6_K_INTERLEAVED])
def test_replay_on_quantized_weights_at_many_rows_equals_op_by_op(ggml_type, threads):
    """A bfloat16 decode step of 264 rows (a large batch): on AVX-512 BF16 the interleaved Q8_0,
    Q5_K and Q6_K products go through the dequantized panels there (their rows gathered back into
    GGUF's layout, the panels handed out in cells), Q4_1's and every product elsewhere through the
    int8 kernel. The program's nodes give what the ops give called one by one, which
    test_quantized_linear.py checks against float64 at these row counts."""
    model = quantized_model(torch.bfloat16, ggml_type)
    model.prepack_linear_weights()  # the bfloat16 LM head too, which past 8 rows a program takes packed only
    assert_replay_equals_op_by_op(model, *decode_step(model, [(7 * i) % 50 for i in range(264)], torch.bfloat16))


class QKNormGeluLayer(nn.Module):
    """Not a Llama layer, written in Python only on kvflow ops: separate q/k/v projections, an RMS
    norm over each head of q and k (Qwen3, OLMo 2, Gemma 3), a GELU MLP without a gate product
    shared with the up one, no norm after attention but one on the output (sandwich-like)."""

    def __init__(self, hidden, heads, kv_heads, d, rotary, dtype):
        super().__init__()
        self.heads, self.kv_heads, self.d = heads, kv_heads, d
        self.q = Linear(hidden, heads * d, dtype=dtype)
        self.k = Linear(hidden, kv_heads * d, dtype=dtype)
        self.v = Linear(hidden, kv_heads * d, dtype=dtype)
        self.q_norm = RMSNorm(d, 1e-6, dtype=dtype)
        self.k_norm = RMSNorm(d, 1e-6, dtype=dtype)
        self.o = Linear(heads * d, hidden, dtype=dtype)
        self.rotary = rotary
        self.input_norm = RMSNorm(hidden, 1e-6, dtype=dtype)
        self.output_norm = RMSNorm(hidden, 1e-6, dtype=dtype)
        self.gate_up = Linear(hidden, 2 * 128, dtype=dtype)
        self.down = Linear(128, hidden, dtype=dtype)

    def forward(self, hidden, residual, kv_cache, md):
        if residual is None:
            residual, hidden = hidden, self.input_norm(hidden)
        else:
            hidden, residual = self.input_norm(hidden, residual)
        tokens = hidden.shape[0]
        q = self.q_norm(self.q(hidden).view(tokens, self.heads, self.d)).view(tokens, -1)
        k = self.k_norm(self.k(hidden).view(tokens, self.kv_heads, self.d)).view(tokens, -1)
        v = self.v(hidden)
        torch.ops.kvflow.rotary_embedding(md.positions, q, k, self.d, self.rotary.cos_sin_cache, True)
        key_cache, value_cache = kv_cache
        torch.ops.kvflow.reshape_and_cache(k.view(tokens, self.kv_heads, self.d), v.view(tokens, self.kv_heads, self.d),
                                           key_cache, value_cache, md.slot_mapping)
        attended = torch.empty((tokens, self.heads, self.d), dtype=q.dtype)
        torch.ops.kvflow.paged_attention(attended, q.view(tokens, self.heads, self.d), key_cache, value_cache,
                                         md.block_tables, md.cu_seqlens_q, md.seq_lens, self.d ** -0.5,
                                         md.max_query_len, md.max_seq_len, -1, 0.0, None)
        projected = self.o(attended.view(tokens, -1))
        hidden, residual = self.output_norm(projected, residual)
        activated = torch.empty((tokens, 128), dtype=hidden.dtype)
        torch.ops.kvflow.gelu_and_mul(activated, self.gate_up(hidden))
        return self.down(activated), residual


class QKNormGeluModel(nn.Module):
    def __init__(self, llama: LlamaForCausalLM):
        super().__init__()
        config = self.config = llama.config
        self.embed_tokens, self.norm, self.lm_head = llama.embed_tokens, llama.norm, llama.lm_head
        rotary = llama.layers[0].self_attn.rotary
        self.layers = nn.ModuleList(
            QKNormGeluLayer(config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim, rotary,
                            llama.dtype) for _ in range(config.num_layers))
        with torch.no_grad():
            for name, p in self.layers.named_parameters():
                p.copy_(1 + 0.1 * torch.randn(p.shape) if "norm" in name else torch.randn(p.shape) / p.shape[-1] ** 0.5)

    def forward(self, ids, md, kv):
        hidden, residual = self.embed_tokens(ids), None
        for layer, layer_kv in zip(self.layers, kv):
            hidden, residual = layer(hidden, residual, layer_kv, md)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden):
        return self.lm_head(hidden)

    def adjust_logits(self, logits):
        return logits


def qk_norm_gelu_reference_logits(model, ids, md, kv):
    """QKNormGeluModel's decode step in plain float32 PyTorch from the formulas."""
    config = model.config
    heads, kv_heads, d, eps = config.num_heads, config.num_kv_heads, config.head_dim, 1e-6
    positions, tokens = md.positions, len(ids)

    def rms(x, norm, epsilon=eps):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + epsilon) * norm.weight.float()

    def linear(x, module):
        return F.linear(x, module.weight.float())

    angles = torch.outer(positions.double(), config.rope_theta ** -(torch.arange(0, d, 2, dtype=torch.float64) / d))
    cos, sin = angles.cos().float()[:, None], angles.sin().float()[:, None]

    def rotate(t):
        a, b = t.chunk(2, -1)
        return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)

    residual = model.embed_tokens.weight.float()[ids]
    hidden = None
    for layer, (key_cache, value_cache) in zip(model.layers, kv):
        residual = residual if hidden is None else residual + hidden
        x = rms(residual, layer.input_norm)
        q = rotate(rms(linear(x, layer.q).view(tokens, heads, d), layer.q_norm))
        k = rotate(rms(linear(x, layer.k).view(tokens, kv_heads, d), layer.k_norm))
        v = linear(x, layer.v).view(tokens, kv_heads, d)
        outputs = []
        for b in range(tokens):
            pos, table = int(positions[b]), md.block_tables[b].tolist()
            slots = [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(pos)]
            keys = torch.cat([key_cache.view(-1, kv_heads, d)[slots].float(), k[b:b + 1]])
            values = torch.cat([value_cache.view(-1, kv_heads, d)[slots].float(), v[b:b + 1]])
            keys, values = (t.repeat_interleave(heads // kv_heads, 1) for t in (keys, values))
            scores = torch.einsum("hd,khd->hk", q[b], keys) * d ** -0.5
            outputs.append(torch.einsum("hk,khd->hd", scores.softmax(-1), values).reshape(-1))
        residual = residual + linear(torch.stack(outputs), layer.o)
        x = rms(residual, layer.output_norm)
        gate, up = linear(x, layer.gate_up).chunk(2, -1)
        hidden = linear(F.gelu(gate) * up, layer.down)
    x = rms(residual + hidden, model.norm, config.rms_norm_eps)
    return F.linear(x, model.lm_head.weight.float())


def test_a_layer_written_in_python_only_runs_through_the_executor(threads, cpu_isa):
    """Bit for bit what its op-by-op forward gives, and both within PLAIN_TOLERANCE of plain
    PyTorch."""
    llama = small_model(torch.bfloat16)
    torch.manual_seed(1)
    model = QKNormGeluModel(llama)
    ids, md, kv = decode_step(llama, [37, 3, 130], torch.bfloat16)
    expected = qk_norm_gelu_reference_logits(model, ids, md, kv)
    bound = PLAIN_TOLERANCE[torch.bfloat16] * float(expected.max() - expected.min())
    torch.testing.assert_close(op_by_op(model, ids, md, [(k.clone(), v.clone()) for k, v in kv]).float(), expected,
                               rtol=0, atol=bound)
    assert_replay_equals_op_by_op(model, ids, md, kv)


@pytest.mark.parametrize("ggml_type", [GGML_Q4_0, GGML_Q4_1, GGML_Q8_0, GGML_Q5_0, GGML_Q5_1, GGML_Q4_K, GGML_Q5_K,
                                       GGML_Q6_K, GGML_Q4_0_INTERLEAVED, GGML_Q4_1_INTERLEAVED, GGML_Q8_0_INTERLEAVED,
                                       GGML_Q4_K_INTERLEAVED, GGML_Q5_K_INTERLEAVED, GGML_Q6_K_INTERLEAVED])
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_quantized_products_replay_equal_op_by_op(ggml_type, rows, threads, cpu_isa):
    """Two GGUF-block products in a row (the second reads the first's output, with a bias) as a
    program: bit for bit what the ops give one by one, at every thread count; 40 rows take the
    dequantized panels. The interleaved Q4_0 / Q4_1 / Q8_0 / Q4_K / Q5_K / Q6_K layouts too (their threads split whole
    groups of 8 rows)."""
    rng = np.random.default_rng(ggml_type + rows)
    base = {layout: base for base, layout in INTERLEAVED_TYPES.items()}.get(ggml_type, ggml_type)

    def weight(out_features, in_features):
        blocks = torch.from_numpy(random_blocks(base, out_features, in_features, rng))
        return blocks if base == ggml_type else interleave_rows(blocks, base)

    width = 2 * BLOCK_VALUES[base]
    first = weight(width, width)
    second = weight(200, width)
    bias = torch.randn(200)
    x = torch.randn(rows, width, dtype=torch.bfloat16)

    def step():
        hidden = ops.quantized_linear(x, first, ggml_type, out_dtype=torch.bfloat16)
        return ops.quantized_linear(hidden, second, ggml_type, bias=bias, out_dtype=torch.float32)

    expected, captured, reason = capture(step)
    assert captured is not None, reason
    x.copy_(torch.randn(x.shape, dtype=torch.bfloat16))  # a new step's input, in the same buffer
    captured.program.run(1, 1)
    assert captured.program.replays == 1
    assert torch.equal(captured.outputs[0], step())


def test_a_quantized_embedding_replays_with_each_steps_token_ids(threads):
    rng = np.random.default_rng(3)
    table = torch.from_numpy(random_blocks(GGML_Q8_0, 300, 96, rng))
    ids = torch.tensor([5, 299, 0])

    def step():
        return ops.quantized_embedding(ids, table, GGML_Q8_0, scale=2.0, out_dtype=torch.bfloat16)

    expected, captured, reason = capture(step)
    assert captured is not None, reason
    ids.copy_(torch.tensor([17, 17, 250]))
    captured.program.run(1, 1)
    assert torch.equal(captured.outputs[0], step())
    assert not torch.equal(captured.outputs[0], expected)


def test_a_step_that_computes_outside_kvflow_ops_is_not_captured():
    model = small_model(torch.float32)
    ids, md, kv = decode_step(model, [9], torch.float32)

    def step():
        return model.compute_logits(model(ids, md, kv)) * 2

    result, program, reason = capture(step)
    assert program is None and "aten.mul" in reason
    assert result.shape == (1, model.config.vocab_size)


def test_the_arena_reuses_the_memory_of_finished_layers():
    """A program's intermediates share memory once no thread can still read them: its arena does
    not grow with the number of layers."""
    def arena_bytes(layers):
        model = small_model(torch.bfloat16, num_layers=layers)
        ids, md, kv = decode_step(model, [9, 20, 31], torch.bfloat16)
        programs = CpuDecodePrograms(model, kv, BLOCK, 512)
        programs.run(requests_of(ids, md))
        return programs.programs[3].arena.numel()

    assert arena_bytes(8) == arena_bytes(2)


@pytest.mark.parametrize("spoil,message", [
    (lambda s: s.metadata.positions.add_(1000), r"positions\[0\] = 1\d\d\d is outside"),
    (lambda s: s.metadata.slot_mapping.fill_(10 ** 6), r"slot_mapping\[0\] = 1000000 is outside"),
    (lambda s: s.metadata.slot_mapping.fill_(3), "more than once"),
    (lambda s: s.metadata.block_tables.fill_(99), r"block_tables\[0\]\[0\] = 99 is not a block id"),
    (lambda s: s.metadata.seq_lens.fill_(0), r"seq_lens\[0\] = 0 is shorter than its 1 query tokens"),
    (lambda s: s.temperature.fill_(-1.0), r"temperature\[0\] = -1 must be finite and >= 0"),
    (lambda s: s.top_p[1:].fill_(0.0), r"top_p\[1\] = 0 must be in \(0, 1\]"),
])
def test_a_bad_step_is_refused_before_any_node_writes(spoil, message, threads):
    """The replay reads the step from its static buffers: spoiled there, every node's check runs
    before the first node writes, so the caches and the outputs keep their values, and the next
    good step replays as before."""
    model = small_model(torch.bfloat16)
    ids, md, kv = decode_step(model, [37, 4], torch.bfloat16)
    programs = CpuDecodePrograms(model, kv, BLOCK, 512)
    kv_before = [t.clone() for pair in kv for t in pair]
    programs.run(requests_of(ids, md))  # captured
    for t, old in zip((t for pair in kv for t in pair), kv_before):
        t.copy_(old)
    good = run_program(programs, requests_of(ids, md))  # replayed
    captured = programs.programs[2]
    before = [t.clone() for pair in kv for t in pair]
    outputs_before = [t.clone() for t in captured.outputs]
    static = programs.buffers[2]
    inputs = (static.metadata.positions, static.metadata.slot_mapping, static.metadata.block_tables,
              static.metadata.seq_lens, static.temperature, static.top_p)
    saved = [t.clone() for t in inputs]
    with torch.inference_mode():  # the buffers are inference tensors
        spoil(static)
    with pytest.raises(RuntimeError, match=message):
        captured.program.run(1, 512)
    assert all(torch.equal(a, b) for a, b in zip(before, (t for pair in kv for t in pair)))
    assert all(torch.equal(a, b) for a, b in zip(captured.outputs, outputs_before))
    with torch.inference_mode():
        for t, s in zip(inputs, saved):
            t.copy_(s)
    for t, old in zip((t for pair in kv for t in pair), kv_before):
        t.copy_(old)
    assert all(torch.equal(a, b) for a, b in zip(run_program(programs, requests_of(ids, md)), good))


def test_a_step_that_is_not_all_decode_is_left_to_the_op_by_op_path_and_the_next_replay_is_right():
    """A step with a prompt chunk, or a row due no token, runs no program (None: the runner runs
    it op by op); rows it wrote on the way are padding again in the next step, whose replay
    equals op by op. needs_logits tells the runner which steps sample again from the logits."""
    model = small_model(torch.float32)
    ids, md, kv = decode_step(model, [37, 4, 9], torch.float32)
    programs = CpuDecodePrograms(model, kv, BLOCK, 512)
    saved = [(k.clone(), v.clone()) for k, v in kv]
    assert run_program(programs, requests_of(ids, md)) is not None  # captured
    requests = requests_of(ids, md)
    chunk = ScheduledRequest([5, 6], requests[1].num_computed_tokens - 1, requests[1].block_table,
                             SamplingParams(temperature=0.0))
    assert programs.run([requests[0], chunk, requests[2]]) is None
    not_due = ScheduledRequest(requests[2].token_ids, requests[2].num_computed_tokens, requests[2].block_table, None)
    assert programs.run([requests[0], requests[1], not_due]) is None
    assert programs.replays == 0
    for (k, v), (k0, v0) in zip(kv, saved):
        k.copy_(k0)
        v.copy_(v0)
    expected = op_by_op(model, ids, md, [(k.clone(), v.clone()) for k, v in kv])
    logits, _ = run_program(programs, requests_of(ids, md))
    assert programs.replays == 1 and torch.equal(logits, expected)
    logprobs = [ScheduledRequest(r.token_ids, r.num_computed_tokens, r.block_table, p)
                for r, p in zip(requests, [SamplingParams(temperature=0.0), SamplingParams(logprobs=2),
                                           SamplingParams(repetition_penalty=1.2)])]
    for k, step in enumerate((requests, logprobs, logprobs[:1] + requests[1:], requests[:2] + logprobs[2:])):
        for (kc, vc), (k0, v0) in zip(kv, saved):
            kc.copy_(k0)
            vc.copy_(v0)
        assert programs.run(step).needs_logits is (k in (1, 3)), k


def test_logits_the_sampler_cannot_draw_from_fail_the_replay_and_the_next_step_recovers(threads):
    """The sampler node finds a NaN logit only once the LM head has written it: the replay then
    fails with the op's own message, and a good step after it replays as before."""
    model = small_model(torch.float32)
    ids, md, kv = decode_step(model, [37, 4, 9], torch.float32)
    programs = CpuDecodePrograms(model, kv, BLOCK, 512)
    programs.run(requests_of(ids, md, sampling_of(3)))  # captured
    good = run_program(programs, requests_of(ids, md, sampling_of(3)))
    with torch.no_grad():
        saved = model.lm_head.weight[5].clone()
        model.lm_head.weight[5] = float("nan")
        with pytest.raises(RuntimeError, match=r"logits\[0, 5\] is nan: logits must be finite or -inf"):
            programs.run(requests_of(ids, md, sampling_of(3)))
        model.lm_head.weight[5] = saved
    again = run_program(programs, requests_of(ids, md, sampling_of(3)))
    assert programs.replays == 3
    assert all(torch.equal(a, b) for a, b in zip(again, good))


def test_an_out_of_range_token_id_is_refused_by_the_embedding():
    model = small_model(torch.float32)
    ids, md, kv = decode_step(model, [9], torch.float32)
    with pytest.raises(RuntimeError, match=r"token_ids\[0\] = 97 is not a token id in \[0, 97\)"):
        op_by_op(model, torch.tensor([97]), md, kv)


def test_the_engine_gives_the_same_tokens_and_logprobs_with_and_without_programs():
    """Requests of different lengths joining and leaving (batch classes 1 to 6, padded ones),
    greedy and seeded sampling, penalties: the engine's decode steps replay programs, and every
    token and logprob equals what enforce_eager (every step op by op) gives."""
    from kvflow import LLM

    prompts = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,", "Once upon a time",
               "The quick brown fox", "A list of fruits:"]
    params = [SamplingParams(temperature=0, max_tokens=6 + 3 * i, logprobs=3, ignore_eos=True) for i in range(3)] + [
        SamplingParams(temperature=0.8, top_p=0.9, seed=7 + i, max_tokens=10, logprobs=2, ignore_eos=True)
        for i in range(2)] + [  # penalties: sampled again from the program's logits
        SamplingParams(temperature=0, repetition_penalty=1.5, presence_penalty=0.5, max_tokens=12, logprobs=1,
                       ignore_eos=True)]
    results = {}
    for eager in (True, False):
        llm = LLM(enforce_eager=eager, kv_cache_memory=1 << 26, max_model_len=256)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        results[eager] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]
        programs = llm.engine.runner.cpu_programs
        assert (programs is None) == eager
        if not eager:
            assert programs.replays > 5 and len(programs.programs) >= 3 and programs.refusals == {}
        del llm
    assert results[False] == results[True]
