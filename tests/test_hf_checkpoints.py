"""Checkpoints as transformers saves them, built at test time with every weight, bias and norm
randomised, against transformers itself: float32 greedy tokens and the top-20 logprobs at every
step, for prompts of 5, 40 and 150 tokens (longer than the test window). Qwen2/2.5 (q/k/v
biases, tied or untied embeddings, a sliding window on the upper layers only), Qwen3 (QK-norm,
tied or untied, with attention biases, with a window on the upper layers), SmolLM3 (layers
without rope), Mistral (a window on
every layer), and Llama with attention biases (q/k/v and o_proj), MLP biases, and GELU (erf and
tanh) MLPs, Gemma 2 (sandwich norms, soft caps, alternating windows), Gemma 3 (QK-norm, two rope
bases, rope scaling on the global layers only); and Qwen2, Qwen3, Gemma 2 and Gemma 3 as qwen2,
qwen3, gemma2 and gemma3 GGUF files."""

import json
import math
import random
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import (GemmaConfig, GemmaForCausalLM, Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, GraniteConfig, GraniteForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Olmo2Config, Olmo2ForCausalLM, Phi3Config, Phi3ForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM, SmolLM3Config,
                          SmolLM3ForCausalLM)

from conftest import SMOLLM2_DIR, SMOLLM2_GGUF
from greedy_reference import LOGPROB_ATOL, NEAR_TIE, assert_greedy_matches, transformers_greedy
from k_quants import K_TYPES, quantize_k
from kvflow import LLM, SamplingParams
from kvflow.engine.model_runner import ModelRunner, ScheduledRequest
from kvflow.loader.gguf_file import config_from_gguf, gguf_weights, open_gguf
from kvflow.loader.model_loader import prepare_cpu_weights
from kvflow.models.registry import model_class
from kvflow.ops.quantized import INTERLEAVED_TYPES

VOCAB = 49152  # the tokenizer saved beside the weights is SmolLM2's
STEPS = 24
TOP = 20
WINDOW = 32


@pytest.fixture(scope="module")
def tokenizer(smollm2_hf_tokenizer):
    return smollm2_hf_tokenizer


SHAPE = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=2,
             num_key_value_heads=1, max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-6,
             bos_token_id=1, eos_token_id=2)


