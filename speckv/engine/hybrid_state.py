"""The runner's side of linear-attention (Gated DeltaNet) state: the paged state cache, each
forward's `StatePlan`, and committing verified speculative windows.

Owns, for a model with a Mamba / GDN state group (`MambaSpec` in its `KVCacheLayout`), the
state tensors per block id of that group (`PagedStateCache`, see its docstring for the layout)
and the rule that ties them to the scheduler's block tables:

    forward over [start, end) of a request, unit U = the Mamba group's block size:
      read   the state after `start` tokens      block (start - 1) // U   (start = 0: zeros)
      write  the state after each k * U in (start, end]  into block k - 1   (checkpoints)
             the state after `end`                into block (end - 1) // U (the running state)

Speculative decoding: drafts that are rejected must not advance the state. A request that
verifies drafts runs its window with the recurrent form and keeps the state after every
position (`StateSegment.record`); after sampling, only the state after the last ACCEPTED
position (and any checkpoint the accepted tokens crossed) is written to the blocks. Cost: per
linear layer and verified position, one [Hv, dk, dv] fp32 state and K - 1 conv inputs held
until the step ends (Qwen3-Next-80B: 32 x 128 x 128 x 4 B = 2 MiB per layer per position),
and no second forward; the alternative, recomputing from the last accepted state, costs a
forward over the accepted tokens every step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from speckv.attention.state_cache import PagedStateCache, StatePlan
from speckv.cache.specs import MambaSpec
from speckv.engine.messages import ScheduledRequest
from speckv.models.base import TargetModel
from speckv.models.common.kv_layout import KVCacheLayout


def state_group(layout: KVCacheLayout) -> int | None:
    """The index of the layout's Mamba / GDN state group (None: the model has none)."""
    for g, group in enumerate(layout.groups):
        if isinstance(group.spec, MambaSpec):
            return g
    return None


class RunnerStates:
    """The state cache of a hybrid model and its per-step plans (one per runner)."""

    def __init__(self, model: TargetModel, num_blocks: int, layout: KVCacheLayout) -> None:
        group = state_group(layout)
        if group is None:
            raise ValueError("the model's KV cache layout has no Mamba / GDN state group")
        self.group = group
        self.unit = layout.groups[group].spec.block_size
        self.model = model
        self.cache: PagedStateCache = model.make_state_cache(num_blocks)
        self.layers = list(range(self.cache.num_layers))
        self.conv_kernel = self.cache.conv.shape[-1] + 1

    def plan(self, scheduled: Sequence[ScheduledRequest],
             tables: Sequence[Sequence[int]]) -> StatePlan:
        """The linear layers' plan of one forward (requests in batch order; `tables` are the
        Mamba group's block tables)."""
        return self.model.plan_state(self.cache, [item.num_new_tokens for item in scheduled],
                                     [item.end for item in scheduled], tables, self.unit,
                                     [item.num_drafts > 0 for item in scheduled])

    def commit(self, plan: StatePlan, scheduled: Sequence[ScheduledRequest],
               tables: Sequence[Sequence[int]],
               sampled: Mapping[str, Sequence[int]]) -> None:
        """Write the verified part of every recorded window: the states after the checkpoints
        the accepted tokens crossed and after the last accepted position."""
        for index, item in enumerate(scheduled):
            segment = plan.segments[index]
            if not segment.record:
                continue
            tokens = sampled.get(item.request_id)
            num_accepted = (len(tokens) - 1) if tokens else 0
            end = item.end - item.num_drafts + num_accepted  # positions whose state is real
            table = tables[index]
            for boundary in range(item.start // self.unit * self.unit + self.unit, end,
                                  self.unit):
                plan.commit_recorded(self.layers, index, boundary - item.start,
                                     table[boundary // self.unit - 1], self.conv_kernel)
            plan.commit_recorded(self.layers, index, end - item.start,
                                 table[(end - 1) // self.unit], self.conv_kernel)
