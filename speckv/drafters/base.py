"""The uniform drafter interface (EAGLE, EAGLE3, k-module MTP) and its shared catch-up logic.

Owns the contract between the engine's `Proposer` adapter and every drafter that keeps a *draft
KV* in the same paged blocks as the target: what a catch-up pass writes, at which positions, from
which tokens, and how proposals are drafted from the last real position.

A drafter is a chain of `k` modules (EAGLE / EAGLE3: k = 1; MTP: k modules). Module `j` at
position `p` reads the token `t[p + j]` and the hidden state `h_{j-1}[p]` (h_0 = the target's
hidden state at `p`), writes ITS draft KV at `p` and outputs `h_j[p]`, whose logits predict
`t[p + j + 1]`. So the draft KV at `p` depends on tokens up to `p + L` with `L = k`
(`draft_kv_lookahead_tokens`): the reason block hashes carry `L` lookahead tokens.

Positions in one decode step (n = real tokens now known, t[n-1] just sampled; k = 3 shown)::

    position p:          n-4     n-3     n-2   | n-1     n      n+1
    real tokens:  ... t[n-4]  t[n-3]  t[n-2]   | t[n-1]                (t[n-1] sampled last)
    target hidden h_0:   ok      ok      ok    |  -   (target has not run on t[n-1] yet)
    catch-up (write_draft_kv) writes, for every position whose inputs are now all real:
      module 1 (t[p+1]): .. n-4     n-3     n-2      <- up to n-2; its h_1[n-2] -> draft 1
      module 2 (t[p+2]): .. n-4     n-3               <- up to n-3 (reaches back 1 position)
      module j (t[p+j]): up to n-1-j                   (reaches back j-1 positions)
    propose (provisional KV, overwritten by the next catch-up, never hashed):
      module 2 at n-2 (token t[n] = draft 1)                 -> draft 2
      module 3 at n-3, n-2 (tokens draft 1, draft 2)         -> draft 3
      draft d > k: module k again, one position further each time (EAGLE-style: its own
      output at p-1 stands in for the unknown hidden at p)   -> drafts k+1 .. S

In one catch-up pass a request whose real-token count grows from n_old to n_new has module j
write positions [n_old - j, n_new - 1 - j] (clipped below at the pass's first position on a
fresh request or after a prefix hit). Positions [n_old - j, n_old - 2] need `h_{j-1}` from the
previous pass: the per-request `DraftCarry` holds them; the engine stores it with the request and
hands it back (None after a prefix hit or preemption: every position below the hit already has
all modules' KV, because the hit block's hash covered its `L` lookahead tokens).

Engine contract (block tables and slots):
- Pass, per request, the SAME block table as the target's (physical block ids, block 0 = null).
  Every drafter forward builds its own `AttentionMetadata.build(query_lens, seq_lens,
  block_tables, block_size)` from it (modules write different position ranges).
- Catch-up writes positions < n - 1; propose writes provisional KV at positions up to
  `n - 2 + max(0, S - k)`, inside the `num_draft_slots = S` slots the cache manager
  allocates for the target's verification (positions n-1 .. n-1+S).
- Order: run `write_draft_kv` for a step BEFORE publishing the block hashes that the
  step's new real tokens complete.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from speckv.attention import AttentionMetadata, PagedKVCache
from speckv.attention.metadata import pad_block_tables
from speckv.cache.drafter_policy import DrafterPolicy
from speckv.drafters.draft_state import (
    BatchDraftState,
    CatchUpBatch,
    CatchUpRequest,
    DraftCarry,
    DraftState,
    TargetStates,
    _ModuleRows,
)
from speckv.drafters.one_module import catch_up_one_module, draft_autoregressive

if TYPE_CHECKING:
    from speckv.speculation.proposer import Proposer


class Drafter(nn.Module, ABC):
    """A chain of `k` draft modules sharing the target's embeddings (see module docstring)."""

    modules_chain: nn.ModuleList  # k DraftModule
    num_kv_heads: int
    head_dim: int

    # ---- what the engine reads ------------------------------------------------------------

    @property
    @abstractmethod
    def policy(self) -> DrafterPolicy:
        """The drafter's entry in the policy table (name, modules): decides the hash mode."""

    @property
    def draft_kv_lookahead_tokens(self) -> int:
        """L: the draft KV at p depends on tokens up to p + L (1 for EAGLE/EAGLE3, k for MTP)."""
        return self.policy.draft_kv_lookahead_tokens

    @property
    def speculative_method(self) -> str:
        """The `--speculative-method` word that runs this drafter (its policy's name)."""
        return self.policy.name

    def make_proposer(self, num_spec_tokens: int, num_blocks: int, block_size: int,
                      clock: Callable[[], float]) -> Proposer:
        """The engine's proposer over this drafter: its own paged KV of `num_blocks` blocks
        (the target's block ids), timed with `clock`."""
        from speckv.drafters.proposer import DrafterProposer

        return DrafterProposer(self, num_spec_tokens, num_blocks, block_size, clock)

    @property
    def num_kv_layers(self) -> int:
        """Layers of the drafter's own PagedKVCache (one per module)."""
        return len(self.modules_chain)

    @property
    def target_aux_layers(self) -> tuple[int, ...]:
        """Target decoder layers whose outputs `TargetStates.aux_hidden_states` must carry."""
        return ()

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def make_kv_cache(
        self,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype | str | None = None,
        device: torch.device | str | None = None,
    ) -> PagedKVCache:
        """The draft KV: same num_blocks / block_size as the target's, its own layers."""
        return PagedKVCache(
            num_layers=self.num_kv_layers,
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=dtype or self.dtype,
            device=device or self.device,
        )

    @abstractmethod
    def first_hidden(self, target_states: TargetStates) -> torch.Tensor:
        """h_0 from the target: [num_tokens, hidden] in the drafter's dtype (EAGLE3 fuses its
        aux layers here)."""

    # ---- catch-up ----------------------------------------------------------------------------

    @torch.inference_mode()
    def write_draft_kv(
        self,
        target_states: TargetStates,
        requests: Sequence[CatchUpRequest],
        kv_cache: PagedKVCache,
        will_propose: bool = True,
    ) -> DraftState:
        """Write the draft KV of every position whose inputs just became real (all modules).

        The last module's outputs feed nobody but `propose` (and only module 1's, when it is
        the last): with `will_propose=False` no module computes outputs it would throw away
        (the returned state then cannot propose)."""
        total = sum(r.num_positions for r in requests)
        if target_states.hidden_states.shape[0] != total:
            raise ValueError(
                f"target_states has {target_states.hidden_states.shape[0]} rows, requests "
                f"declare {total}"
            )
        for r in requests:
            if r.num_positions < 1 or len(r.next_token_ids) < r.num_positions:
                raise ValueError(
                    "each request needs >= 1 position and a known next token for each "
                    f"(got {r.num_positions} positions, {len(r.next_token_ids)} tokens)"
                )
        k = len(self.modules_chain)
        h0 = self.first_hidden(target_states)  # [total, hidden]
        if k == 1 and requests:
            return self._catch_up_one_module(h0, requests, kv_cache, will_propose)
        offs = [0]
        for r in requests:
            offs.append(offs[-1] + r.num_positions)
        # avail[r]: this module's hidden inputs for request r (module 1: the target's rows).
        avail = [
            _ModuleRows(r.start_position, h0[offs[i] : offs[i + 1]]) for i, r in enumerate(requests)
        ]
        tokens = [list(r.next_token_ids) for r in requests]
        starts = [r.start_position for r in requests]
        tables = [r.block_table for r in requests]
        carries = [DraftCarry([], [], r.start_position + r.num_positions) for r in requests]
        last_h1: list[torch.Tensor] = []
        for j in range(1, k + 1):
            if j > 1:
                avail = [_merge(_carried(r.carry, j), out) for r, out in zip(requests, avail)]
            kv_only = j == k and (k > 1 or not will_propose)
            # a lone module feeds only `propose`, which reads its output at the last position
            outs, written = self._run_module(j, avail, tokens, starts, tables, kv_cache,
                                             kv_only=kv_only, last_only=k == 1)
            if j == 1 and not kv_only:
                # Module 1 writes every position (a next token is known for each), so its
                # last output is at start_position + num_positions - 1.
                last_h1 = [o[-1] for o in outs]  # type: ignore[index]
            if j > 1:
                # h_{j-1} rows module j could not write yet stay pending for the next pass.
                for c, a, w in zip(carries, avail, written):
                    c.start.append(a.start + w)
                    c.pending.append(a.rows[w:])
            # What module j+1 may consume: module j's outputs.
            avail = [
                _ModuleRows(a.start, o if o is not None else a.rows[:0])
                for a, o in zip(avail, outs)
            ]
        # Module k's outputs feed nobody during catch-up; propose starts from the carries.
        return DraftState(
            carries=carries,
            num_real_tokens=[r.start_position + 1 + len(r.next_token_ids) for r in requests],
            block_tables=[list(r.block_table) for r in requests],
            _last_h1=last_h1,
        )

    def _catch_up_one_module(
        self,
        h0: torch.Tensor,
        requests: Sequence[CatchUpRequest],
        kv_cache: PagedKVCache,
        will_propose: bool,
    ) -> DraftState:
        """`write_draft_kv` for a one-module chain (EAGLE, EAGLE3, one-module MTP), batched:
        the module writes every catch-up position (a next token is known for each), nothing
        is carried, and only each request's last output feeds `propose`. The same forwards
        on the same rows as the general path (`_run_module` with `last_only`), built from
        whole-batch index arrays (`one_module.catch_up_one_module`)."""
        seq_lens = [r.start_position + r.num_positions for r in requests]
        state = DraftState(
            carries=[DraftCarry([], [], end) for end in seq_lens],
            num_real_tokens=[r.start_position + 1 + len(r.next_token_ids) for r in requests],
            block_tables=[list(r.block_table) for r in requests],
        )
        out = catch_up_one_module(self.modules_chain[0], h0, CatchUpBatch.from_requests(requests),
                                  kv_cache, self.device, will_propose)
        if out is not None:
            state._last_h1 = list(out.unbind(0))  # [hidden] per request
        return state

    @torch.inference_mode()
    def write_draft_kv_batch(self, target_states: TargetStates, batch: CatchUpBatch,
                             kv_cache: PagedKVCache, will_propose: bool = True
                             ) -> BatchDraftState | None:
        """`write_draft_kv` of a one-module chain from whole-batch arrays (the runner's
        step); its state feeds `propose` like a `DraftState` (None with
        `will_propose=False`)."""
        if len(self.modules_chain) != 1:
            raise ValueError("write_draft_kv_batch is for one-module chains; this drafter has "
                             f"{len(self.modules_chain)} modules (use write_draft_kv)")
        total = int(batch.counts.sum())
        if target_states.hidden_states.shape[0] != total:
            raise ValueError(
                f"target_states has {target_states.hidden_states.shape[0]} rows, requests "
                f"declare {total}"
            )
        if batch.counts.shape[0] and int(batch.counts.min()) < 1:
            raise ValueError("each request needs >= 1 position")
        h0 = self.first_hidden(target_states)  # [total, hidden]
        out = catch_up_one_module(self.modules_chain[0], h0, batch, kv_cache, self.device,
                                  will_propose)
        if out is None:
            return None
        # the catch-up ends at each request's last real token: n = starts + counts + 1
        return BatchDraftState(out, batch.starts + batch.counts + 1, batch.block_table,
                               batch.block_table_lens)

    def _run_module(
        self,
        j: int,
        avail: list[_ModuleRows],
        tokens: list[list[int]],
        token_starts: list[int],
        block_tables: Sequence[Sequence[int]],
        kv_cache: PagedKVCache,
        max_position: list[int] | None = None,
        kv_only: bool = False,
        last_only: bool = False,
    ) -> tuple[list[torch.Tensor | None], list[int]]:
        """Run module j on every position it can write: p with t[p + j] in `tokens`.

        tokens[i] are t[token_starts[i] + 1 ...]. Returns per request the outputs [w, hidden]
        (None when w = 0, or always with `kv_only`: the module only writes its KV; with
        `last_only` only the last row's, [1, hidden]: the other rows only write their KV,
        which spares the attention and MLP of a prefill's rows) and w, the number of rows
        written from the front of avail[i].

        The drafter's per-step hot path: one batched forward over the catch-up and proposal
        rows of every request (gathered by `_module_rows`).
        """
        module = self.modules_chain[j - 1]
        ids, rows, positions, q_lens, s_lens, tables, counts = _module_rows(
            j, avail, tokens, token_starts, block_tables, max_position)
        if not q_lens:
            return [None] * len(avail), counts
        device = self.device
        block_size = kv_cache.block_size

        def inputs(ids, rows, positions, q_lens, s_lens, tables):
            md = AttentionMetadata.build(q_lens, s_lens, tables, block_size, device)
            return (
                torch.tensor(ids, dtype=torch.int64, device=device),
                torch.cat(rows),  # already in the drafter's dtype (first_hidden / outputs)
                torch.tensor(positions, dtype=torch.int64, device=device),
                kv_cache,
                md,
            )

        if kv_only:
            module.write_kv(*inputs(ids, rows, positions, q_lens, s_lens, tables))
            return [None] * len(avail), counts
        if last_only and max(q_lens) > 1:
            # KV of every row but each request's last, then the last rows in full (their
            # attention reads the KV just written)
            ends = list(itertools.accumulate(q_lens))
            head = [i for i, q in enumerate(q_lens) if q > 1]
            module.write_kv(*inputs(
                [t for i in head for t in ids[ends[i] - q_lens[i] : ends[i] - 1]],
                [rows[i][:-1] for i in head],
                [p for i in head for p in positions[ends[i] - q_lens[i] : ends[i] - 1]],
                [q_lens[i] - 1 for i in head], [s_lens[i] - 1 for i in head],
                [tables[i] for i in head]))
            out = module(*inputs([ids[e - 1] for e in ends], [r[-1:] for r in rows],
                                 [positions[e - 1] for e in ends], [1] * len(q_lens), s_lens,
                                 tables))  # [num requests written, hidden]
            last = iter(out.split(1))
            return [next(last) if w else None for w in counts], counts
        out = module(*inputs(ids, rows, positions, q_lens, s_lens, tables))  # [sum(w), hidden]
        res: list[torch.Tensor | None] = []
        o = 0
        for w in counts:
            res.append(out[o : o + w] if w else None)
            o += w
        return res, counts

    # ---- proposals ---------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(
        self,
        state: DraftState | BatchDraftState,
        num_spec_tokens: int,
        kv_cache: PagedKVCache,
    ) -> torch.Tensor:
        """Greedy drafts [num_reqs, num_spec_tokens] int64 from each request's last position.

        Writes provisional draft KV (module k at n-1 .. n-2+S-k when S > k and, for MTP module
        j >= 2, n-j .. n-2); the next catch-up overwrites every provisional position before any
        block that contains it is hashed. Does not change `state`.
        """
        if num_spec_tokens < 1:
            raise ValueError(f"num_spec_tokens must be >= 1, got {num_spec_tokens}")
        k = len(self.modules_chain)
        if isinstance(state, BatchDraftState):
            # a one-module chain's arrays: module 1 again, one position further per draft
            module = self.modules_chain[0]
            return draft_autoregressive(
                module, [module.draft_token_ids(state.last_hidden)], state.last_hidden,
                state.num_real_tokens - 2, num_spec_tokens, state.block_table,
                state.block_table_lens, kv_cache, self.device)
        n = state.num_real_tokens
        nreq = len(n)
        if len(state._last_h1) != nreq and nreq:
            raise ValueError("this state was caught up with will_propose=False")
        if len(state._last_h1) != nreq or any(
            c.next_position != x - 1 for c, x in zip(state.carries, n)
        ):
            raise ValueError(
                "propose needs the catch-up to end at the last real token of every request "
                "(pass exactly num_positions next tokens)"
            )
        device = self.device
        h_last = torch.stack(state._last_h1)  # [nreq, hidden]: module 1's output at n - 2
        drafts = [self.modules_chain[0].draft_token_ids(h_last)]  # each [nreq]
        last_real = [x - 2 for x in n]  # modules 2..k draft from their output here
        tok_starts = [x - 1 for x in n]  # the drafts are t[n], t[n+1], ...
        prev_out: list[torch.Tensor | None] = [None] * nreq  # module d-1's provisional outputs
        prev_start = last_real
        for d in range(2, min(num_spec_tokens, k) + 1):
            tok_lists = torch.stack(drafts, dim=1).tolist()  # [nreq][d - 1]
            avail = []
            for i in range(nreq):
                c = state.carries[i]
                a = _ModuleRows(c.start[d - 2], c.pending[d - 2])
                extra = prev_out[i]
                if extra is not None:
                    a = _merge(a, _ModuleRows(prev_start[i], extra))
                avail.append(a)
            outs, written = self._run_module(
                d, avail, tok_lists, tok_starts, state.block_tables, kv_cache, last_real
            )
            for i, w in enumerate(written):
                if w == 0 or outs[i] is None or avail[i].start + w - 1 != n[i] - 2:
                    raise RuntimeError(f"module {d} could not reach position n-2 for request {i}")
            prev_out = outs
            prev_start = [a.start for a in avail]
            h_last = torch.stack([o[-1] for o in outs if o is not None])
            drafts.append(self.modules_chain[d - 1].draft_token_ids(h_last))
        # Beyond k modules: module k autoregressively, one position further per draft, fed the
        # previous draft straight from the device (no host round trip).
        if len(drafts) == num_spec_tokens:
            return torch.stack(drafts, dim=1)  # [num_reqs, num_spec_tokens]
        table, lens = pad_block_tables(state.block_tables)
        return draft_autoregressive(self.modules_chain[k - 1], drafts, h_last,
                                    np.asarray(last_real, dtype=np.int64) + (len(drafts) - k),
                                    num_spec_tokens, table, lens, kv_cache, device)


