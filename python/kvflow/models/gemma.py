"""Gemma (the first generation): the Llama graph with its embeddings scaled by sqrt(hidden_size)
(rounded to the model's dtype, as Gemma computes it), RMS norms that multiply by (1 + weight), a
GELU-tanh MLP (from the config's hidden_act) and the LM head tied to the embeddings."""

from kvflow.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class GemmaDecoderLayer(LlamaDecoderLayer):
    norm_weight_offset = 1.0


class GemmaForCausalLM(LlamaForCausalLM):
    layer_class = GemmaDecoderLayer
    scales_embedding = True
