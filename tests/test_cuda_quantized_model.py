"""A model on CUDA holding its projections, embedding and untied LM head in GGUF blocks of all
eight types kvflow keeps (as the loader holds a GGUF file's tensors) gives the logits of the
same model with those blocks dequantized by the gguf package and multiplied by torch: a prefill
of two requests (the many-row products) and then decode steps (the few-row products). Needs a
GPU; the GPU check runs it."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from conftest import random_blocks
from kvflow.attention_metadata import AttentionMetadata
from kvflow.engine.kv_cache import allocate_kv_caches
from kvflow.models.config import ModelConfig
from kvflow.models.llama import LlamaForCausalLM

BLOCK = 16
LAYERS = 2
# Checkpoint name -> GGML type: every type kvflow keeps in blocks, as a Q4_K_M file mixes them.
PLAN = {"embed_tokens.weight": "Q8_0", "lm_head.weight": "Q6_K"}
for _layer, (_qkv, _o, _gate_up, _down) in enumerate([("Q4_K", "Q5_0", "Q5_K", "Q4_1"),
                                                      ("Q4_0", "Q8_0", "Q5_1", "Q6_K")]):
    _prefix = f"layers.{_layer}."
    PLAN |= {_prefix + f"self_attn.{p}_proj.weight": _qkv for p in "qkv"}
    PLAN |= {_prefix + "self_attn.o_proj.weight": _o, _prefix + "mlp.down_proj.weight": _down}
    PLAN |= {_prefix + f"mlp.{p}_proj.weight": _gate_up for p in ("gate", "up")}


def config() -> ModelConfig:
    return ModelConfig("LlamaForCausalLM", vocab_size=300, hidden_size=256, intermediate_size=512, num_layers=LAYERS,
                       num_heads=4, num_kv_heads=2, head_dim=64, max_position_embeddings=512, rms_norm_eps=1e-5,
                       rope_theta=10000.0, tie_word_embeddings=False, attention_bias=True)


def checkpoint(cfg: ModelConfig) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(float tensors, the same with PLAN's weights as raw blocks), named as in a checkpoint. The
    norms are small so that attention scores stay moderate."""
    rng = np.random.default_rng(0)
    shapes = {"embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size), "norm.weight": (cfg.hidden_size,),
              "lm_head.weight": (cfg.vocab_size, cfg.hidden_size)}
    for layer in range(cfg.num_layers):
        prefix = f"layers.{layer}."
        shapes |= {prefix + "input_layernorm.weight": (cfg.hidden_size,),
                   prefix + "post_attention_layernorm.weight": (cfg.hidden_size,),
                   prefix + "self_attn.q_proj.weight": (cfg.num_heads * cfg.head_dim, cfg.hidden_size),
                   prefix + "self_attn.k_proj.weight": (cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size),
                   prefix + "self_attn.v_proj.weight": (cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size),
                   prefix + "self_attn.q_proj.bias": (cfg.num_heads * cfg.head_dim,),
                   prefix + "self_attn.k_proj.bias": (cfg.num_kv_heads * cfg.head_dim,),
                   prefix + "self_attn.v_proj.bias": (cfg.num_kv_heads * cfg.head_dim,),
                   prefix + "self_attn.o_proj.weight": (cfg.hidden_size, cfg.num_heads * cfg.head_dim),
                   prefix + "mlp.gate_proj.weight": (cfg.intermediate_size, cfg.hidden_size),
                   prefix + "mlp.up_proj.weight": (cfg.intermediate_size, cfg.hidden_size),
                   prefix + "mlp.down_proj.weight": (cfg.hidden_size, cfg.intermediate_size)}
    floats, raw = {}, {}
    for name, shape in shapes.items():
        if name in PLAN:
            ggml_type = int(GGMLQuantizationType[PLAN[name]])
            blocks = random_blocks(ggml_type, shape[0], shape[1], rng)
            raw[name] = torch.from_numpy(blocks)
            floats[name] = torch.from_numpy(quants.dequantize(blocks, GGMLQuantizationType(ggml_type)).copy())
        else:
            scale = 0.1 if "norm" in name else 1.0
            floats[name] = raw[name] = torch.from_numpy(scale * rng.standard_normal(shape).astype(np.float32))
    return floats, raw


def run_steps(model: LlamaForCausalLM, cfg: ModelConfig, dtype: torch.dtype, steps: int,
              device: str = "cuda") -> list[torch.Tensor]:
    """The logits of a prefill of two requests (37 and 5 tokens) and of `steps` decode steps of
    both, each feeding back the reference's fixed tokens, so both models see the same inputs."""
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=generator).tolist() for n in (37, 5)]
    decode_tokens = torch.randint(0, cfg.vocab_size, (steps, 2), generator=generator).tolist()
    kv = allocate_kv_caches(cfg, 16, BLOCK, dtype, device)
    tables = [[3, 0, 5, 7], [1, 6, 2, 4]]
    lengths = [len(p) for p in prompts]
    outputs = []
    md = AttentionMetadata.build(lengths, lengths, tables, BLOCK, device=device, num_blocks=16)
    ids = torch.tensor(prompts[0] + prompts[1], device=device)
    hidden = model(ids, md, kv)
    outputs.append(model.compute_logits(hidden[torch.tensor([36, 41], device=device)]).float().cpu())
    for tokens in decode_tokens:
        lengths = [n + 1 for n in lengths]
        md = AttentionMetadata.build([1, 1], lengths, tables, BLOCK, device=device, num_blocks=16)
        outputs.append(model.compute_logits(model(torch.tensor(tokens, device=device), md, kv)).float().cpu())
    return outputs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_cuda_model_on_gguf_blocks_matches_its_dequantized_weights(dtype):
    """float32: the products differ from torch's only in summation order, so the logits agree to
    1e-4 of their range. bfloat16: both models round every activation to bfloat16, and the
    reference its dequantized weights too, so the bound is that of a few bfloat16 roundings
    carried through two layers (2^-8 each): 5% of the range, with the greedy token the same
    wherever the reference's top two are 10% of the range apart."""
    cfg = config()
    floats, raw = checkpoint(cfg)
    with torch.device("cuda"):
        reference = LlamaForCausalLM(cfg, dtype)
        quantized = LlamaForCausalLM(cfg, dtype)
    reference.load_weights(floats.items())
    types = {name: int(GGMLQuantizationType[type_name]) for name, type_name in PLAN.items()}
    held = quantized.hold_quantized_weights(types)
    assert held == set(PLAN)
    quantized.load_weights((name, raw[name] if name in held else tensor) for name, tensor in floats.items())
    for module in quantized.linear_modules() + [quantized.embed_tokens]:
        assert module.ggml_type is not None and module.weight.dtype == torch.uint8 and module.weight.is_cuda
    expected_steps = run_steps(reference, cfg, dtype, steps=6)
    actual_steps = run_steps(quantized, cfg, dtype, steps=6)
    for step, (expected, actual) in enumerate(zip(expected_steps, actual_steps)):
        spread = float(expected.max() - expected.min())
        error = float((actual - expected).abs().max())
        assert error <= (1e-4 if dtype == torch.float32 else 0.05) * spread, (step, error, spread)
        top2 = expected.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 0.1 * spread
        assert torch.equal(actual.argmax(-1)[clear], expected.argmax(-1)[clear]), step