def _module_rows(j: int, avail: list[_ModuleRows], tokens: list[list[int]],
                 token_starts: list[int], block_tables: Sequence[Sequence[int]],
                 max_position: list[int] | None
                 ) -> tuple[list[int], list[torch.Tensor], list[int], list[int], list[int],
                            list[Sequence[int]], list[int]]:
    """Module j's batch: per request the rows it can write (p with t[p + j] known), as the
    token ids, input rows, positions, query and sequence lengths and block tables of the
    requests that write any, and the count w of every request (0: none)."""
    ids: list[int] = []
    rows: list[torch.Tensor] = []
    positions: list[int] = []
    q_lens: list[int] = []
    s_lens: list[int] = []
    tables: list[Sequence[int]] = []
    counts: list[int] = []
    for i, a in enumerate(avail):
        last_tok_pos = token_starts[i] + len(tokens[i])  # position of the last known token
        end = min(a.start + a.rows.shape[0], last_tok_pos - j + 1)  # exclusive
        if max_position is not None:
            end = min(end, max_position[i] + 1)
        w = max(0, end - a.start)
        counts.append(w)
        if w == 0:
            continue
        off = token_starts[i] + 1
        ids.extend(tokens[i][a.start + j - off : a.start + j - off + w])
        rows.append(a.rows[:w])
        positions.extend(range(a.start, a.start + w))
        q_lens.append(w)
        s_lens.append(a.start + w)
        tables.append(block_tables[i])
    return ids, rows, positions, q_lens, s_lens, tables, counts


def _carried(carry: DraftCarry | None, j: int) -> _ModuleRows | None:
    if carry is None or len(carry.pending) < j - 1:
        return None
    return _ModuleRows(carry.start[j - 2], carry.pending[j - 2])


def _merge(a: _ModuleRows | None, b: _ModuleRows) -> _ModuleRows:
    """Rows of a then b; they must cover consecutive positions (a may be None or empty)."""
    if a is None or a.rows.shape[0] == 0:
        return b
    if b.rows.shape[0] == 0:
        return a
    if a.start + a.rows.shape[0] != b.start:
        raise ValueError(
            f"hidden rows not contiguous: pending ends at {a.start + a.rows.shape[0]}, new rows "
            f"start at {b.start} (pass carries back in order, one pass per step)"
        )
    return _ModuleRows(a.start, torch.cat([a.rows, b.rows]))
