"""nn.Modules built on kvflow's ops: the pieces a decoder model is assembled from."""

from kvflow.layers.activation import SiluAndMul
from kvflow.layers.attention import PagedAttention
from kvflow.layers.embedding import LMHead, VocabEmbedding
from kvflow.layers.linear import Linear, MergedLinear
from kvflow.layers.norm import RMSNorm
from kvflow.layers.rotary import RotaryEmbedding

__all__ = ["LMHead", "Linear", "MergedLinear", "PagedAttention", "RMSNorm", "RotaryEmbedding", "SiluAndMul",
           "VocabEmbedding"]
