"""nn.Modules built on kvflow's ops: the pieces a decoder model is assembled from.

The modules a decode step calls per layer set `__call__ = forward`: nn.Module.__call__ spends about
a microsecond per call on hook bookkeeping, and a batch-1 decode step of a 30-layer model makes
some 400 such calls, several percent of a step that is otherwise bound by reading the weights.
Hooks registered on these modules therefore do not run."""

from kvflow.layers.activation import GatedActivation, SiluAndMul
from kvflow.layers.attention import PagedAttention
from kvflow.layers.embedding import LMHead, VocabEmbedding
from kvflow.layers.linear import GateUpLinear, Linear, MergedLinear
from kvflow.layers.norm import RMSNorm
from kvflow.layers.rotary import RotaryEmbedding

__all__ = ["GateUpLinear", "LMHead", "Linear", "MergedLinear", "PagedAttention", "RMSNorm", "RotaryEmbedding", "GatedActivation", "SiluAndMul",
           "VocabEmbedding"]
