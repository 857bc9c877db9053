"""The hot path of one-module drafters (EAGLE, EAGLE3, one-module MTP) on whole-batch arrays.

Owns two loops the runner's step runs once: the catch-up of a one-module chain (the module
writes the draft KV of every position made final; only each request's last output feeds the
drafts) and autoregressive drafting from a module's last outputs (one position further per
draft: its own output at p - 1 stands in for the unknown hidden at p). Both take a padded
block table (the runner's persistent one, or lists padded once) and build every forward's
`AttentionMetadata` with array ops, never a Python list per request. `Drafter` calls them for
its list-shaped inputs too, so there is one implementation of each.
"""

from __future__ import annotations

import numpy as np
import torch

from speckv.attention import AttentionMetadata, PagedKVCache
from speckv.drafters.draft_state import CatchUpBatch
from speckv.drafters.modules import DraftModule


def _metadata(query_lens: np.ndarray, seq_lens: np.ndarray, table: np.ndarray,
              lens: np.ndarray, block_size: int, device: torch.device) -> AttentionMetadata:
    """Metadata over `table`'s rows cut to their longest row (as `AttentionMetadata.build`
    pads a list of tables: the same tensors)."""
    width = max(1, int(lens.max())) if lens.shape[0] else 1
    return AttentionMetadata.from_block_table(query_lens, seq_lens, table[:, :width],
                                              block_size, device, lens)


def catch_up_one_module(module: DraftModule, h0: torch.Tensor, batch: CatchUpBatch,
                        kv_cache: PagedKVCache, device: torch.device, will_propose: bool
                        ) -> torch.Tensor | None:
    """Write the draft KV of every row of `batch` (h0: [total, hidden], its rows in order).
    Returns the module's output at each request's last row, [n, hidden] (None without
    `will_propose`: then the module only writes KV)."""
    block_size = kv_cache.block_size
    counts = batch.counts
    ends = np.cumsum(counts)  # one past each request's last row of h0
    total = int(ends[-1])
    seq_lens = batch.starts + counts
    # [total] position of every row: start + 0 .. count - 1 per request
    positions = np.repeat(batch.starts - (ends - counts), counts) + np.arange(total)
    ids, table, lens = batch.next_token_ids, batch.block_table, batch.block_table_lens

    def run(fn, rows, q_lens, s_lens, which):
        """`fn` over the rows `rows` of h0 (None: all) for the requests `which` (None: all)."""
        md = (_metadata(q_lens, s_lens, table, lens, block_size, device) if which is None
              else _metadata(q_lens, s_lens, table[which], lens[which], block_size, device))
        if rows is None:
            return fn(torch.from_numpy(ids).to(device), h0, torch.from_numpy(positions).to(device),
                      kv_cache, md)
        return fn(torch.from_numpy(ids[rows]).to(device),
                  h0.index_select(0, torch.from_numpy(rows).to(h0.device)),
                  torch.from_numpy(positions[rows]).to(device), kv_cache, md)

    if not will_propose:
        run(module.write_kv, None, counts, seq_lens, None)
        return None
    if int(counts.max()) > 1:
        # KV of every row but each request's last, then the last rows in full (their
        # attention reads the KV just written)
        head = np.flatnonzero(counts > 1)
        is_last = np.zeros(total, dtype=bool)
        is_last[ends - 1] = True
        run(module.write_kv, np.flatnonzero(~is_last), counts[head] - 1, seq_lens[head] - 1,
            head)
        return run(module, ends - 1, np.ones(len(counts), dtype=np.int64), seq_lens, None)
    return run(module, None, counts, seq_lens, None)  # one row per request


def draft_autoregressive(module: DraftModule, drafts: list[torch.Tensor],
                         h_last: torch.Tensor, last_positions: np.ndarray, num_drafts: int,
                         table: np.ndarray, lens: np.ndarray, kv_cache: PagedKVCache,
                         device: torch.device) -> torch.Tensor:
    """Extend `drafts` (each [n] int64; the last one drafted from `h_last` [n, hidden], the
    module's output at `last_positions` [n]) to `num_drafts` drafts: draft i + 1 runs the
    module on draft i at position last_positions + i, writing provisional KV there. Returns
    [n, num_drafts] int64."""
    n = h_last.shape[0]
    ones = np.ones(n, dtype=np.int64)
    for step in range(1, num_drafts - len(drafts) + 1):
        pos = last_positions + step
        md = _metadata(ones, pos + 1, table, lens, kv_cache.block_size, device)
        h_last = module(drafts[-1], h_last, torch.from_numpy(pos).to(device), kv_cache, md)
        drafts.append(module.draft_token_ids(h_last))
    return torch.stack(drafts, dim=1)
