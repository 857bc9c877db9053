"""Paged recurrent-state cache of linear-attention (Gated DeltaNet) layers, and the per-forward
plan saying which block each request's state is read from and written to.

Owns the memory layout of the Mamba group's blocks. A block id of that group holds ONE state
per linear layer: the state after the last token its request computed inside the block's
token range, i.e. for a full block (a checkpoint) the state after exactly (i + 1) * U tokens:

    Mamba group, block size U (the alignment unit), request of 1,367 tokens, U = 544:

    tokens     [0 ........ 544)[544 ...... 1088)[1088 ....... 1367)
    block ids        b0               b1                b2
    holds       state @ 544       state @ 1088      state @ 1367 (running; becomes the
                (checkpoint)      (checkpoint)      checkpoint @ 1632 once full)

    per linear layer l and block id b:
      conv[l, b]      [conv_dim, K - 1]     the last K - 1 conv inputs (q, k, v channels)
      recurrent[l, b] [Hv, dk, dv] fp32     the delta-rule state

    The state after s tokens is always in block (s - 1) // U of the request's table (the
    block of its last computed token); s = 0 reads zeros. A forward over [s, e) reads that
    block, writes the state after every multiple of U in (s, e] into the block that ends
    there, and the state after e into block (e - 1) // U. A prefix hit at h (a multiple of
    U) therefore restores exactly the state a cold run wrote at h.

Blocks are global ids of the shared block pool (like `PagedKVCache`): every id has a row here
and a row in the attention KV, whichever group holds it (simple, wastes the unused half;
unifying page sizes as vLLM does is future work).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from speckv.attention.kv_cache import resolve_dtype


class PagedStateCache:
    """Conv and recurrent states of `num_layers` linear layers, one row per block id."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        conv_dim: int,
        conv_kernel: int,
        num_heads: int,
        k_dim: int,
        v_dim: int,
        dtype: torch.dtype | str = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        for name, v in (("num_layers", num_layers), ("num_blocks", num_blocks),
                        ("conv_dim", conv_dim), ("num_heads", num_heads), ("k_dim", k_dim),
                        ("v_dim", v_dim)):
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if conv_kernel < 2:
            raise ValueError(f"conv_kernel must be >= 2, got {conv_kernel}")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.dtype = resolve_dtype(dtype)
        self.device = torch.device(device)
        # [layers, blocks, conv_dim, K - 1] in the model dtype (conv inputs are activations)
        self.conv = torch.zeros((num_layers, num_blocks, conv_dim, conv_kernel - 1),
                                dtype=self.dtype, device=self.device)
        # [layers, blocks, Hv, dk, dv] fp32 (the delta rule accumulates in fp32)
        self.recurrent = torch.zeros((num_layers, num_blocks, num_heads, k_dim, v_dim),
                                     dtype=torch.float32, device=self.device)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv, self.recurrent))

    @property
    def bytes_per_block(self) -> int:
        return self.nbytes // self.num_blocks

    def read(self, layer: int, block_id: int | None) -> tuple[torch.Tensor | None, ...]:
        """(conv [C, K-1], recurrent [Hv, dk, dv]) of a block; (None, None) for zeros."""
        if block_id is None:
            return None, None
        return self.conv[layer, block_id], self.recurrent[layer, block_id]

    def write(self, layer: int, block_id: int, conv: torch.Tensor,
              recurrent: torch.Tensor) -> None:
        self.conv[layer, block_id].copy_(conv)
        self.recurrent[layer, block_id].copy_(recurrent)

    def snapshot(self, block_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of every layer's state in one block: ([L, C, K-1], [L, Hv, dk, dv])."""
        return self.conv[:, block_id].clone(), self.recurrent[:, block_id].clone()


@dataclass(frozen=True)
class StateSegment:
    """One request's rows of a forward, as the linear layers see them.

    Rows [row_start, row_start + num_tokens) of the flat token axis; the state before them
    comes from `read_block` (None: zeros); `checkpoints` are (tokens consumed, block id):
    after that many of the rows, write the state into that block (ascending; the last one
    normally at num_tokens). With `record`, nothing is written: the state after every row is
    kept in `StatePlan.recorded` for the caller to commit (speculative verification).
    """

    row_start: int
    num_tokens: int
    read_block: int | None
    checkpoints: tuple[tuple[int, int], ...] = ()
    record: bool = False


@dataclass
class StatePlan:
    """The linear layers' side of one forward: the cache and one segment per request.

    `recorded[layer][i]` (segments with `record`) is (conv inputs padded [C, K-1+T],
    recurrent states after each token [T, Hv, dk, dv])."""

    cache: PagedStateCache
    segments: list[StateSegment]
    recorded: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = field(
        default_factory=dict)
    # Segments at most this long (and not split by a checkpoint) run the recurrent form; the
    # rest the chunked form. One rule for cold runs and hits keeps them bit-identical.
    recurrent_max_tokens: int = 1

    def order(self) -> list[int]:
        """Segment indices such that a request reading a block that another request writes
        in this forward (a same-step prefix hit on a just-cached checkpoint) comes after it."""
        writers = {block: i for i, seg in enumerate(self.segments)
                   for _, block in seg.checkpoints}
        done: set[int] = set()
        out: list[int] = []

        def visit(i: int, depth: int) -> None:
            if i in done:
                return
            seg = self.segments[i]
            writer = writers.get(seg.read_block) if seg.read_block is not None else None
            if writer is not None and writer != i and depth < len(self.segments):
                visit(writer, depth + 1)
            done.add(i)
            out.append(i)

        for i in range(len(self.segments)):
            visit(i, 0)
        return out

    def commit_recorded(self, layer_ids: list[int], index: int, num_tokens: int,
                        block_id: int, conv_kernel: int) -> None:
        """Write a recorded segment's state after `num_tokens` of its rows into `block_id`,
        for every linear layer (`layer_ids`: cache layer indices)."""
        if num_tokens < 1:
            raise ValueError("commit needs at least one token")
        for layer in layer_ids:
            padded, states = self.recorded[layer][index]
            self.cache.write(layer, block_id, padded[:, num_tokens: num_tokens + conv_kernel - 1],
                             states[num_tokens - 1])
