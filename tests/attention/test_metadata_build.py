"""AttentionMetadata from host lists or from one padded block-table array: the array path
(many requests) gives exactly the tensors of the per-token list path (a few requests)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from speckv.attention.metadata import AttentionMetadata


def _batch(num_reqs: int, seed: int, block_size: int = 4):
    rng = random.Random(seed)
    query_lens, seq_lens, tables = [], [], []
    for _ in range(num_reqs):
        s = rng.randrange(1, 40)
        q = rng.randrange(0, s + 1)
        n = -(-s // block_size) + rng.randrange(0, 3)  # some tables hold spare blocks
        query_lens.append(q)
        seq_lens.append(s)
        tables.append([rng.randrange(1, 500) for _ in range(n)])
    return query_lens, seq_lens, tables


def _same(a: AttentionMetadata, b: AttentionMetadata) -> None:
    for name in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and torch.equal(x, y), name
    assert torch.equal(a.positions(), b.positions())
    assert a.query_lens_host == b.query_lens_host and a.seq_lens_host == b.seq_lens_host


@pytest.mark.parametrize("num_reqs", [1, 3, 9, 40, 200])
@pytest.mark.parametrize("seed", [0, 1])
def test_array_paths_equal_the_list_path(num_reqs: int, seed: int) -> None:
    query_lens, seq_lens, tables = _batch(num_reqs, seed)
    lens = [len(t) for t in tables]
    width = max(1, max(lens))
    reference = AttentionMetadata._from_lists(query_lens, seq_lens, tables, lens, width, 4,
                                              "cpu")
    _same(AttentionMetadata.build(query_lens, seq_lens, tables, 4), reference)
    padded = np.zeros((num_reqs, width + 2), dtype=np.int32)  # wider than needed: cut below
    for row, table in zip(padded, tables):
        row[: len(table)] = table
    _same(AttentionMetadata.from_block_table(query_lens, seq_lens, padded[:, :width], 4,
                                             "cpu", lens), reference)


@pytest.mark.parametrize("num_reqs", [2, 20])
def test_bad_lengths_are_refused_on_both_paths(num_reqs: int) -> None:
    query_lens, seq_lens, tables = _batch(num_reqs, 3)
    seq_lens[-1] = 4 * len(tables[-1]) + 1
    query_lens[-1] = 1
    with pytest.raises(ValueError, match="too short"):
        AttentionMetadata.build(query_lens, seq_lens, tables, 4)
    query_lens[-1] = seq_lens[-1] + 1
    with pytest.raises(ValueError, match="query_lens must be in"):
        AttentionMetadata.build(query_lens, seq_lens, tables, 4)


@pytest.mark.parametrize("num_reqs", [2, 40])  # the list path and the array path
def test_short_tables_are_padded_with_the_null_block(num_reqs):
    from speckv.cache import NULL_BLOCK_ID

    query_lens, seq_lens, tables = _batch(num_reqs, seed=7)
    tables[0] = tables[0][:1]  # one short table: the rest of its row is padding
    seq_lens[0] = query_lens[0] = min(seq_lens[0], 4)
    md = AttentionMetadata.build(query_lens, seq_lens, tables, 4)
    assert md.block_tables.shape[1] > 1
    assert (md.block_tables[0, 1:] == NULL_BLOCK_ID).all()
