"""The AOT networks' embedding lookup is chosen once from the weights: the tied head's packed Q8_0 blocks when the
embedding is that head (no float32 table: the rows' bits are vocab.cc's test's), else a float32 table."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from backends.mindspore.network.embedding import PackedEmbedding, TableEmbedding, aot_embedding
from backends.mindspore.modeldir.quant import quantize


@pytest.mark.parametrize("tied, fmt, want", [(True, "q8_0", PackedEmbedding), (False, "q8_0", TableEmbedding),
                                             (True, None, TableEmbedding)])
def test_the_lookup_reads_the_head_only_when_it_is_the_tied_q8_0_embedding(tied, fmt, want):
    from mindspore import Parameter, Tensor

    table = np.random.default_rng(0).standard_normal((48, 64)).astype(np.float32)
    w = {"model.embed_tokens.weight": quantize(table, fmt) if fmt else table}
    head = Parameter(Tensor(np.zeros((1, 68, 48), np.uint8)), name="lm_head", requires_grad=False)
    embedding = aot_embedding(SimpleNamespace(tie_word_embeddings=tied), w, head, aot=None)
    assert type(embedding) is want
    if want is PackedEmbedding:
        assert embedding.head is head
    else:
        np.testing.assert_array_equal(embedding.embed.asnumpy(), table if fmt is None else
                                      w["model.embed_tokens.weight"].dequantize())
