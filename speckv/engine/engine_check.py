"""The engine check: whether a model, its drafter, the KV connector and the configuration can
run together, decided once at start-up with errors in the user's words (config fields, CLI
flags), before any tensor is allocated.

    check_model_fits   the config against the model alone (state block size, context length)
    check_engine       the planned layout against the drafter, the proposer and the connector
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from speckv.connectors import kv_group_blocker
from speckv.engine.config import EngineConfig
from speckv.models.base import TargetModel

if TYPE_CHECKING:
    from speckv.connectors import KVConnector
    from speckv.models.common.kv_layout import KVCacheLayout
    from speckv.speculation.proposer import Proposer


def check_model_fits(model: TargetModel, config: EngineConfig) -> None:
    """ValueError when the config asks the model for what it has not."""
    if (config.cache.mamba_block_size is not None
            and not model.kv_cache_layout(config.cache.block_size).has_state_group):
        raise ValueError("EngineArgs.mamba_block_size applies to models with a GDN / "
                         "Mamba state group only")
    context = model.config.max_position_embeddings
    if config.max_model_len is not None and config.max_model_len > context:
        # as vLLM: positions past the model's context give noise, not an error
        raise ValueError(f"max_model_len {config.max_model_len} is more than the model's "
                         f"context of {context} tokens (max_position_embeddings in its "
                         "config)")


def check_engine(layout: KVCacheLayout, config: EngineConfig, *, num_draft_layers: int,
                 proposer: Proposer | None, connector: KVConnector | None) -> None:
    """ValueError when the drafter, the proposer or a connector cannot use `layout`.
    `connector`: one passed to the engine directly (not built from `config.kv_connector`)."""
    if connector is not None and config.kv_connector is not None:
        raise ValueError("pass a connector or set EngineArgs.kv_connector, not both")
    draft_group = layout.draft_group
    if num_draft_layers and draft_group is not None \
            and layout.specs[draft_group].block_size != config.cache.block_size:
        raise ValueError(f"the drafter's KV group has blocks of "
                         f"{layout.specs[draft_group].block_size} tokens; block_size is "
                         f"{config.cache.block_size}: they must be equal")
    if proposer is not None and proposer.kv_cache is not None and draft_group is None:
        raise ValueError("a drafter's KV needs a full-attention KV cache group; this model "
                         f"has none ({layout.describe()}): pass the drafter as `drafter`")
    if connector is not None and not config.cache.enable_prefix_caching:
        raise ValueError("a KV connector needs enable_prefix_caching: tiers are keyed by "
                         "the prefix cache's block hashes")


def check_connector_groups(connector: KVConnector | None, layout: KVCacheLayout,
                           config: EngineConfig) -> None:
    """A KV connector must carry every KV cache group of the layout (a tier hit must be one
    every group can serve); ValueError naming the connector and the group it cannot carry."""
    blocker = kv_group_blocker(connector, [spec.kind for spec in layout.specs])
    if blocker is None:
        return
    name = ",".join(config.kv_connector.names) if config.kv_connector is not None else (
        connector.name if connector is not None else "?")
    raise ValueError(f"--kv-connector {name}: {blocker} [{layout.describe()}]: a tier hit must "
                     "be one every group can serve; drop --kv-connector")