def save_randomised(model, directory: Path, tokenizer):
    """Every parameter random, norms around 1 and biases large enough that ignoring one shows."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                parameter.normal_(0.0, 0.5)
            else:
                parameter.normal_(0.0, 0.1)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return model.eval()


def qwen2_checkpoint(directory: Path, tokenizer, tied: bool, window: int | None) -> Qwen2ForCausalLM:
    config = Qwen2Config(**SHAPE, tie_word_embeddings=tied, use_sliding_window=window is not None,
                         sliding_window=window, max_window_layers=2)
    return save_randomised(Qwen2ForCausalLM(config), directory, tokenizer)


def random_ids(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(length)]


def assert_matches_transformers(reference, directory: Path, max_model_len: int = 512,
                                lengths: tuple[int, ...] = (5, 40, 150)):
    llm = LLM(model=str(directory), dtype="float32", max_model_len=max_model_len, kv_cache_memory=16 << 20)
    params = SamplingParams(temperature=0, max_tokens=STEPS, logprobs=TOP, ignore_eos=True)
    prompts = [random_ids(n, seed) for seed, n in enumerate(lengths)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for ids, output in zip(prompts, outputs):
        assert_greedy_matches(output, transformers_greedy(reference, ids, STEPS, TOP), f"prompt of {len(ids)}: ")


@pytest.mark.parametrize("tied,window,layer_types", [(True, None, True), (False, None, True), (True, WINDOW, True),
                                                      (False, WINDOW, True), (False, WINDOW, False)],
                         ids=["tied", "untied", "tied-window", "untied-window", "window-from-max_window_layers"])
def test_qwen2_matches_transformers(tied, window, layer_types, tokenizer, tmp_path):
    """The window variants window layers 2 and 3 of 4 (max_window_layers = 2): a kvflow that
    windowed every layer, or none, differs on the 150-token prompt. Checkpoints saved before
    transformers wrote layer_types carry max_window_layers alone."""
    reference = qwen2_checkpoint(tmp_path, tokenizer, tied, window)
    if not layer_types:
        config = json.loads((tmp_path / "config.json").read_text())
        del config["layer_types"]
        (tmp_path / "config.json").write_text(json.dumps(config))
    assert_matches_transformers(reference, tmp_path)


def test_qwen2_yarn_matches_transformers(tokenizer, tmp_path):
    """YaRN as Qwen2.5 ships it, with an original context of 64 so that the 150-token prompt runs
    well past it: a kvflow without the ramp of frequencies, or without the attention factor on
    cos and sin, differs."""
    shape = {**SHAPE, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                          "rope_theta": SHAPE["rope_theta"]}}
    reference = save_randomised(Qwen2ForCausalLM(Qwen2Config(**shape)), tmp_path, tokenizer)
    assert json.loads((tmp_path / "config.json").read_text())["rope_parameters"]["rope_type"] == "yarn"
    assert_matches_transformers(reference, tmp_path)


@pytest.mark.parametrize("variant", [dict(tie_word_embeddings=True), dict(tie_word_embeddings=False),
                                     dict(attention_bias=True),
                                     dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2)],
                         ids=["tied", "untied", "attention_bias", "window"])
def test_qwen3_matches_transformers(variant, tokenizer, tmp_path):
    """QK-norm: an RMS norm over each head of q and k before rope, its weights randomised like
    every norm's (a kvflow that skipped it, or normed whole rows, differs at the first token).
    The window variant windows layers 2 and 3 of 4."""
    config = Qwen3Config(**SHAPE, head_dim=64, **variant)
    reference = save_randomised(Qwen3ForCausalLM(config), tmp_path, tokenizer)
    assert_matches_transformers(reference, tmp_path)


@pytest.mark.parametrize("legacy_gelu", [False, True], ids=["gelu_pytorch_tanh", "released-config-gelu"])
def test_gemma_matches_transformers(legacy_gelu, tokenizer, tmp_path):
    """Gemma: embeddings times sqrt(hidden_size), (1 + w) norms with every norm weight random (a
    kvflow that used w alone, or skipped the scale, differs at the first token), GELU-tanh MLP.
    The released configs say hidden_act "gelu" and mean tanh, as transformers reads them."""
    config = GemmaConfig(**SHAPE, head_dim=64, pad_token_id=None)
    reference = save_randomised(GemmaForCausalLM(config), tmp_path, tokenizer)
    if legacy_gelu:
        saved = json.loads((tmp_path / "config.json").read_text())
        saved.update(hidden_act="gelu", hidden_activation=None)
        (tmp_path / "config.json").write_text(json.dumps(saved))
    assert_matches_transformers(reference, tmp_path)


GEMMA_CAPS = dict(attn_logit_softcapping=5.0, final_logit_softcapping=5.0)  # see test_gemma2_matches_transformers


@pytest.mark.parametrize("variant,released_config", [
    (dict(), False), (dict(tie_word_embeddings=False, sliding_window=WINDOW, **GEMMA_CAPS), False),
    (dict(sliding_window=WINDOW, **GEMMA_CAPS), True)], ids=["tied", "untied-window-caps", "released-config"])
def test_gemma2_matches_transformers(variant, released_config, tokenizer, tmp_path):
    """Gemma 2: (1 + w) norms before and after each sublayer (every norm weight random: a kvflow
    without the post-norms, or the MLP's own pre-norm, differs at the first token), q.k scaled by
    query_pre_attn_scalar ** -0.5 (256, not head_dim 64), layers 0 and 2 windowed. Caps of 5 on the
    attention and output logits, as the released 50 and 30 barely touch logits this small: a
    kvflow without either differs. The released configs have no layer_types (every other layer
    windowed, from the first) and a hidden_act beside the hidden_activation transformers reads."""
    config = Gemma2Config(**SHAPE, head_dim=64, pad_token_id=None, **variant)
    assert config.layer_types == ["sliding_attention", "full_attention"] * 2
    reference = save_randomised(Gemma2ForCausalLM(config), tmp_path, tokenizer)
    if released_config:
        saved = json.loads((tmp_path / "config.json").read_text())
        del saved["layer_types"]
        saved["hidden_act"] = "gelu_pytorch_tanh"
        (tmp_path / "config.json").write_text(json.dumps(saved))
    assert_matches_transformers(reference, tmp_path)


GEMMA3_SHAPE = {**{k: v for k, v in SHAPE.items() if k != "rope_theta"}, "num_hidden_layers": 6}
GEMMA3_LINEAR_GLOBAL = dict(rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})


@pytest.mark.parametrize("variant,flat_config", [
    (dict(), False),
    (dict(tie_word_embeddings=False, sliding_window=WINDOW, final_logit_softcapping=5.0, **GEMMA3_LINEAR_GLOBAL), False),
    (dict(sliding_window=WINDOW, **GEMMA3_LINEAR_GLOBAL), True)],
    ids=["tied", "untied-window-linear-cap", "flat-config"])
def test_gemma3_matches_transformers(variant, flat_config, tokenizer, tmp_path):
    """Gemma 3 (text): Gemma 2's sandwich norms with a (1 + w) QK-norm over each head, windows on
    layers 0-4 of 6 (the released pattern), which rotate with base 1e4 while layer 5 rotates with
    1e6 (a kvflow with one rotation for all differs on the longer prompts), linear rope scaling
    (factor 8) on layer 5 only, and an output cap of 5. transformers 5 saves the bases and the
    scaling per layer type in rope_parameters; the flat config is how earlier ones saved them
    (rope_theta, rope_local_base_freq, rope_scaling, sliding_window_pattern)."""
    config = Gemma3TextConfig(**GEMMA3_SHAPE, head_dim=64, pad_token_id=None, **variant)
    assert config.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    reference = save_randomised(Gemma3ForCausalLM(config), tmp_path, tokenizer)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["architectures"] == ["Gemma3ForCausalLM"] and "full_attention" in saved["rope_parameters"]
    if flat_config:
        for key in ("rope_parameters", "layer_types", "_sliding_window_pattern"):
            saved.pop(key, None)
        saved.update(rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0},
                     sliding_window_pattern=6)
        (tmp_path / "config.json").write_text(json.dumps(saved))
    assert_matches_transformers(reference, tmp_path)


@pytest.mark.parametrize("variant", [dict(), dict(tie_word_embeddings=False), dict(no_rope_layer_interval=2)],
                         ids=["tied", "untied", "nope-every-2nd"])
def test_smollm3_matches_transformers(variant, tokenizer, tmp_path):
    """SmolLM3 rotates q and k only on the layers no_rope_layers marks 1 (the 4th of 4 by
    default, the 2nd and 4th with an interval of 2): a kvflow that rotated them all, or none,
    differs at the first token."""
    config = SmolLM3Config(**SHAPE, pad_token_id=None, **variant)
    assert 0 in config.no_rope_layers
    reference = save_randomised(SmolLM3ForCausalLM(config), tmp_path, tokenizer)
    assert_matches_transformers(reference, tmp_path)


@pytest.mark.parametrize("variant", [dict(), dict(tie_word_embeddings=True, attention_bias=True)],
                         ids=["untied", "tied-attention_bias"])
def test_olmo2_matches_transformers(variant, tokenizer, tmp_path):
    """OLMo 2: norms after attention and after the MLP, added into the residual stream that is
    itself each sublayer's input, and one RMS norm over all heads of q and of k together: a
    kvflow that normed each head, or before each sublayer, differs at the first token."""
    config = Olmo2Config(**SHAPE, pad_token_id=None, **variant)
    reference = save_randomised(Olmo2ForCausalLM(config), tmp_path, tokenizer)
    assert_matches_transformers(reference, tmp_path)


def phi3_longrope(seed: int) -> dict:
    """LongRoPE factors for 24 frequencies (a rotary_dim of 48), far enough from 1 that a table
    without them, or with the wrong set, differs."""
    rng = random.Random(seed)
    return {"rope_type": "longrope", "rope_theta": SHAPE["rope_theta"], "partial_rotary_factor": 0.75,
            "original_max_position_embeddings": 64,
            "short_factor": [1.0 + rng.random() for _ in range(24)],
            "long_factor": [1.0 + 7.0 * rng.random() for _ in range(24)]}


@pytest.mark.parametrize("variant", ["untied-window", "tied-partial-rotary", "longrope-short", "longrope-long",
                                     "head_dim_96"])
def test_phi3_matches_transformers(variant, tokenizer, tmp_path):
    """Phi-3's checkpoints store q|k|v and gate|up fused (qkv_proj, gate_up_proj). Phi-3-mini has
    a window on every layer; Phi-4-mini rotates 3/4 of each head (partial_rotary_factor) and ties
    its embeddings; Phi-3.5 and Phi-4-mini scale rope with LongRoPE, whose short factors hold
    while the context fits the original 64 tokens (max_model_len 64 here, prompts that fit it, as
    transformers does for sequences that short) and whose long ones hold for a longer context
    (transformers switches to them once a sequence passes 64 tokens: a 150-token prompt does from
    its first step)."""
    shape = {**SHAPE}
    max_model_len, lengths = 512, (5, 40, 150)
    if variant == "untied-window":
        shape.update(sliding_window=WINDOW)
    elif variant == "head_dim_96":  # Phi-3-mini's head size (3072 / 32)
        shape.update(hidden_size=192)
        assert shape["hidden_size"] // shape["num_attention_heads"] == 96
    elif variant == "tied-partial-rotary":
        shape.update(tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": shape["rope_theta"],
                                                                 "partial_rotary_factor": 0.75})
    else:
        shape.update(rope_parameters=phi3_longrope(0), original_max_position_embeddings=64)
        max_model_len, lengths = (64, (5, 36)) if variant == "longrope-short" else (512, (150,))
    del shape["rope_theta"]
    reference = save_randomised(Phi3ForCausalLM(Phi3Config(**shape, pad_token_id=None)), tmp_path, tokenizer)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["architectures"] == ["Phi3ForCausalLM"]
    names = {name for name, _ in reference.named_parameters()}
    assert "model.layers.0.self_attn.qkv_proj.weight" in names and "model.layers.0.mlp.gate_up_proj.weight" in names
    assert_matches_transformers(reference, tmp_path, max_model_len, lengths)


GRANITE_MULTIPLIERS = dict(embedding_multiplier=6.0, attention_multiplier=0.05, residual_multiplier=0.3,
                          logits_scaling=3.0)


@pytest.mark.parametrize("variant", [dict(), dict(tie_word_embeddings=False, attention_bias=True, mlp_bias=True)],
                         ids=["tied", "untied-biases"])
def test_granite_matches_transformers(variant, tokenizer, tmp_path):
    """Granite: embeddings times embedding_multiplier, q.k times attention_multiplier (not
    head_dim ** -0.5), each sublayer's output times residual_multiplier before the residual add,
    logits divided by logits_scaling; each set away from its neutral value, so a kvflow that
    ignored one differs at the first token."""
    config = GraniteConfig(**SHAPE, **GRANITE_MULTIPLIERS, **{"tie_word_embeddings": True, **variant})
    reference = save_randomised(GraniteForCausalLM(config), tmp_path, tokenizer)
    assert_matches_transformers(reference, tmp_path)


@pytest.mark.parametrize("variant", [dict(attention_bias=True), dict(mlp_bias=True), dict(hidden_act="gelu"),
                                     dict(hidden_act="gelu_pytorch_tanh"),
                                     dict(attention_bias=True, mlp_bias=True, hidden_act="gelu"),
                                     dict(hidden_size=160, head_dim=80)],
                         ids=["attention_bias", "mlp_bias", "gelu", "gelu_pytorch_tanh", "all", "head_dim_80"])
def test_llama_variants_match_transformers(variant, tokenizer, tmp_path):
    """attention_bias puts biases on q, k, v and o_proj; mlp_bias on gate, up and down; head_dim
    80 runs the attention kernels compiled for it."""
    reference = save_randomised(LlamaForCausalLM(LlamaConfig(**{**SHAPE, **variant})), tmp_path, tokenizer)
    assert reference.config.head_dim == variant.get("head_dim", 64)
    assert_matches_transformers(reference, tmp_path)


@pytest.mark.parametrize("window", [None, WINDOW], ids=["full", "window"])
def test_mistral_matches_transformers(window, tokenizer, tmp_path):
    reference = save_randomised(MistralForCausalLM(MistralConfig(**SHAPE, sliding_window=window)), tmp_path, tokenizer)
    assert_matches_transformers(reference, tmp_path)


_GGUF_LAYER_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                     "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                     "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                     "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm",
                     "self_attn.k_norm": "attn_k_norm", "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}


_GGUF_OLMO2_NORM_NAMES = {"post_attention_layernorm": "attn_post_norm",
                          "post_feedforward_layernorm": "ffn_post_norm"}


_GGUF_GEMMA_NORM_NAMES = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                          "post_feedforward_layernorm": "post_ffw_norm"}


def quantize_blocks(weight: np.ndarray, type_name: str) -> np.ndarray:
    """weight's blocks of a GGML type: by the gguf package, as llama-quantize would, or for the
    K-quants, which the package does not write, by tests/k_quants.py."""
    if type_name in K_TYPES:
        return quantize_k(weight, type_name)
    return gguf.quants.quantize(weight, gguf.GGMLQuantizationType[type_name])


def llama_cpp_permuted(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """q/k rows as llama.cpp's converter writes them for llama-like architectures: within each
    head, the two rotated halves interleaved."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def as_gguf(model, path: Path, arch: str = "qwen2", quantized: dict[str, str] | None = None,
            with_vocabulary: bool = False) -> Path:
    """The checkpoint as llama.cpp's converter writes a qwen2, qwen3, granite, gemma2 or gemma3
    GGUF: its metadata keys and tensor names, q/k rows in Hugging Face's order (llama.cpp permutes
    them for llama and granite, and so does this), Gemma's (1 + w) norms stored with the 1 added.
    quantized: Hugging Face name -> GGML type name of the tensors to store in that type's blocks
    (see quantize_blocks). with_vocabulary: SmolLM2's vocabulary (the tokenizer these checkpoints
    are saved with) in the file too, so that an engine can load it."""
    config = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    if with_vocabulary:
        vocabulary = gguf.GGUFReader(str(SMOLLM2_DIR / SMOLLM2_GGUF)).fields
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list(vocabulary["tokenizer.ggml.tokens"].contents())
        writer.add_token_types(vocabulary["tokenizer.ggml.token_type"].contents())
        writer.add_token_merges(vocabulary["tokenizer.ggml.merges"].contents())
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    rope = config.rope_parameters.get("full_attention", config.rope_parameters)  # Gemma 3: the global layers'
    if arch != "gemma":  # llama.cpp's Gemma converter writes no base: the default 10000
        writer.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    gemma = arch in ("gemma2", "gemma3")
    if gemma:
        assert config.query_pre_attn_scalar == head_dim  # llama.cpp derives the scale from head_dim
        writer.add_sliding_window(config.sliding_window)
        if config.attn_logit_softcapping is not None:
            writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        if config.final_logit_softcapping is not None:
            writer.add_final_logit_softcapping(config.final_logit_softcapping)
    writer.add_vocab_size(config.vocab_size)
    if arch == "phi3":  # as llama.cpp's Phi3MiniModel writes it
        rotary_dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))
        writer.add_rope_dimension_count(rotary_dim)
        writer.add_sliding_window(config.sliding_window or 0)
        original = rope.get("original_max_position_embeddings", config.max_position_embeddings)
        writer.add_rope_scaling_orig_ctx_len(original)
        if rope.get("rope_type") == "longrope":
            scale = config.max_position_embeddings / original
            writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
            writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
            writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    if arch == "granite":
        writer.add_attention_scale(config.attention_multiplier)
        writer.add_embedding_scale(config.embedding_multiplier)
        writer.add_residual_scale(config.residual_multiplier)
        writer.add_logit_scale(config.logits_scaling)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if name.startswith("model.layers."):
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            module, kind = rest.rsplit(".", 1)
            names = {**_GGUF_LAYER_NAMES, **_GGUF_GEMMA_NORM_NAMES} if gemma else _GGUF_LAYER_NAMES
            if arch == "olmo2":
                names = {**_GGUF_LAYER_NAMES, **_GGUF_OLMO2_NORM_NAMES}
            gguf_name = f"blk.{layer}.{names[module]}.{kind}"
            if arch in ("granite", "smollm3") and module in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = config.num_attention_heads if module == "self_attn.q_proj" else config.num_key_value_heads
                tensor = llama_cpp_permuted(tensor, heads)
        else:
            gguf_name = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                         "lm_head.weight": "output.weight"}[name]
        if (gemma or arch == "gemma") and name.endswith("norm.weight"):
            tensor = tensor + 1
        if quantized and name in quantized:
            ggml_type = gguf.GGMLQuantizationType[quantized[name]]
            writer.add_tensor(gguf_name, quantize_blocks(tensor.float().numpy(), quantized[name]), raw_dtype=ggml_type)
            continue
        writer.add_tensor(gguf_name, tensor.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("arch,tied", [("qwen2", True), ("qwen2", False), ("qwen3", True), ("qwen3", False),
                                       ("granite", True), ("gemma2", True), ("gemma3", True), ("phi3", True),
                                       ("phi3-longrope", False), ("gemma", True), ("olmo2", False), ("smollm3", True)],
                         ids=["qwen2-tied", "qwen2-untied", "qwen3-tied", "qwen3-untied", "granite-tied", "gemma2-tied",
                              "gemma3-tied", "phi3-window-partial-rotary", "phi3-longrope", "gemma-tied", "olmo2-untied",
                              "smollm3-tied"])
def test_gguf_matches_transformers(arch, tied, tokenizer, tmp_path):
    """The same random Qwen2 (biases and all), Qwen3 (QK-norm weights), Gemma 2 (caps, windows)
    or Gemma 3 (two rope bases, linear scaling on the global layers) written as llama.cpp's
    converter writes it and read by kvflow's GGUF loader: greedy tokens and every step's top-20
    logprobs as transformers gives them."""
    lengths = [5, 40, 150]
    if arch == "qwen2":
        reference = qwen2_checkpoint(tmp_path / "hf", tokenizer, tied, window=None)
    elif arch == "granite":
        config = GraniteConfig(**SHAPE, **GRANITE_MULTIPLIERS, tie_word_embeddings=tied)
        reference = save_randomised(GraniteForCausalLM(config), tmp_path / "hf", tokenizer)
    elif arch == "gemma2":  # llama.cpp fixes the window pattern and derives the scale from head_dim
        config = Gemma2Config(**SHAPE, head_dim=64, pad_token_id=None, query_pre_attn_scalar=64, sliding_window=WINDOW,
                              **GEMMA_CAPS)
        reference = save_randomised(Gemma2ForCausalLM(config), tmp_path / "hf", tokenizer)
    elif arch == "gemma3":  # and takes 1e4 as the windowed layers' rope base
        config = Gemma3TextConfig(**GEMMA3_SHAPE, head_dim=64, pad_token_id=None, query_pre_attn_scalar=64,
                                  sliding_window=WINDOW, final_logit_softcapping=5.0, **GEMMA3_LINEAR_GLOBAL)
        reference = save_randomised(Gemma3ForCausalLM(config), tmp_path / "hf", tokenizer)
    elif arch.startswith("phi3"):  # the long factors over a 512-token context: a prompt past the original 64
        shape = {key: value for key, value in SHAPE.items() if key != "rope_theta"}
        if arch == "phi3":
            shape.update(sliding_window=WINDOW, rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.75,
                                                                  "rope_theta": SHAPE["rope_theta"]})
        else:
            shape.update(rope_parameters=phi3_longrope(1), original_max_position_embeddings=64)
            lengths = [150]
        config = Phi3Config(**shape, tie_word_embeddings=tied, pad_token_id=None)
        reference = save_randomised(Phi3ForCausalLM(config), tmp_path / "hf", tokenizer)
        arch = "phi3"
    elif arch == "gemma":  # llama.cpp takes the default rope base (the file has none) and ties the embeddings
        config = GemmaConfig(**SHAPE, head_dim=64, pad_token_id=None)
        reference = save_randomised(GemmaForCausalLM(config), tmp_path / "hf", tokenizer)
    elif arch == "olmo2":
        config = Olmo2Config(**SHAPE, pad_token_id=None, tie_word_embeddings=tied)
        reference = save_randomised(Olmo2ForCausalLM(config), tmp_path / "hf", tokenizer)
    elif arch == "smollm3":  # llama.cpp fixes the rope-less layers at every 4th, SmolLM3's default
        config = SmolLM3Config(**SHAPE, pad_token_id=None, tie_word_embeddings=tied)
        assert config.no_rope_layers == [1, 1, 1, 0]
        reference = save_randomised(SmolLM3ForCausalLM(config), tmp_path / "hf", tokenizer)
    else:
        config = Qwen3Config(**SHAPE, head_dim=64, tie_word_embeddings=tied)
        reference = save_randomised(Qwen3ForCausalLM(config), tmp_path / "hf", tokenizer)
    reader = open_gguf(str(as_gguf(reference, tmp_path / f"{arch}.gguf", arch)))
    config = config_from_gguf(reader)
    expected = {"qwen2": ("Qwen2ForCausalLM", True), "qwen3": ("Qwen3ForCausalLM", False),
                "gemma2": ("Gemma2ForCausalLM", False), "gemma3": ("Gemma3ForCausalLM", False),
                "granite": ("GraniteForCausalLM", False), "phi3": ("Phi3ForCausalLM", False),
                "gemma": ("GemmaForCausalLM", False), "olmo2": ("Olmo2ForCausalLM", False),
                "smollm3": ("SmolLM3ForCausalLM", False)}[arch]
    assert (config.architecture, config.attention_bias, config.tie_word_embeddings) == (*expected, tied)
    graph = model_class(config.architecture)(config, torch.float32)
    graph.load_weights(gguf_weights(reader, config))
    runner = ModelRunner(graph.eval(), config, num_blocks=64)
    for seed, length in enumerate(lengths):
        ids = random_ids(length, seed)
        tokens, tops, margins = transformers_greedy(reference, ids, STEPS, TOP)
        for step, sampled in greedy_steps(runner, ids):
            if sampled.token_id != tokens[step]:
                assert margins[step] < NEAR_TIE, (length, step)
                break
            ours = dict(sampled.top_logprobs)
            assert len(ours) == TOP and abs(sampled.logprob - tops[step][tokens[step]]) < LOGPROB_ATOL
            for token, logprob in tops[step].items():
                if token in ours:  # else a tie at the 20th place swapped it out
                    assert abs(ours[token] - logprob) < LOGPROB_ATOL, (length, step, token)
                else:
                    assert logprob - min(tops[step].values()) < LOGPROB_ATOL, (length, step, token)


