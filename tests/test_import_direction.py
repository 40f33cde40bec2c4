"""Modules that once imported each other import in one direction only."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import megatron_zeppelin

ROOT = Path(megatron_zeppelin.__file__).parent


def imported_modules(module: str) -> set[str]:
    """Every megatron_zeppelin module ``module`` imports, at any depth of its code
    (a function-level import closes a cycle as surely as a top-level one)."""
    tree = ast.parse((ROOT / (module.replace(".", "/") + ".py")).read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("megatron_zeppelin."):
            out.add(node.module.removeprefix("megatron_zeppelin."))
            out.update(f"{node.module.removeprefix('megatron_zeppelin.')}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name.removeprefix("megatron_zeppelin.") for a in node.names)
    return out


#: (module, what it imports, modules it must not import: the importer, and
#: the package whose ``__init__`` imports the importer).
ONE_WAY = [("cost.moe", "cost.model", {"cost.model", "cost"}),
           ("sim.static_layout", "sim.simulate", {"sim.simulate", "sim"})]


@pytest.mark.parametrize("lower, upper, forbidden", ONE_WAY, ids=[low for low, _, _ in ONE_WAY])
def test_the_lower_module_does_not_import_the_upper_one(lower, upper, forbidden):
    assert lower in imported_modules(upper)
    assert not imported_modules(lower) & forbidden
