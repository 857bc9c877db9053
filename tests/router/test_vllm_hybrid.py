"""The router on hybrid vLLM engines, predicted from the KV cache groups their events name
(`group_idx`, `kv_cache_spec_kind`, `kv_cache_spec_sliding_window`, the group's block size).

Without vLLM: vLLM-format events built here, with the hits vLLM's HybridKVCacheCoordinator
serves worked out by hand from its rule; the groups the router refuses. With vLLM's venv
(`SPECKV_VLLM_VENV`): vLLM's own KVCacheManager (no model needed) serves a random workload
under block pressure on several layouts, and the router's prediction equals vLLM's hit on every
request (`vllm_kv_manager_events.py` runs in the venv)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from msgspec.structs import replace

from speckv.events.schema import BlockRemoved, KVEventBatch, decode_batch
from speckv.router.contract import ContractError
from speckv.router.fleet import EngineLink, EngineSpec, Fleet
from speckv.router.tokenizer import TokenizerCache
from speckv.router.vllm_engine import VLLMFlags, check_events, vllm_contract
from tests import patience
from tests.router.test_vllm_contract import EVENTS, MODELS, URL, metrics, root_event

BLOCK = 16
FLAGS = VLLMFlags(EVENTS, "0")
VENV = os.environ.get("SPECKV_VLLM_VENV")


def hybrid_fleet(hash_unit: int = BLOCK, flags: VLLMFlags = FLAGS) -> tuple[Fleet, EngineLink]:
    text = metrics(block_size=str(hash_unit)).replace('hash_block_size="None"',
                                                      f'hash_block_size="{hash_unit}"')
    contract = vllm_contract("v", URL, text, MODELS, flags)
    link = EngineLink(EngineSpec("v", URL, vllm=flags), contract)
    return Fleet([link], TokenizerCache("builtin")), link


def stored(tokens: list[int], group: int, kind: str, window: int | None = None,
           block_size: int = BLOCK) -> KVEventBatch:
    """The BlockStored vLLM publishes for a prompt's whole blocks in one group: hashed every
    16 tokens, a block named by the last hash in it."""
    event = root_event(tokens, "0", block_size=BLOCK).events[0]
    stride = block_size // BLOCK
    num_blocks = len(event.block_hashes) // stride
    return KVEventBatch(0.0, [replace(
        event, block_hashes=event.block_hashes[stride - 1::stride][:num_blocks],
        token_ids=event.token_ids[:num_blocks * block_size], block_size=block_size,
        group_idx=group, kv_cache_spec_kind=kind, kv_cache_spec_sliding_window=window)])


def removed(batch: KVEventBatch, group: int, *blocks: int) -> KVEventBatch:
    hashes = batch.events[0].block_hashes
    return KVEventBatch(0.0, [BlockRemoved(block_hashes=[hashes[i] for i in blocks],
                                           medium="GPU", group_idx=group)])


PROMPT = list(range(2000, 2000 + 6 * BLOCK + 5))  # 6 whole blocks; N - 1 = 100 -> at most 96


def hit(fleet: Fleet, prompt: list[int] = PROMPT) -> int:
    return fleet.plan(prompt, ["v"])["v"].published_cached_tokens


def test_a_sliding_window_group_serves_the_window_before_the_hit():
    """Full attention + a window of 40 (vLLM needs cdiv(40 - 1, 16) = 3 blocks before a hit,
    fewer near the start); hits aligned to 16."""
    fleet, link = hybrid_fleet()
    full = stored(PROMPT, 0, "full_attention")
    swa = stored(PROMPT, 1, "sliding_window", 40)
    fleet.apply(link, 0, 0, full)
    fleet.apply(link, 0, 1, swa)
    assert link.in_rotation and link.vllm_rule is not None
    assert link.vllm_rule.alignment_tokens == BLOCK
    assert [g["kind"] for g in fleet.state()["v"]["kv_groups"]] == ["full_attention",
                                                                   "sliding_window"]
    assert hit(fleet) == 96
    # the request freed the blocks below its window; they were evicted: 3, 4, 5 still serve 96
    fleet.apply(link, 0, 2, removed(swa, 1, 0, 1, 2))
    assert hit(fleet) == 96
    # a hole in the window: no aligned length has its window held (48 needs 0, 1, 2)
    fleet.apply(link, 0, 3, removed(swa, 1, 4))
    assert hit(fleet) == 0
    # full attention alone holds everything; the sliding-window group decides
    assert fleet.index.matched_blocks("v", fleet.plan(PROMPT, ["v"])["v"].hashes) == 6


def test_a_mamba_group_serves_the_state_at_the_hit():
    """Full attention + Mamba (a state block per 16 tokens): the hit is the longest aligned
    prefix both serve, Mamba's state ending exactly there."""
    fleet, link = hybrid_fleet()
    fleet.apply(link, 0, 0, stored(PROMPT, 0, "full_attention"))
    mamba = stored(PROMPT, 1, "mamba")
    fleet.apply(link, 0, 1, mamba)
    assert hit(fleet) == 96
    fleet.apply(link, 0, 2, removed(mamba, 1, 3, 4, 5))
    assert hit(fleet) == 48  # the state after block 2
    fleet.apply(link, 0, 3, removed(mamba, 1, 0, 1, 2))
    assert hit(fleet) == 0


