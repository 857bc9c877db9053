"""Drafter tests: single-threaded torch (faster on a shared CPU).

The helpers (drafter_test_utils.py) import directly: pytest puts this directory on sys.path.
"""

from __future__ import annotations

import torch

torch.set_num_threads(1)
