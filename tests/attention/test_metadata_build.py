"""AttentionMetadata from host lists or from one padded block-table array: the one array path
gives, at every batch size, exactly the tensors of the layout's definition written token by
token in this test."""

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


def _reference(query_lens: list[int], seq_lens: list[int], tables: list[list[int]],
               width: int, block_size: int) -> AttentionMetadata:
    """The layout token by token: request r's new tokens at s - q .. s - 1, each written to
    its block's slot; tables padded with the null block (0)."""
    positions = [p for q, s in zip(query_lens, seq_lens) for p in range(s - q, s)]
    slots = [table[p // block_size] * block_size + p % block_size
             for q, s, table in zip(query_lens, seq_lens, tables) for p in range(s - q, s)]
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    md = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                  dtype=torch.int32).view(-1, width),
        slot_mapping=torch.tensor(slots, dtype=torch.int64), block_size=block_size)
    md._positions = torch.tensor(positions, dtype=torch.int64)
    return md


@pytest.mark.parametrize("num_reqs", [1, 3, 9, 40, 200])
@pytest.mark.parametrize("seed", [0, 1])
def test_array_path_equals_the_layout_token_by_token(num_reqs: int, seed: int) -> None:
    query_lens, seq_lens, tables = _batch(num_reqs, seed)
    lens = [len(t) for t in tables]
    width = max(1, max(lens))
    reference = _reference(query_lens, seq_lens, tables, width, 4)
    _same(AttentionMetadata.build(query_lens, seq_lens, tables, 4), reference)
    padded = np.zeros((num_reqs, width + 2), dtype=np.int32)  # wider than needed: cut below
    for row, table in zip(padded, tables):
        row[: len(table)] = table
    _same(AttentionMetadata.from_block_table(query_lens, seq_lens, padded[:, :width], 4,
                                             "cpu", lens), reference)


@pytest.mark.parametrize("num_reqs", [2, 20])
def test_bad_lengths_are_refused(num_reqs: int) -> None:
    query_lens, seq_lens, tables = _batch(num_reqs, 3)
    seq_lens[-1] = 4 * len(tables[-1]) + 1
    query_lens[-1] = 1
    with pytest.raises(ValueError, match="too short"):
        AttentionMetadata.build(query_lens, seq_lens, tables, 4)
    query_lens[-1] = seq_lens[-1] + 1
    with pytest.raises(ValueError, match="query_lens must be in"):
        AttentionMetadata.build(query_lens, seq_lens, tables, 4)


@pytest.mark.parametrize("num_reqs", [2, 40])
def test_short_tables_are_padded_with_the_null_block(num_reqs):
    from speckv.cache import NULL_BLOCK_ID

    query_lens, seq_lens, tables = _batch(num_reqs, seed=7)
    tables[0] = tables[0][:1]  # one short table: the rest of its row is padding
    seq_lens[0] = query_lens[0] = min(seq_lens[0], 4)
    md = AttentionMetadata.build(query_lens, seq_lens, tables, 4)
    assert md.block_tables.shape[1] > 1
    assert (md.block_tables[0, 1:] == NULL_BLOCK_ID).all()
