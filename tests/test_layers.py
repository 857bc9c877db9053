"""Layers point one way: which speckv packages a low layer and the vLLM plugin may import.

The rules read every import statement (module level and inside functions) of the package's
modules. `cache` and `hashing` sit under everything else, so they import only each other
(`cache` → `hashing`, never back). The vLLM plugin (`speckv.integrations`) runs inside vLLM's
processes, so it imports only those two layers and itself: the drafter policy table it decides
with lives in `speckv.cache.drafter_policy` for that reason, never in `speckv.speculation`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "speckv"

ALLOWED = {
    "hashing": ("speckv.hashing",),
    "cache": ("speckv.cache", "speckv.hashing"),
    "integrations": ("speckv.integrations", "speckv.cache", "speckv.hashing"),
}


def _speckv_imports(path: Path) -> list[str]:
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
        elif isinstance(node, ast.ImportFrom):
            names.append("(relative import)")
        elif isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
    return [name for name in names if name == "speckv" or name.startswith("speckv.")
            or name == "(relative import)"]


def _is_within(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == package or name.startswith(package + ".") for package in packages)


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_a_layer_imports_only_the_layers_under_it(package):
    modules = sorted((ROOT / package).rglob("*.py"))
    assert modules, f"speckv/{package} has no modules"
    offenders = [f"{path.relative_to(ROOT.parent)}: {name}"
                 for path in modules for name in _speckv_imports(path)
                 if not _is_within(name, ALLOWED[package])]
    assert not offenders, f"speckv/{package} may import only {ALLOWED[package]}: {offenders}"


def test_the_rule_sees_a_sideways_import(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import os\nfrom speckv.cache import x\n\ndef f():\n"
                      "    from speckv.speculation.methods import METHODS\n")
    names = _speckv_imports(module)
    assert names == ["speckv.cache", "speckv.speculation.methods"]
    assert not _is_within(names[1], ALLOWED["integrations"])
    assert not _is_within("speckv.cachex", ("speckv.cache",))
