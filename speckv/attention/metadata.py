"""AttentionMetadata: the per-forward description of which KV each new token reads and writes.

Owns the batch layout contract between the engine and the attention backends. A batch is many
requests flattened on the token axis; request r contributes `num_new[r]` new tokens at the END of
its context, i.e. positions `seq_lens[r] - num_new[r] .. seq_lens[r] - 1`, causal among
themselves. That one shape covers chunked prefill, decode and verification of draft tokens.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence
from dataclasses import InitVar, dataclass, field
from typing import Any

import numpy as np
import torch

# Tables are padded with the null block's id, 0 (`speckv.cache.NULL_BLOCK_ID`, named there:
# attention sits beside the cache and reads block ids as plain ints, it imports nothing of it).
_PAD_BLOCK_ID = 0


def pad_block_tables(block_tables: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """(table [n, width] int64 padded with the null block, blocks per row [n] int64); width
    is the longest table's length (at least 1)."""
    lens = np.fromiter(map(len, block_tables), np.int64, len(block_tables))
    width = max(1, int(lens.max())) if lens.shape[0] else 1
    table = np.full((len(block_tables), width), _PAD_BLOCK_ID, dtype=np.int64)
    if lens.shape[0]:
        flat = np.fromiter(itertools.chain.from_iterable(block_tables), dtype=np.int64,
                           count=int(lens.sum()))
        rows = np.repeat(np.arange(lens.shape[0]), lens)
        cols = np.arange(flat.shape[0]) - np.repeat(np.cumsum(lens) - lens, lens)
        table[rows, cols] = flat
    return table, lens


@dataclass
class AttentionMetadata:
    """Tensors for one batched forward (all on the model's device)."""

    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, cumulative new-token counts
    seq_lens: torch.Tensor  # [num_reqs] int32, context length per request INCLUDING new tokens
    block_tables: torch.Tensor  # [num_reqs, max_blocks_per_req] int32 physical block ids (0=null)
    slot_mapping: torch.Tensor  # [num_tokens] int64, block_id * block_size + offset to write
    block_size: int
    # Host copies so backends can plan without a device sync; filled from tensors if None.
    query_lens_host: tuple[int, ...] | None = None
    seq_lens_host: tuple[int, ...] | None = None
    # Backend-private cache of per-forward plans (masks, gather indices), shared by all layers.
    plans: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)
    # positions() of a `build`-made metadata, computed alongside the slot mapping.
    _positions: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)
    # True: the maker has checked the host lengths already (`from_block_table`, with arrays)
    host_checked: InitVar[bool] = False

    def __post_init__(self, host_checked: bool) -> None:
        if self.query_lens_host is None:
            qsl = self.query_start_loc.tolist()
            self.query_lens_host = tuple(b - a for a, b in itertools.pairwise(qsl))
        if self.seq_lens_host is None:
            self.seq_lens_host = tuple(int(x) for x in self.seq_lens.tolist())
        query_lens, seq_lens = self.query_lens_host, self.seq_lens_host
        if len(query_lens) != len(seq_lens):
            raise ValueError("query_start_loc and seq_lens disagree on num_reqs")
        # the whole batch checked in C (built once per forward, for every request)
        if query_lens and not host_checked and (
                min(query_lens) < 0 or not all(map(operator.le, query_lens, seq_lens))):
            for q, s in zip(query_lens, seq_lens):
                if q < 0 or q > s:
                    raise ValueError(f"seq_lens must be >= new tokens per request (got {q} > "
                                     f"{s})")

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_host or ())

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens_host or ())

    @classmethod
    def build(
        cls,
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Build from host lists; computes slot_mapping for the new tokens from block tables."""
        if not (len(query_lens) == len(seq_lens) == len(block_tables)):
            raise ValueError(
                "query_lens, seq_lens and block_tables must have one entry per request"
            )
        table, lens = pad_block_tables(block_tables)
        return cls.from_block_table(query_lens, seq_lens, table, block_size, device, lens)

    @classmethod
    def from_block_table(
        cls,
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        block_table: np.ndarray,  # [num_reqs, width] int, 0-padded (null)
        block_size: int,
        device: torch.device | str = "cpu",
        table_lens: Sequence[int] | np.ndarray | None = None,  # blocks per row (None: width)
    ) -> AttentionMetadata:
        """`build` from a block table already laid out as one padded host array (the
        runner's persistent table): slots and positions computed with array ops. One path
        for every batch size: the list-built twin it replaced (up to 8 requests) was 7 us
        faster at 1 request and slower at 2-8 (decode, this 2-core AMD EPYC), against a
        30-70 ms forward: not worth a second path."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        num_reqs = len(query_lens)
        if len(seq_lens) != num_reqs or block_table.shape[0] != num_reqs:
            raise ValueError(
                "query_lens, seq_lens and block_tables must have one entry per request"
            )
        q = np.asarray(query_lens, dtype=np.int64).reshape(num_reqs)
        s = np.asarray(seq_lens, dtype=np.int64).reshape(num_reqs)
        if num_reqs and (int(q.min()) < 0 or bool((q > s).any())):
            bad = (q < 0) | (q > s)
            r = int(np.argmax(bad))
            raise ValueError(f"query_lens must be in [0, seq_len], got {int(q[r])} for seq_len "
                             f"{int(s[r])}")
        lens = (np.full(num_reqs, block_table.shape[1], dtype=np.int64) if table_lens is None
                else np.asarray(table_lens, dtype=np.int64).reshape(num_reqs))
        short = lens * block_size < s
        if short.any():
            r = int(np.argmax(short))
            raise ValueError(f"block table of {int(lens[r])} blocks too short for seq_len "
                             f"{int(s[r])}")
        width = block_table.shape[1]
        num_tokens = int(q.sum())
        if num_reqs and num_tokens == num_reqs and int(q.min()) == 1:
            # one new token per request (decode): token r is request r's, at s[r] - 1
            req = np.arange(num_reqs)
            positions = s - 1
            query_start_loc = np.arange(num_reqs + 1, dtype=np.int32)
        else:
            # request r's new tokens sit at positions s[r] - q[r] .. s[r] - 1
            req = np.repeat(np.arange(num_reqs), q)  # [num_tokens] request of each token
            starts = np.cumsum(q) - q  # [num_reqs] first token of each request
            positions = (s - q)[req] + (np.arange(num_tokens) - starts[req])
            query_start_loc = np.zeros(num_reqs + 1, dtype=np.int32)
            np.cumsum(q, out=query_start_loc[1:])
        slots = (block_table[req, positions // block_size].astype(np.int64) * block_size
                 + positions % block_size)
        md = cls(
            query_start_loc=torch.from_numpy(query_start_loc).to(device),
            seq_lens=torch.from_numpy(s.astype(np.int32)).to(device),
            block_tables=torch.from_numpy(
                np.ascontiguousarray(block_table, dtype=np.int32)).to(device).view(-1, width),
            slot_mapping=torch.from_numpy(slots).to(device),
            block_size=block_size,
            query_lens_host=tuple(q.tolist()),
            seq_lens_host=tuple(s.tolist()),
            host_checked=True,
        )
        md._positions = torch.from_numpy(positions).to(device)
        return md

    def positions(self) -> torch.Tensor:
        """The absolute position of every new token. [num_tokens] int64"""
        if self._positions is None:
            assert self.query_lens_host is not None and self.seq_lens_host is not None
            self._positions = torch.tensor(
                [p for q, s in zip(self.query_lens_host, self.seq_lens_host)
                 for p in range(s - q, s)],
                dtype=torch.int64,
                device=self.seq_lens.device,
            )
        return self._positions
