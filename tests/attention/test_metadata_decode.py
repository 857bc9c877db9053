"""One new token per request (decode, the drafter's draft steps): the array path's shortcut for
that shape gives exactly the tensors of the layout written token by token."""

from __future__ import annotations

import numpy as np
import pytest

from speckv.attention.metadata import AttentionMetadata
from tests.attention.test_metadata_build import _batch, _reference, _same


@pytest.mark.parametrize("num_reqs", [1, 2, 9, 64, 257])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decode_shaped_batches_equal_the_layout(num_reqs: int, seed: int) -> None:
    _, seq_lens, tables = _batch(num_reqs, seed)
    query_lens = [1] * num_reqs
    lens = [len(t) for t in tables]
    width = max(lens)
    reference = _reference(query_lens, seq_lens, tables, width, 4)
    padded = np.zeros((num_reqs, width), dtype=np.int32)
    for row, table in zip(padded, tables):
        row[: len(table)] = table
    _same(AttentionMetadata.from_block_table(np.ones(num_reqs, dtype=np.int64),
                                             np.asarray(seq_lens), padded, 4, "cpu", lens),
          reference)
    _same(AttentionMetadata.build(query_lens, seq_lens, tables, 4), reference)
