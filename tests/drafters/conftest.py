"""Drafter tests: single-threaded torch (faster on a shared CPU) and the helpers on sys.path."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
torch.set_num_threads(1)
