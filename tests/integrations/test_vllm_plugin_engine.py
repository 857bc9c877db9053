"""speckv's plugin inside vLLM's real CPU engine (`vllm` marker; SPECKV_VLLM_VENV).

One driver process with the plugin (eagle3 at B = 32 with KV events and the draft-KV check,
eagle3 at B = 128, no speculation at B = 32) and one without it (`VLLM_PLUGINS=`: eagle3 at
B = 32 and 128) serve every test here. vLLM's CPU attention takes block sizes in multiples
of 32, so B = 32 stands in for 16.
"""

from __future__ import annotations

import pytest

from speckv.events.schema import HashEncoding, external_hash
from speckv.hashing.block_hash import hash_lookahead_block
from speckv.hashing.formats import format_for
from speckv.hashing.functions import get_hash_algo, make_none_hash
from speckv.hashing.request_hasher import hash_prompt
from tests.integrations import vllm_venv

pytestmark = pytest.mark.vllm

HIT_LENGTHS = (49, 64, 1367)
REPETITION = {"num_prefixes": 2, "prefix_len": 256, "suffix_len": 32, "num_prompts": 6}
SHA256 = get_hash_algo("sha256")
NONE_HASH = make_none_hash(SHA256, "0")  # the driver runs vLLM with PYTHONHASHSEED=0


def _spec(name: str, block_size: int, eagle3: bool = True, **extra) -> dict:
    spec = {"name": name, "model": str(vllm_venv.MODEL_DIR), "block_size": block_size,
            "hit_lengths": list(HIT_LENGTHS)}
    if eagle3:
        spec["eagle3"] = str(vllm_venv.EAGLE3_HEAD)
    spec.update(extra)
    return spec


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    python = vllm_venv.venv_python()
    on, on_log = vllm_venv.run_driver(python, tmp_path_factory.mktemp("on"), True, [
        _spec("eagle3_b32", 32, events_port=vllm_venv.free_port(),
              prefix_repetition=REPETITION, draft_kv=True),
        _spec("eagle3_b128", 128),
        _spec("nospec_b32", 32, eagle3=False, prefix_repetition=REPETITION),
    ])
    off, off_log = vllm_venv.run_driver(python, tmp_path_factory.mktemp("off"), False, [
        _spec("eagle3_b32", 32, prefix_repetition=REPETITION),
        _spec("eagle3_b128", 128),
    ])
    return {"on": on, "off": off, "on_log": on_log, "off_log": off_log}


def _second_hit(result: dict, n: int) -> int:
    return result["hits"][str(n)][1]["cached"]


@pytest.mark.parametrize("block_size", [32, 128])
@pytest.mark.parametrize("n", HIT_LENGTHS)
def test_a_prompt_sent_twice_hits_all_its_blocks_with_the_plugin_one_less_without(
        runs, block_size, n):
    name = f"eagle3_b{block_size}"
    full = (n - 1) // block_size * block_size
    assert _second_hit(runs["on"][name], n) == full
    assert _second_hit(runs["off"][name], n) == max(0, full - block_size)
    assert _second_hit(runs["on"]["nospec_b32"], n) == (n - 1) // 32 * 32  # the plugin is off


def test_the_plugin_loads_only_where_asked(runs):
    # the two EAGLE3 engines, not the one without speculation
    assert runs["on_log"].count("speckv: lookahead block hashes with L=1") == 2
    assert "speckv:" not in runs["off_log"]  # VLLM_PLUGINS= left it out


@pytest.mark.exactness
def test_greedy_outputs_are_the_same_with_and_without_the_plugin(runs):
    for block_size in (32, 128):
        name = f"eagle3_b{block_size}"
        for n in HIT_LENGTHS:
            with_plugin = [run["output"] for run in runs["on"][name]["hits"][str(n)]]
            without = [run["output"] for run in runs["off"][name]["hits"][str(n)]]
            assert with_plugin == without, (block_size, n)
            assert with_plugin[0] == with_plugin[1]  # the hit changes nothing
    repeated = [run["output"] for run in runs["on"]["eagle3_b32"]["prefix_repetition"]]
    assert repeated == [run["output"] for run in runs["off"]["eagle3_b32"]["prefix_repetition"]]
    assert repeated == [run["output"] for run in runs["on"]["nospec_b32"]["prefix_repetition"]]


