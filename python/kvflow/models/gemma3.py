"""Gemma 3 (text): the Gemma 2 layer with QK-norm in place of the attention logit cap (an RMS norm
over each head of q and k before rope, (1 + weight) like every Gemma norm), and two rotations:
the windowed layers (five in six in the released models) rotate with rope_local_base_freq and no
scaling, the full-attention ones with rope_theta and the config's rope scaling. The config
carries the bases, the windows and the optional output logit cap, and the Llama graph applies
them."""

from kvflow.models.gemma2 import Gemma2DecoderLayer, Gemma2ForCausalLM
from kvflow.models.qwen3 import Qwen3Attention


class Gemma3Attention(Qwen3Attention):
    qk_norm_weight_offset = 1.0


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    attention_class = Gemma3Attention


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    layer_class = Gemma3DecoderLayer
