"""The AOT networks' embedding lookup, a strategy chosen once from the weights (``aot_embedding``): rows of a
float32 table (``TableEmbedding``), or, when the head is the embedding (tied) and its GGUF blocks are Q8_0, rows
dequantized from the head's packed weight as they are gathered (``PackedEmbedding``, vocab.cc): the same bits,
without a float32 copy of the table (Gemma 3's 262,144 x 640: 671 MB of the process's memory)."""
from __future__ import annotations

from mindspore import Parameter, nn

from backends.mindspore.network.common import aot_param
from backends.mindspore.modeldir.quant import QuantWeight, embedding_in_head


class TableEmbedding(nn.Cell):
    """(ids, pos) -> (x [N, C], cos [N, D], sin [N, D]) from a float32 table ``[V, C]``."""

    def __init__(self, table: Parameter, aot) -> None:
        super().__init__()
        self.embed, self.aot = table, aot

    def construct(self, ids, pos, cos_t, sin_t):
        return self.aot.embed_rope(ids, pos, self.embed, cos_t, sin_t)


class PackedEmbedding(nn.Cell):
    """``TableEmbedding`` reading the tied head's packed Q8_0 weight ``[1, C/32 * 34, V]`` (the network's own
    ``lm_head`` Parameter, shared as ``AotLMHead`` shares it)."""

    def __init__(self, head: Parameter, aot) -> None:
        super().__init__()
        self.head, self.aot = head, aot

    def construct(self, ids, pos, cos_t, sin_t):
        return self.aot.embed_rope_packed(ids, pos, self.head, cos_t, sin_t)


def aot_embedding(spec, w: dict, head: Parameter, aot) -> nn.Cell:
    """The lookup of ``w``'s embedding: from ``head`` (the packed LM head) if the two are one Q8_0 matrix."""
    table = w["model.embed_tokens.weight"]
    if isinstance(table, QuantWeight) and embedding_in_head(spec.tie_word_embeddings, table.fmt):
        return PackedEmbedding(head, aot)
    return TableEmbedding(aot_param(table, "embed"), aot)