def test_prefix_repetition_hits_as_much_as_without_speculation_less_one_token(runs):
    """Every repeat of a 256-token prefix: without speculation it hits all 8 blocks; with the
    plugin all but the draft KV of the prefix's last position (its successor is each prompt's
    own suffix: the block is reused, that one position recomputed); vLLM's drop loses the
    whole last block."""
    def hits(result):
        return sum(run["cached"] for run in result["prefix_repetition"])

    repeats = REPETITION["num_prompts"] - REPETITION["num_prefixes"]
    prefix = REPETITION["prefix_len"]
    assert hits(runs["on"]["nospec_b32"]) == repeats * prefix
    assert hits(runs["on"]["eagle3_b32"]) == repeats * (prefix - 1)
    assert hits(runs["on"]["eagle3_b32"]) >= 0.95 * hits(runs["on"]["nospec_b32"])
    assert hits(runs["off"]["eagle3_b32"]) == repeats * (prefix - 32)


def test_kv_event_hashes_equal_speckvs_hasher(runs):
    events = [event for event in runs["on"]["eagle3_b32"]["events"]
              if event["type"] == "BlockStored"]
    assert events
    published = set()
    for event in events:
        parent = bytes.fromhex(event["parent_block_hash"]) if event["parent_block_hash"] \
            else NONE_HASH
        tokens, lookahead = event["token_ids"], event["lookahead_token_ids"]
        assert len(lookahead) == len(event["block_hashes"]) == len(tokens) // 32
        for index, published_hash in enumerate(event["block_hashes"]):
            parent = hash_lookahead_block(SHA256, parent, tokens[32 * index: 32 * index + 32],
                                          lookahead[index])
            assert external_hash(parent, HashEncoding.BYTES).hex() == published_hash
            published.add(published_hash)
    # the prompt sent twice: every block whose successor is a prompt token was published,
    # under the hash speckv's own hasher gives the prompt
    prompt = _driver_tokens(1367, 1367)
    expected = hash_prompt(SHA256, NONE_HASH, 32, format_for(1), prompt)
    assert len(expected) == (1367 - 1) // 32
    assert {block_hash.hex() for block_hash in expected} <= published


def _driver_tokens(seed: int, n: int) -> list[int]:
    import random

    rng = random.Random(seed)  # the driver's prompt recipe (vllm_driver.tokens)
    return [rng.randrange(100, 40000) for _ in range(n)]


@pytest.mark.exactness
def test_draft_kv_of_a_hit_block_equals_a_cold_runs(runs):
    check = runs["on"]["eagle3_b32"]["draft_kv"]
    assert check["hit_cached"] == 96 and check["cold_cached"] == 0
    assert check["draft_max_diff"] == [0.0, 0.0, 0.0]
    assert check["target_max_diff"] == [0.0, 0.0, 0.0]
    assert check["outputs_equal"]
    # control: the same block tokens with another successor leave other draft KV (what a
    # legacy-hashed hit would read), the target KV the same
    assert check["stale_draft_max_diff"] > 0.0
    assert check["stale_target_max_diff"] == 0.0


@pytest.mark.exactness
def test_a_block_reused_at_a_divergence_equals_a_cold_runs_once_its_end_is_recomputed(runs):
    check = runs["on"]["eagle3_b32"]["draft_kv"]
    # `other` leaves `full` after block 2: blocks 0-1 hit, block 2 is copied from `full`'s and
    # its last position recomputed with `other`'s successor
    assert check["reused_cached"] == 3 * 32 - 1 and check["other_cold_cached"] == 0
    assert check["reused_draft_max_diff"] == [0.0, 0.0, 0.0]
    assert check["reused_target_max_diff"] == [0.0, 0.0, 0.0]
    assert check["reused_outputs_equal"]
