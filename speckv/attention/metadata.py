"""AttentionMetadata: the per-forward description of which KV each new token reads and writes.

Owns the batch layout contract between the engine and the attention backends. A batch is many
requests flattened on the token axis; request r contributes `num_new[r]` new tokens at the END of
its context, i.e. positions `seq_lens[r] - num_new[r] .. seq_lens[r] - 1`, causal among
themselves. That one shape covers chunked prefill, decode and verification of draft tokens.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


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

    def __post_init__(self) -> None:
        if self.query_lens_host is None:
            qsl = self.query_start_loc.tolist()
            self.query_lens_host = tuple(b - a for a, b in itertools.pairwise(qsl))
        if self.seq_lens_host is None:
            self.seq_lens_host = tuple(int(x) for x in self.seq_lens.tolist())
        if len(self.query_lens_host) != len(self.seq_lens_host):
            raise ValueError("query_start_loc and seq_lens disagree on num_reqs")
        for q, s in zip(self.query_lens_host, self.seq_lens_host):
            if q < 0 or q > s:
                raise ValueError(f"seq_lens must be >= new tokens per request (got {q} > {s})")

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
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        positions: list[int] = []
        slots: list[int] = []
        for q, s, bt in zip(query_lens, seq_lens, block_tables):
            if q < 0 or q > s:
                raise ValueError(f"query_lens must be in [0, seq_len], got {q} for seq_len {s}")
            if len(bt) * block_size < s:
                raise ValueError(f"block table of {len(bt)} blocks too short for seq_len {s}")
            new_positions = range(s - q, s)
            positions.extend(new_positions)
            slots.extend(bt[pos // block_size] * block_size + pos % block_size
                         for pos in new_positions)
        width = max(1, max((len(bt) for bt in block_tables), default=0))
        table = [[*bt, *[0] * (width - len(bt))] for bt in block_tables]  # 0-padded (null)
        md = cls(
            query_start_loc=torch.tensor(
                [0, *itertools.accumulate(query_lens)], dtype=torch.int32, device=device
            ),
            seq_lens=torch.tensor(list(seq_lens), dtype=torch.int32, device=device),
            block_tables=torch.tensor(table, dtype=torch.int32, device=device).view(-1, width),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            block_size=block_size,
            query_lens_host=tuple(int(q) for q in query_lens),
            seq_lens_host=tuple(int(s) for s in seq_lens),
        )
        md._positions = torch.tensor(positions, dtype=torch.int64, device=device)
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
