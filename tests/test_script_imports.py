"""Every `from tptrain... import name` in benchmarks/ and scripts/ names something that exists. These scripts run
outside the suite (minutes each, on an idle machine), so a moved function would otherwise surface only when someone
next times them (bench_data.py once imported load_tokenizer from its old home). Imports are read from the source
(most sit inside functions) and resolved without running the scripts."""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted([*ROOT.glob("benchmarks/*.py"), *ROOT.glob("scripts/*.py")])


def _tptrain_imports(path: Path) -> list[tuple[int, str, str | None]]:
    """(line, module, name or None for `import module`) of each tptrain import in `path`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "tptrain":
            found += [(node.lineno, node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, None) for alias in node.names if alias.name.split(".")[0] == "tptrain"]
    return found


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_tptrain_imports_resolve(path):
    missing = []
    for line, module, name in _tptrain_imports(path):
        try:
            imported = importlib.import_module(module)
        except ImportError as e:
            missing.append(f"{path.name}:{line}: import {module} ({e})")
            continue
        if name is not None and name != "*" and not hasattr(imported, name):
            try:
                importlib.import_module(f"{module}.{name}")  # a submodule
            except ImportError:
                missing.append(f"{path.name}:{line}: {module} has no {name!r}")
    assert not missing, "\n".join(missing)


def test_the_scripts_are_found():
    names = {p.name for p in SCRIPTS}
    assert {"bench_tp.py", "bench_data.py", "bench_plan.py"} <= names, names