def greedy_steps(runner: ModelRunner, ids: list[int]):
    """(step, SampledToken) for STEPS greedy steps of the model alone: the prompt in one step, then
    one token a step, each with its top-TOP logprobs."""
    params = SamplingParams(temperature=0, max_tokens=STEPS, logprobs=TOP, ignore_eos=True)
    output, new_tokens, computed = [], list(ids), 0
    for step in range(STEPS):
        request = ScheduledRequest(new_tokens, computed, list(range(64)), params, prompt_token_ids=ids,
                                   output_token_ids=output)
        sampled = runner.execute([request])[0][0]
        yield step, sampled
        output.append(sampled.token_id)
        computed += len(new_tokens)
        new_tokens = output[-1:]


# kvflow's quantized products see their inputs as int8 per block of 32 (scale max|x| / 127, ties to
# even), and so does the reference below, through hooks on transformers' projections. What remains
# is float32 summation order, and the activation codes it flips where a value lies within rounding
# of a half step; a flip moves a product by a whole step, and the layers carry it on. Measured over
# these runs: the median difference of the top-20 logprobs 0.002-0.011, the largest 0.02-0.11 (it
# varies with the threads' split of the work). Without the hooks the int8 rounding alone gives a
# median of 0.018-0.027; a wrong row order or block gives whole units.
QUANTIZED_LOGPROB_MEDIAN = 0.02
QUANTIZED_LOGPROB_ATOL = 0.25
QUANTIZED_NEAR_TIE = 0.25


