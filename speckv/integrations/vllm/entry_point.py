"""speckv's vLLM plugin entry point, for a vLLM venv that does not have speckv installed.

Owns the metadata-only dist-info (`speckv-VERSION.dist-info` with the `vllm.general_plugins`
entry point of pyproject.toml) that, on that venv's PYTHONPATH beside a speckv checkout, makes
vLLM load the plugin as an installed speckv would. The bench's vLLM fleet and the `vllm`-marked
tests both start vLLM this way.
"""

from __future__ import annotations

from pathlib import Path

DIST_NAME = "speckv"
DIST_VERSION = "0.1.0"  # pyproject.toml's [project] version
ENTRY_POINT_GROUP = "vllm.general_plugins"
ENTRY_POINT = "speckv_lookahead = speckv.integrations.vllm:register"  # as in pyproject.toml


def write_entry_point_dir(root: Path) -> Path:
    """Write the dist-info under `root` (made if missing, rewritten if there) and return
    `root`: the folder to put on the venv's PYTHONPATH."""
    info = root / f"{DIST_NAME}-{DIST_VERSION}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {DIST_NAME}\nVersion: {DIST_VERSION}\n")
    (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{ENTRY_POINT}\n")
    (info / "RECORD").write_text("")
    return root
