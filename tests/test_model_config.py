"""What a Hugging Face config.json that kvflow cannot run gets: an error naming the architecture
or the field, before any weight is read, never a model that runs and answers wrongly."""

import json

import pytest
import torch

from kvflow.loader import load_model
from kvflow.models.config import ModelConfig

LLAMA = {"architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 128, "intermediate_size": 256,
         "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
         "max_position_embeddings": 256, "hidden_act": "silu"}


def load_config(tmp_path, config: dict):
    (tmp_path / "config.json").write_text(json.dumps(config))
    return load_model(str(tmp_path))


@pytest.mark.parametrize("architecture", ["GPT2LMHeadModel", "OPTForCausalLM", "FalconForCausalLM",
                                          "BloomForCausalLM", "DeepseekV3ForCausalLM"])
def test_an_unsupported_architecture_is_named_before_its_fields(tmp_path, architecture):
    # GPT-2's config has none of Llama's fields: the architecture is what the user must hear about.
    config = {"architectures": [architecture], "vocab_size": 256, "n_embd": 64, "n_layer": 2, "n_head": 2}
    with pytest.raises(ValueError, match=f"unsupported model architecture '{architecture}'"):
        load_config(tmp_path, config)


@pytest.mark.parametrize("field,value,message", [
    ("hidden_act", "relu", "hidden_act 'relu' is not supported"),
    ("hidden_act", "quick_gelu", "hidden_act 'quick_gelu' is not supported"),
    ("rope_scaling", {"rope_type": "mrope", "mrope_section": [16, 8, 8]}, "unsupported rope_scaling type 'mrope'"),
    ("rope_scaling", {"rope_type": "yarn"}, "yarn rope scaling needs a 'factor'"),
    ("no_rope_layers", [1, 1, 0], "no_rope_layers has 3 entries for 2 layers"),
    ("use_bidirectional_attention", True, "use_bidirectional_attention is not supported"),
    ("head_dim", 72, r"head_dim 72 is not supported \(supported: \(64, 80, 96, 128, 256\)\)"),
    ("quantization_config", {"quant_method": "gptq", "bits": 4, "group_size": 128},
     r"quantization_config \(quant_method 'gptq'\) is not supported"),
    ("quantization_config", {"quant_method": "fp8", "weight_block_size": [128, 128]},
     r"quantization_config \(quant_method 'fp8'\) is not supported"),
])
def test_a_field_that_changes_the_math_is_refused_by_name(tmp_path, field, value, message):
    with pytest.raises(ValueError, match=message):
        load_config(tmp_path, {**LLAMA, field: value})


GEMMA3 = {**LLAMA, "architectures": ["Gemma3ForCausalLM"], "head_dim": 64, "hidden_activation": "gelu_pytorch_tanh"}