def int8_blocks(x: torch.Tensor) -> torch.Tensor:
    """x with each block of 32 values (along the last dimension) rounded to the int8 grid of its
    own max|x| / 127, ties to even: the activations kvflow's quantized products multiply."""
    blocks = x.float().reshape(*x.shape[:-1], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    codes = torch.where(amax > 0, torch.round(blocks * 127 / torch.where(amax > 0, amax, 1)), 0).clamp(-127, 127)
    return (codes * (amax / 127)).reshape(x.shape).to(x.dtype)


def quantization_plan(config, kind: str) -> dict[str, str]:
    """Hugging Face name -> GGML type for a file mixing the types kvflow keeps quantized.
    "legacy": Q4_0 attention inputs, Q8_0 outputs, Q4_1 MLP inputs, a Q4_0 embedding and a Q8_0
    LM head. "k_quants", as a Q4_K_M file mixes them: Q4_K, with Q6_K values, down projections
    and LM head, layer 0's MLP inputs in Q5_K, and layer 2's o_proj and down_proj in Q5_0 and Q5_1
    (the types llama-quantize falls back to). In both, layer 1's k_proj has a type of its own: a
    q|k|v of mixed types, as llama.cpp's mixed files have (k_quants: every layer's, v in Q6_K),
    keeps each part in its own type."""
    legacy = kind == "legacy"
    plan = {"model.embed_tokens.weight": "Q4_0" if legacy else "Q4_K", "lm_head.weight": "Q8_0" if legacy else "Q6_K"}
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}."
        inputs, outputs, mlp_inputs = ("Q4_0", "Q8_0", "Q4_1") if legacy else ("Q4_K", "Q6_K", "Q4_K")
        plan |= {prefix + "self_attn.q_proj.weight": inputs, prefix + "self_attn.k_proj.weight": inputs,
                 prefix + "self_attn.v_proj.weight": inputs if legacy else "Q6_K",
                 prefix + "self_attn.o_proj.weight": outputs if legacy else "Q4_K",
                 prefix + "mlp.gate_proj.weight": mlp_inputs, prefix + "mlp.up_proj.weight": mlp_inputs,
                 prefix + "mlp.down_proj.weight": outputs}
    plan["model.layers.1.self_attn.k_proj.weight"] = "Q8_0" if legacy else "Q5_K"
    if not legacy:
        plan |= {"model.layers.0.mlp.gate_proj.weight": "Q5_K", "model.layers.0.mlp.up_proj.weight": "Q5_K",
                 "model.layers.2.self_attn.o_proj.weight": "Q5_0", "model.layers.2.mlp.down_proj.weight": "Q5_1"}
    return plan