def test_groups_of_two_block_sizes_align_hits_to_their_lcm():
    """Full attention of 32 over a sliding window of 16: blocks hashed every 16 tokens (the
    GCD, vLLM's hash_block_size), a 32-token block named by its second hash, hits aligned
    to 32."""
    fleet, link = hybrid_fleet()
    fleet.apply(link, 0, 0, stored(PROMPT[:96], 0, "full_attention", block_size=32))
    fleet.apply(link, 0, 1, stored(PROMPT, 1, "sliding_window", 20))  # 2 blocks of window
    assert link.vllm_rule is not None and link.vllm_rule.alignment_tokens == 32
    assert hit(fleet) == 96
    assert hit(fleet, PROMPT[:90]) == 64  # N - 1 = 89: two whole blocks of 32
    assert fleet.index.stats()["v"]["mismatched_blocks"] == 0  # the events verify


def test_groups_the_router_cannot_predict_are_refused():
    batch = root_event(list(range(1000, 1100)), "0", block_size=BLOCK)
    text = metrics(block_size="16")
    contract = vllm_contract("v", URL, text, MODELS, FLAGS)
    swa = replace(batch.events[0], group_idx=1, kv_cache_spec_kind="sliding_window",
                  kv_cache_spec_sliding_window=128)
    check_events(contract, FLAGS, [batch, KVEventBatch(0.0, [swa])])  # predicted
    eagle = VLLMFlags(EVENTS, "0", {"method": "eagle3"})
    drop = vllm_contract("v", URL, metrics(block_size="16", speculates=True), MODELS, eagle)
    with pytest.raises(ContractError, match=r"hybrid vLLM engine.*EAGLE last-block drop"):
        check_events(drop, eagle, [batch, KVEventBatch(0.0, [swa])])
    # a second full-attention group (a drafter of its own spec): vLLM's hybrid coordinator,
    # whose EAGLE drop differs from one group's
    second = replace(batch.events[0], group_idx=1, kv_cache_spec_kind="full_attention")
    check_events(contract, FLAGS, [batch, KVEventBatch(0.0, [second])])
    with pytest.raises(ContractError, match=r"groups 0: full_attention, 1: full_attention"):
        check_events(drop, eagle, [batch, KVEventBatch(0.0, [second])])
    coarse = stored(list(range(1000, 1100)), 1, "mamba", block_size=32).events[0]
    with pytest.raises(ContractError, match="fine-grained partial hits"):
        check_events(contract, FLAGS, [batch, KVEventBatch(0.0, [coarse])])
    unwindowed = replace(swa, kv_cache_spec_sliding_window=None)
    with pytest.raises(ContractError, match="names no sliding window"):
        check_events(contract, FLAGS, [batch, KVEventBatch(0.0, [unwindowed])])


@pytest.mark.vllm
@pytest.mark.skipif(not VENV or not (Path(VENV) / "bin" / "python").is_file(),
                    reason="set SPECKV_VLLM_VENV to a venv with vLLM 0.32 to replay its own "
                    "KV cache manager")
@pytest.mark.parametrize("layout", ["full:16,swa:16:40", "swa:16:40", "full:32,swa:16:40",
                                    "full:16,mamba:16", "full:16,swa:32:40,swa:16:24",
                                    "full:16,swa:16:24,mamba:16"])
def test_predictions_equal_the_hits_of_vllms_own_kv_cache_manager(layout):
    script = Path(__file__).with_name("vllm_kv_manager_events.py")
    env = {**os.environ, "PYTHONHASHSEED": "0", "PYTHONPATH": ""}
    run = patience.run([str(Path(VENV) / "bin" / "python"), str(script), layout, "0", "80"],
                       cpu_budget_s=600, env=env)
    assert run.returncode == 0, run.stderr
    lines = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    fleet, link = hybrid_fleet(lines[0]["hash_block_size"])
    checked = served = 0
    for seq, row in enumerate(lines[1:]):
        if "events" in row:
            fleet.apply(link, 0, seq, decode_batch(bytes.fromhex(row["events"])))
            continue
        assert hit(fleet, row["prompt"]) == row["hit"], (layout, seq, len(row["prompt"]))
        checked += 1
        served += row["hit"] > 0
    assert link.in_rotation and checked == 80 and served >= 20
    assert fleet.index.stats()["v"]["mismatched_blocks"] == 0
