"""The fused CPU decoder layer (kvflow::llama_decoder_layer) and the fused stack of layers
(kvflow::llama_decoder_layers, what the model runs on the CPU) against the same layers run op by
op: the same kernels in the same order, so hidden state, residual stream and KV cache must agree
bit for bit; and the op-by-op layer against plain float32 PyTorch, so that they cannot agree on a
wrong answer."""

import pytest
import torch
import torch.nn.functional as F

from kvflow import ops
from kvflow.attention_metadata import AttentionMetadata
from kvflow.engine.kv_cache import allocate_kv_caches
from kvflow.models.config import ModelConfig
from kvflow.models.llama import LlamaForCausalLM

BLOCK = 16


def small_model(dtype, attention_bias=False, sliding_window=None):
    config = ModelConfig("LlamaForCausalLM", vocab_size=97, hidden_size=192, intermediate_size=320, num_layers=2,
                         num_heads=6, num_kv_heads=2, head_dim=64, max_position_embeddings=256,
                         rms_norm_eps=1e-5, rope_theta=10000.0, attention_bias=attention_bias,
                         sliding_window=sliding_window)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config, dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn(p.shape) if "norm" in name else torch.randn(p.shape) / p.shape[-1] ** 0.5)
    return model


def step_inputs(model, context_lens, new_lens, dtype):
    """Caches holding random context, plus metadata and inputs for new tokens after it."""
    num_blocks = max(32, sum(-(-(c + n) // BLOCK) for c, n in zip(context_lens, new_lens)))
    kv = allocate_kv_caches(model.config, num_blocks, BLOCK, dtype, "cpu")
    for key_cache, value_cache in kv:
        key_cache.normal_()
        value_cache.normal_()
    tables, next_block = [], 0
    for c, n in zip(context_lens, new_lens):
        blocks = -(-(c + n) // BLOCK)
        tables.append(list(range(next_block, next_block + blocks))[::-1])  # out of order on purpose
        next_block += blocks
    md = AttentionMetadata.build(new_lens, [c + n for c, n in zip(context_lens, new_lens)], tables, BLOCK)
    hidden = torch.randn(sum(new_lens), model.config.hidden_size, dtype=dtype)
    residual = torch.randn(sum(new_lens), model.config.hidden_size, dtype=dtype)
    return hidden, residual, kv, md


def convert_replacing_parameters(model, dtype):
    """model.to(dtype) with overwrite_module_params_on_conversion: .to replaces the parameters
    themselves rather than their data, so anything holding the old tensors is left behind."""
    overwrite = torch.__future__.get_overwrite_module_params_on_conversion()
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        model.to(dtype)
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(overwrite)


def assert_fused_equals_op_by_op(layer, fused, hidden, residual, kv, md):
    """fused (the layer's fused path, or its forward) against forward_op_by_op on copies of the
    same inputs: hidden state, residual stream and this layer's KV cache, bit for bit."""
    kv_fused = [(k.clone(), v.clone()) for k, v in kv]
    out, res = layer.forward_op_by_op(hidden.clone(), residual.clone(), kv[0], md)
    fused_hidden, fused_residual = fused(hidden.clone(), residual.clone(), kv_fused[0], md)
    assert torch.equal(fused_hidden, out)
    assert torch.equal(fused_residual, res)
    assert torch.equal(kv_fused[0][0], kv[0][0]) and torch.equal(kv_fused[0][1], kv[0][1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("context_lens,new_lens", [([37], [1]), ([5, 70, 0], [1, 1, 3]), ([200], [8])])
@pytest.mark.parametrize("variant", ["plain", "qkv_bias", "sliding_window"])
def test_fused_layer_equals_op_by_op(dtype, context_lens, new_lens, variant, cpu_isa):
    model = small_model(dtype, attention_bias=variant == "qkv_bias",
                        sliding_window=24 if variant == "sliding_window" else None)
    layer = model.layers[0]
    assert_fused_equals_op_by_op(layer, layer.forward_fused_cpu, *step_inputs(model, context_lens, new_lens, dtype))


@pytest.mark.parametrize("variant", ["plain", "qkv_bias"])
def test_fused_layer_on_packed_weights_equals_op_by_op(variant, cpu_isa):
    """Batched decode and prefill rows (more than small_linear takes) on prepacked bfloat16
    weights: on every instruction set the fused op runs packed_linear and packed_silu_and_mul."""
    model = small_model(torch.bfloat16, attention_bias=variant == "qkv_bias")
    model.prepack_linear_weights()
    layer = model.layers[0]
    assert layer.fused_cpu_args()[-1] is not None
    hidden, residual, kv, md = step_inputs(model, [5, 70, 0, 33], [1, 1, 30, 9], torch.bfloat16)
    assert_fused_equals_op_by_op(layer, layer, hidden, residual, kv, md)
    args = layer.fused_cpu_args()
    with pytest.raises(RuntimeError, match="come together"):
        torch.ops.kvflow.llama_decoder_layer(
            hidden.clone(), residual.clone(), md.positions, *args[:8], kv[0][0], kv[0][1], md.slot_mapping,
            md.block_tables, md.cu_seqlens_q, md.seq_lens, *args[8:12], md.max_query_len, md.max_seq_len, args[12],
            ops.pack_linear_weight(layer.self_attn.qkv_proj.weight), None, None, None)


def test_fused_layer_follows_the_module_after_it_is_converted():
    """The fused path gathers the layer's tensors once; converting the model (.to) must not leave
    it running on the tensors from before. With overwrite_module_params_on_conversion, .to
    replaces the parameters themselves rather than their data."""
    model = small_model(torch.bfloat16)
    layer = model.layers[0]
    hidden, residual, _, md = step_inputs(model, [37], [1], torch.bfloat16)
    layer.forward_fused_cpu(hidden.clone(), residual.clone(), step_inputs(model, [37], [1], torch.bfloat16)[2][0], md)

    convert_replacing_parameters(model, torch.float32)
    _, _, kv, md = step_inputs(model, [37], [1], torch.float32)
    assert_fused_equals_op_by_op(layer, layer.forward_fused_cpu, hidden.float(), residual.float(), kv, md)


def assert_stack_equals_op_by_op(model, hidden, residual, kv, md):
    """model.forward_fused_cpu (every layer in one llama_decoder_layers call) against the layers
    run op by op, one after the other, on copies of the same inputs: bit for bit, every cache."""
    kv_fused = [(k.clone(), v.clone()) for k, v in kv]
    out, res = hidden.clone(), residual.clone()
    for layer, layer_kv in zip(model.layers, kv):
        out, res = layer.forward_op_by_op(out, res, layer_kv, md)
    fused_hidden, fused_residual = hidden.clone(), residual.clone()
    assert model.forward_fused_cpu(fused_hidden, fused_residual, md, kv_fused)
    assert torch.equal(fused_hidden, out)
    assert torch.equal(fused_residual, res)
    for (key, value), (fused_key, fused_value) in zip(kv, kv_fused):
        assert torch.equal(fused_key, key) and torch.equal(fused_value, value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("context_lens,new_lens", [([37], [1]), ([5, 70, 0], [1, 1, 3])])
@pytest.mark.parametrize("variant", ["plain", "qkv_bias", "sliding_window"])
def test_fused_stack_equals_op_by_op(dtype, context_lens, new_lens, variant, cpu_isa):
    model = small_model(dtype, attention_bias=variant == "qkv_bias",
                        sliding_window=24 if variant == "sliding_window" else None)
    assert_stack_equals_op_by_op(model, *step_inputs(model, context_lens, new_lens, dtype))


@pytest.mark.parametrize("variant", ["plain", "qkv_bias"])
def test_fused_stack_on_packed_weights_equals_op_by_op(variant, cpu_isa):
    """Many rows on packed weights: the whole stack in one op, on every instruction set."""
    model = small_model(torch.bfloat16, attention_bias=variant == "qkv_bias")
    model.prepack_linear_weights()
    assert_stack_equals_op_by_op(model, *step_inputs(model, [5, 70, 0, 33], [1, 1, 30, 9], torch.bfloat16))


@pytest.mark.parametrize("context_lens,new_lens", [([40] * 24 + [3] * 24, [1] * 48), ([7, 90, 0, 33], [9, 9, 10, 9])])
def test_fused_stack_split_across_threads_equals_op_by_op(context_lens, new_lens):
    """Balanced many-row steps (batched decode; prefill chunks of equal size): with two or more
    threads each runs a part of the requests through every layer on its own. That must not
    change a bit either."""
    model = small_model(torch.bfloat16)
    model.prepack_linear_weights()
    inputs = step_inputs(model, context_lens, new_lens, torch.bfloat16)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert_stack_equals_op_by_op(model, *inputs)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("context_lens,new_lens", [([37], [1]), ([240], [1]), ([5, 70], [1, 1]), ([200], [3]),
                                                   ([5, 70, 0], [1, 1, 3]), ([9, 120], [4, 4])])
@pytest.mark.parametrize("variant", ["plain", "qkv_bias", "sliding_window"])
def test_fused_stack_in_one_parallel_region_equals_op_by_op(threads, dtype, context_lens, new_lens, variant):
    """A few rows with two or more threads: every layer runs inside one parallel region, the
    threads taking cells of each product (their own part first, then the others'), attention
    items and rows of the norms, and meeting at a barrier between kernels (3 threads on this
    2-core machine: one at a time is descheduled). 200 keys or more split the attention, and the
    splits merge."""
    model = small_model(dtype, attention_bias=variant == "qkv_bias",
                        sliding_window=24 if variant == "sliding_window" else None)
    inputs = step_inputs(model, context_lens, new_lens, dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert_stack_equals_op_by_op(model, *inputs)
    finally:
        torch.set_num_threads(before)


def stack_call_args(model, hidden, residual, kv, md):
    """The arguments of one llama_decoder_layers call, as lists that a test can spoil."""
    (input_norms, qkvs, biases, o_projs, post_norms, gate_ups, downs, cos_sin, heads, kv_heads, eps, scale, window,
     _) = model.fused_cpu_stack_args()
    return dict(hidden=hidden, residual=residual, positions=md.positions, input_norm_weights=list(input_norms),
                qkv_weights=list(qkvs), qkv_biases=list(biases), o_weights=list(o_projs),
                post_norm_weights=list(post_norms), gate_up_weights=list(gate_ups), down_weights=list(downs),
                cos_sin_cache=cos_sin, key_caches=[k for k, _ in kv], value_caches=[v for _, v in kv],
                slot_mapping=md.slot_mapping, block_tables=md.block_tables, cu_seqlens_q=md.cu_seqlens_q,
                seq_lens=md.seq_lens, num_heads=heads, num_kv_heads=kv_heads, epsilon=eps, scale=scale,
                max_query_len=md.max_query_len, max_seq_len=md.max_seq_len, sliding_window=window)


@pytest.mark.parametrize("spoil,message", [
    (lambda a: a["o_weights"].pop(), "o_weights has 1 entries, but input_norm_weights has 2"),
    (lambda a: a["value_caches"].append(a["value_caches"][0]), "value_caches has 3 entries"),
    (lambda a: a.update(o_weights=[a["o_weights"][0], a["o_weights"][1][:, :64]]),
     r"layer 1: o_weight must have shape \[192, 384\]"),
    (lambda a: a.update(down_weights=[a["down_weights"][0], a["down_weights"][1].float()]),
     "layer 1: down_weight has dtype Float but hidden has dtype BFloat16"),
    (lambda a: a.update(key_caches=[a["key_caches"][0], a["key_caches"][1][..., :32]]),
     r"layer 1: key_cache must have shape"),
    (lambda a: a.update(qkv_packed=[a["qkv_weights"][0]] * 2), "come together"),
    (lambda a: a.update(key_caches=[a["key_caches"][0], torch.zeros_like(a["key_caches"][1][:-1])],
                        value_caches=[a["value_caches"][0], torch.zeros_like(a["value_caches"][1][:-1])]),
     "layer 1: every KV cache must be contiguous and of layer 0's shape"),
    (lambda a: a.update(positions=a["positions"] + 1000), r"positions\[0\] = 1037 is outside"),
    (lambda a: a.update(slot_mapping=a["slot_mapping"] * 0 + 10**6), r"slot_mapping\[0\] = 1000000 is outside"),
    (lambda a: a.update(block_tables=a["block_tables"] * 0 + 99), r"block_tables\[0\]\[0\] = 99 is not a block id"),
    (lambda a: a.update(seq_lens=a["seq_lens"] * 0), r"seq_lens\[0\] = 0 is shorter than its 1 query tokens"),
])
@pytest.mark.parametrize("threads", [1, 2])
def test_fused_stack_rejects_a_bad_layer_before_running_any(spoil, message, threads):
    """A mistake in the last layer, or in the step's metadata, is found before the first layer
    runs, with the layers run one kernel call at a time (1 thread) or in one parallel region
    (2): hidden, residual and every cache come back untouched."""
    model = small_model(torch.bfloat16)
    hidden, residual, kv, md = step_inputs(model, [37, 4], [1, 1], torch.bfloat16)
    before = [t.clone() for t in (hidden, residual, *[c for pair in kv for c in pair])]
    args = stack_call_args(model, hidden, residual, kv, md)
    spoil(args)
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with pytest.raises(RuntimeError, match=message):
            ops.llama_decoder_layers(**args)
    finally:
        torch.set_num_threads(saved_threads)
    for old, new in zip(before, (hidden, residual, *[c for pair in kv for c in pair])):
        assert torch.equal(old, new)


def test_fused_stack_follows_the_layers_after_conversion():
    """The stack's argument lists are rebuilt once any layer has regathered its own (after .to,
    or repacking), so a converted model never runs on the tensors from before."""
    model = small_model(torch.bfloat16)
    hidden, residual, kv, md = step_inputs(model, [37], [1], torch.bfloat16)
    assert model.forward_fused_cpu(hidden.clone(), residual.clone(), md, kv)
    convert_replacing_parameters(model, torch.float32)
    hidden, residual, kv, md = step_inputs(model, [37], [1], torch.float32)
    assert_stack_equals_op_by_op(model, hidden, residual, kv, md)


def reference_layer(layer, hidden, residual, keys, values, positions, config):
    """Plain float32 PyTorch for one request whose past keys/values (rotated) are given."""
    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps) * w.float()

    residual = residual.float() + hidden.float()
    x = rms(residual, layer.input_layernorm.weight)
    attn = layer.self_attn
    qkv = F.linear(x, attn.qkv_proj.weight.float(), None if attn.qkv_proj.bias is None else attn.qkv_proj.bias.float())
    q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], -1)
    cos_sin = attn.rotary.cos_sin_cache[positions]
    cos, sin = cos_sin.chunk(2, -1)

    def rotate(t, heads):
        t = t.view(len(positions), heads, 64)
        a, b = t.chunk(2, -1)
        return torch.cat([a * cos[:, None] - b * sin[:, None], b * cos[:, None] + a * sin[:, None]], -1)

    q, k = rotate(q, config.num_heads), rotate(k, config.num_kv_heads)
    keys = torch.cat([keys, k]).repeat_interleave(config.num_heads // config.num_kv_heads, 1)
    values = torch.cat([values, v.view(len(positions), config.num_kv_heads, 64)]).repeat_interleave(
        config.num_heads // config.num_kv_heads, 1)
    mask = torch.arange(keys.shape[0])[None, :] <= positions[:, None]
    scores = torch.einsum("qhd,khd->hqk", q, keys) / 8.0
    a = torch.einsum("hqk,khd->qhd", scores.masked_fill(~mask, float("-inf")).softmax(-1), values).reshape(
        len(positions), -1)
    residual = residual + F.linear(a, attn.o_proj.weight.float())
    x = rms(residual, layer.post_attention_layernorm.weight)
    gate, up = F.linear(x, layer.mlp.gate_up_proj.weight.float()).chunk(2, -1)
    return F.linear(F.silu(gate) * up, layer.mlp.down_proj.weight.float()), residual


@pytest.mark.parametrize("new_tokens", [1, 4])
def test_decode_layer_matches_plain_pytorch(new_tokens):
    model = small_model(torch.float32)
    layer, config = model.layers[0], model.config
    context = 29
    hidden, residual, kv, md = step_inputs(model, [context], [new_tokens], torch.float32)
    table = md.block_tables[0].tolist()
    slots = [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(context)]
    keys, values = kv[0][0].view(-1, 2, 64)[slots].clone(), kv[0][1].view(-1, 2, 64)[slots].clone()
    expected_hidden, expected_residual = reference_layer(layer, hidden, residual, keys, values,
                                                         md.positions, config)
    out, res = layer(hidden, residual, kv[0], md)  # new_tokens <= 8 on the CPU: the fused op
    torch.testing.assert_close(res, expected_residual, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, expected_hidden, rtol=1e-4, atol=1e-4)