def held_types(plan: dict[str, str]) -> dict[str, int | tuple[int, ...]]:
    """kvflow module name -> the GGML type id it should hold for a plan; for a merged projection
    whose parts' types differ, the tuple of its parts' ids (each part holds its own)."""
    parts = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"), "mlp.gate_up_proj": ("gate_proj", "up_proj")}
    held = {"embed_tokens": plan["model.embed_tokens.weight"], "lm_head": plan["lm_head.weight"]}
    layers = {int(name.split(".")[2]) for name in plan if name.startswith("model.layers.")}
    for layer in layers:
        prefix = f"model.layers.{layer}."
        for module, names in parts.items():
            types = tuple(plan[prefix + module.split(".")[0] + "." + part + ".weight"] for part in names)
            held[f"layers.{layer}.{module}"] = types[0] if len(set(types)) == 1 else types
        for module in ("self_attn.o_proj", "mlp.down_proj"):
            held[f"layers.{layer}.{module}"] = plan[prefix + module + ".weight"]
    def type_id(type_name: str) -> int:
        return int(gguf.GGMLQuantizationType[type_name])

    return {name: tuple(map(type_id, type_name)) if isinstance(type_name, tuple) else type_id(type_name)
            for name, type_name in held.items()}


def held_type(module) -> int | tuple[int, ...] | None:
    """The GGML type id a kvflow module holds, or its parts' ids where each part holds its own."""
    parts = getattr(module, "quantized_parts", None)
    return module.ggml_type if parts is None else tuple(part.ggml_type for part in parts)


