"""Speculative-decoding drafters that keep a draft KV in the target's paged blocks.

EAGLE (`eagle.py`), EAGLE3 (`eagle3.py`) and k-module MTP (`mtp.py`) behind one interface
(`base.py`: catch-up `write_draft_kv`, `propose`); loaders for the public checkpoint layouts
(`loaders.py`); a standalone greedy speculative loop (`evaluate.py`); the training and held-out
chat prompts (`prompts.py`); the shipped trained head (`builtin.py`). Training itself runs the
engine, so it lives above it, in `speckv.training`.
"""

from speckv.drafters.base import Drafter
from speckv.drafters.builtin import load_builtin_drafter
from speckv.drafters.draft_state import CatchUpRequest, DraftCarry, DraftState, TargetStates
from speckv.drafters.eagle import EagleDrafter
from speckv.drafters.eagle3 import Eagle3Drafter
from speckv.drafters.loaders import (
    METHODS,
    MTP_LAYOUTS,
    build_drafter,
    detect_format,
    load_drafter,
    random_drafter,
    save_drafter,
)
from speckv.drafters.modules import DraftModule
from speckv.drafters.mtp import MTPDrafter

__all__ = [
    "METHODS",
    "MTP_LAYOUTS",
    "CatchUpRequest",
    "DraftCarry",
    "DraftModule",
    "DraftState",
    "Drafter",
    "Eagle3Drafter",
    "EagleDrafter",
    "MTPDrafter",
    "TargetStates",
    "build_drafter",
    "detect_format",
    "load_builtin_drafter",
    "load_drafter",
    "random_drafter",
    "save_drafter",
]
