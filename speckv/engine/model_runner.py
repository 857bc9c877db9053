"""ModelRunner: turns one SchedulerOutput into one batched forward over the paged KV cache.

Owns the model, its `PagedKVCache` and the batch layout: every scheduled request contributes
its new tokens (real tokens, then drafts) at positions `[start, end)`, flattened on one token
axis with no padding; `AttentionMetadata` is built fresh each step from the requests' block
tables (group 0 of the KV cache manager). Logits are computed only at the rows that sample:
for a request whose step reaches its last real token, the rows from that token to the end
(1 bonus row + one row per draft).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from speckv.attention import AttentionMetadata, PagedKVCache
from speckv.cache.kv_cache_manager import KVCacheManager
from speckv.engine.scheduler import SchedulerOutput
from speckv.models.llama import LlamaForCausalLM, ModelOutput


@dataclass(frozen=True)
class RunnerOutput:
    """One forward's results, addressed by batch index of `SchedulerOutput.scheduled`."""

    model_output: ModelOutput  # hidden states, each [num_tokens, hidden]
    token_offsets: list[int]  # batch index -> first row of that request in the token axis
    logits: torch.Tensor  # [num_sample_rows, vocab] fp32, on the model's device
    logit_offsets: dict[int, tuple[int, int]]  # batch index -> [start, end) rows in `logits`
    block_tables: list[list[int]]  # batch index -> physical block ids (group 0)
    slot_mapping: torch.Tensor  # [num_tokens] int64 physical slot of every computed token


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        manager: KVCacheManager,
        num_blocks: int,
        block_size: int,
        aux_layers: tuple[int, ...] = (),
    ) -> None:
        self.model = model
        self.manager = manager
        self.block_size = block_size
        self.device = model.device
        self.kv_cache: PagedKVCache = model.make_kv_cache(num_blocks, block_size)
        self.aux_layers = aux_layers

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        input_ids: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        block_tables: list[list[int]] = []
        token_offsets: list[int] = []
        sample_rows: list[int] = []
        logit_offsets: dict[int, tuple[int, int]] = {}
        for index, item in enumerate(scheduler_output.scheduled):
            request = item.request
            token_offsets.append(len(input_ids))
            tokens = request.all_token_ids[item.start : item.end]
            tokens += request.spec_token_ids[: item.end - item.start - len(tokens)]
            assert len(tokens) == item.num_new_tokens, "scheduled tokens do not exist"
            if item.samples:
                first = token_offsets[-1] + (request.num_tokens - 1 - item.start)
                rows = range(first, token_offsets[-1] + item.num_new_tokens)
                logit_offsets[index] = (len(sample_rows), len(sample_rows) + len(rows))
                sample_rows.extend(rows)
            input_ids.extend(tokens)
            query_lens.append(item.num_new_tokens)
            seq_lens.append(item.end)
            block_tables.append(self.manager.get_block_ids(request.request_id)[0])
        metadata = AttentionMetadata.build(
            query_lens, seq_lens, block_tables, self.block_size, self.device
        )
        ids = torch.tensor(input_ids, dtype=torch.int64, device=self.device)  # [num_tokens]
        output = self.model(ids, metadata.positions(), self.kv_cache, metadata, self.aux_layers)
        rows = torch.tensor(sample_rows, dtype=torch.int64, device=self.device)
        logits = self.model.compute_logits(output.hidden_states.index_select(0, rows))
        return RunnerOutput(
            output, token_offsets, logits, logit_offsets, block_tables, metadata.slot_mapping
        )