@pytest.mark.parametrize("arch,kind", [("qwen2", "legacy"), ("smollm3", "legacy"), ("qwen2", "k_quants")])
def test_quantized_gguf_matches_transformers_on_its_dequantized_weights(arch, kind, tokenizer, tmp_path):
    """A GGUF file with quantized projections (q/k/v biases in Qwen2; q/k rows permuted as
    llama.cpp stores them in SmolLM3), an untied quantized LM head and a quantized embedding, as
    quantization_plan mixes the types: kvflow keeps those blocks and runs them through its
    quantized ops; transformers runs the same blocks dequantized by the gguf package, each
    projection's input rounded to int8 blocks as kvflow's products round it. Greedy tokens agree
    wherever transformers' top two are not close, and every step's top-20 logprobs stay within
    QUANTIZED_LOGPROB_ATOL, their median within QUANTIZED_LOGPROB_MEDIAN."""
    from kvflow.loader.gguf_file import gguf_tensor_types

    shape = SHAPE if kind == "legacy" else SHAPE | dict(hidden_size=256, intermediate_size=512)  # whole 256-blocks
    if arch == "qwen2":
        config = Qwen2Config(**shape, tie_word_embeddings=False, use_sliding_window=False)
        reference = save_randomised(Qwen2ForCausalLM(config), tmp_path / "hf", tokenizer)
    else:
        config = SmolLM3Config(**shape, pad_token_id=None, tie_word_embeddings=False)
        reference = save_randomised(SmolLM3ForCausalLM(config), tmp_path / "hf", tokenizer)
    plan = quantization_plan(reference.config, kind)
    reader = open_gguf(str(as_gguf(reference, tmp_path / f"{arch}.gguf", arch, quantized=plan)))
    with torch.no_grad():  # transformers on the weights as the file stores them
        parameters = dict(reference.named_parameters())
        for name, type_name in plan.items():
            weight = parameters[name]
            blocks = quantize_blocks(weight.numpy(), type_name)
            weight.copy_(torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[type_name])))
    expected = held_types(plan)
    kept = {"model." + name if name != "lm_head" else name for name in expected}
    kept = {name.replace("qkv_proj", part) for name in kept for part in ("q_proj", "k_proj", "v_proj")}
    kept = {name.replace("gate_up_proj", part) for name in kept for part in ("gate_proj", "up_proj")}
    for name, module in reference.named_modules():  # and on the activations as kvflow's products see them
        if name in kept - {"model.embed_tokens"}:
            module.register_forward_pre_hook(lambda module, args: (int8_blocks(args[0]),))

    config = config_from_gguf(reader)
    graph = model_class(config.architecture)(config, torch.float32)
    raw = graph.hold_quantized_weights(gguf_tensor_types(reader))
    graph.load_weights(gguf_weights(reader, config, raw))
    modules = dict(graph.named_modules())
    assert {name: held_type(modules[name]) for name in expected} == expected
    prepare_cpu_weights(graph, prepack=False)  # as the loader leaves a CPU model: every quantized type interleaved
    assert {name: held_type(modules[name]) for name in expected} == {
        name: tuple(INTERLEAVED_TYPES[t] for t in held) if isinstance(held, tuple) else INTERLEAVED_TYPES[held]
        for name, held in expected.items()}

    runner = ModelRunner(graph.eval(), config, num_blocks=64)
    differences = []
    for seed, length in enumerate([5, 40, 150]):
        ids = random_ids(length, seed)
        tokens, tops, margins = transformers_greedy(reference, ids, STEPS, TOP)
        for step, sampled in greedy_steps(runner, ids):
            ours = dict(sampled.top_logprobs)
            for token, logprob in tops[step].items():
                if token in ours:
                    differences.append(abs(ours[token] - logprob))
                    assert differences[-1] < QUANTIZED_LOGPROB_ATOL, (length, step, token)
            if sampled.token_id != tokens[step]:
                assert margins[step] < QUANTIZED_NEAR_TIE, (length, step)
                break
    median = float(np.median(differences))
    print(f"{arch} {kind}: top-20 logprob differences: median {median:.4f}, largest {max(differences):.4f}")
    assert median < QUANTIZED_LOGPROB_MEDIAN
