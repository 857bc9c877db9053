"""speckv's vLLM plugin: lookahead block hashes inside vLLM's own engine.

Owns the entry point vLLM calls (`register`, under the `vllm.general_plugins` entry point
`speckv_lookahead` in pyproject.toml). Installing speckv into a vLLM environment enables it;
`VLLM_PLUGINS=` with a list that leaves `speckv_lookahead` out, or `SPECKV_VLLM_PLUGIN=0`,
turns it off. With prefix caching on, no KV connector and an EAGLE-family drafter (eagle,
eagle3, mtp), the engine hashes each block with its L successor tokens exactly as speckv does,
caches a block only once that hash exists (and the last one at finish), keeps the block vLLM
would drop, and publishes `lookahead_token_ids` in its KV events (see patches.py).

It imports only speckv's hashing and policy modules (numpy, cbor2, msgspec: vLLM's own
dependencies), never speckv's engine or server.
"""

from __future__ import annotations

import logging

from speckv.integrations.vllm.decision import SWITCH_ENV, switched_off

logger = logging.getLogger("vllm.plugins.speckv")
_state = {"done": False}


def register() -> None:
    """vLLM's general-plugin hook; it runs in every vLLM process, maybe more than once."""
    if _state["done"]:
        return
    _state["done"] = True
    if switched_off():
        logger.info("speckv: %s turns the plugin off; vLLM runs unpatched", SWITCH_ENV)
        return
    import vllm

    from speckv.integrations.vllm import patches

    version = getattr(vllm, "__version__", "unknown")
    if not patches.version_supported(version):
        logger.warning("speckv: not patching vLLM %s: the plugin supports vLLM %s only; "
                       "vLLM runs unpatched", version, patches.SUPPORTED_TEXT)
        return
    native = patches.native_lookahead_hashes()
    if native:
        logger.info("speckv: vLLM %s hashes blocks with their lookahead tokens itself (%s); the "
                    "plugin patches nothing", version, native)
        return
    try:
        targets = patches.resolve_targets()
    except patches.PatchTargetMissing as error:
        logger.warning("speckv: not patching vLLM %s: %s is not what the plugin patches "
                       "(it supports vLLM %s); vLLM runs unpatched", version, error,
                       patches.SUPPORTED_TEXT)
        return
    patches.apply(targets)