@pytest.mark.parametrize("field,value,message", [
    ("attn_logit_softcapping", 50.0, "attn_logit_softcapping .* is not supported for Gemma 3"),
    ("rope_parameters", {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
     "rope scaling on the sliding-window layers"),
    ("layer_types", ["chunked_attention", "full_attention"], "layer_types .* are not supported"),
    ("hidden_activation", "relu", "hidden_act 'relu' is not supported"),
])
def test_a_gemma3_field_that_changes_the_math_is_refused_by_name(tmp_path, field, value, message):
    """Gemma 3 dropped Gemma 2's attention logit cap for QK-norm, and transformers does not apply
    one to Gemma 3; its windowed layers take no rope scaling; Gemma 2 and 3 read hidden_activation."""
    with pytest.raises(ValueError, match=message):
        load_config(tmp_path, {**GEMMA3, field: value})


@pytest.mark.parametrize("hidden_size,head_dim", [(192, 96), (160, 80)])
def test_head_dims_80_and_96_load(hidden_size, head_dim):
    # Phi-3 / Phi-4-mini (96) and others (80) derive head_dim from hidden_size / num_attention_heads.
    assert ModelConfig.from_hf({**LLAMA, "hidden_size": hidden_size}).head_dim == head_dim


def test_gemma3_rotations_from_either_config_layout():
    """transformers 5 writes each layer type's rope in rope_parameters; earlier configs wrote
    rope_theta, rope_local_base_freq and rope_scaling (the full-attention layers' only)."""
    linear = {"rope_type": "linear", "factor": 8.0}
    nested = ModelConfig.from_hf({**GEMMA3, "rope_parameters": {
        "full_attention": {**linear, "rope_theta": 1e6}, "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}})
    flat = ModelConfig.from_hf({**GEMMA3, "rope_theta": 1e6, "rope_local_base_freq": 1e4, "rope_scaling": linear,
                                "sliding_window_pattern": 2})
    for config in (nested, flat):
        assert (config.rope_theta, config.local_rope_theta, config.rope_scaling) == (1e6, 1e4, linear)
        assert config.attention_scale == 256 ** -0.5  # query_pre_attn_scalar's default, not head_dim's
    assert [nested.uses_local_rope(i) for i in range(2)] == [True, True]  # pattern 6 over 2 layers
    assert [flat.uses_local_rope(i) for i in range(2)] == [True, False]


@pytest.mark.parametrize("scaling,context,original", [
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}, 512, 128),
    ({"rope_type": "yarn", "factor": 4.0}, 1024, 256),
    ({"type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 64}, 512, 256),
])
def test_yarn_and_dynamic_ntk_serve_the_scaled_context(scaling, context, original):
    """As vLLM sizes it: the context is the original one times factor (YaRN's original context
    is its own field, max_position_embeddings when absent; dynamic NTK's is always
    max_position_embeddings, as transformers reads it)."""
    config = ModelConfig.from_hf({**LLAMA, "rope_scaling": scaling})
    assert config.max_position_embeddings == context
    assert config.rope_scaling["original_max_position_embeddings"] == original


PHI3 = {**LLAMA, "architectures": ["Phi3ForCausalLM"], "max_position_embeddings": 4096,
        "original_max_position_embeddings": 256, "partial_rotary_factor": 0.75,
        "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 24, "long_factor": [4.0] * 24}}


def test_phi3_partial_rotary_and_longrope_fields():
    """partial_rotary_factor rotates the leading 3/4 of each head; LongRoPE takes its original
    context from the config and its factor from the released context over it (transformers' rule)."""
    config = ModelConfig.from_hf(PHI3)
    assert config.rotary_dim == 48
    assert config.rope_scaling["original_max_position_embeddings"] == 256
    assert config.rope_scaling["factor"] == 16.0
    assert config.max_position_embeddings == 4096
    with pytest.raises(ValueError, match="rotary_dim 66 must be even and within head_dim 64"):
        ModelConfig.from_hf({**PHI3, "partial_rotary_factor": 1.04, "rope_scaling": None})


def test_the_engine_context_sizes_the_rope_table_and_picks_longrope_factors():
    """A context that fits the original one rotates with the short factors, a longer one with the
    long factors at every position (llama.cpp's rule)."""
    config = ModelConfig.from_hf(PHI3)
    assert config.with_context(None) is config and config.with_context(8192) is config
    short, long = config.with_context(256), config.with_context(1024)
    assert (short.max_position_embeddings, long.max_position_embeddings) == (256, 1024)
    from kvflow.models.llama import LlamaForCausalLM

    short_table = LlamaForCausalLM(short, torch.float32).layers[0].self_attn.rotary.cos_sin_cache
    long_table = LlamaForCausalLM(long, torch.float32).layers[0].self_attn.rotary.cos_sin_cache
    assert short_table.shape == (256, 48) and long_table.shape == (1024, 48)
    angle = lambda table: torch.atan2(table[1, 24:], table[1, :24])  # noqa: E731 (position 1's angles)
    torch.testing.assert_close(angle(short_table) / angle(long_table), torch.full((24,), 4.0), rtol=1e-5, atol=0)
    with pytest.raises(ValueError, match="max_model_len must be positive"):
        config.with_context(0)
