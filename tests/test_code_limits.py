"""The size limits of the library's code (docs/DESIGN.md, STYLE.md): no file in tptrain/ over 400 lines, no function
over 60, no class over 250 (a function's or class's lines: end_lineno - lineno + 1, its decorators not counted)."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "tptrain"
MAX_FILE_LINES, MAX_FUNCTION_LINES, MAX_CLASS_LINES = 400, 60, 250

# TEMPORARY: over the file limit on this branch (their functions and classes are still checked); each is brought under it by a parallel change of issue 32 (named
# beside it), and the lead empties this list once those are merged. Never add to it.
OVER_THE_LIMIT_UNTIL_MERGED = {
}


def _over_the_limits(path: Path, relative: str) -> list[str]:
    text = path.read_text()
    lines = len(text.splitlines())
    long_file = lines > MAX_FILE_LINES and relative not in OVER_THE_LIMIT_UNTIL_MERGED
    out = [f"{relative}: {lines} lines (limit {MAX_FILE_LINES})"] if long_file else []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            kind, limit = ("class", MAX_CLASS_LINES) if isinstance(node, ast.ClassDef) else ("function",
                                                                                             MAX_FUNCTION_LINES)
            size = node.end_lineno - node.lineno + 1
            if size > limit:
                out.append(f"{relative}:{node.lineno}: {kind} {node.name} has {size} lines (limit {limit})")
    return out


def test_no_file_function_or_class_over_its_limit():
    over = [problem for path in sorted(PACKAGE.rglob("*.py"))
            for problem in _over_the_limits(path, path.relative_to(PACKAGE.parent).as_posix())]
    assert not over, "split these (one job each; STYLE.md):\n" + "\n".join(over)


def test_the_allowed_files_exist():
    # A stale entry would hide nothing but must go: the list is only ever emptied.
    missing = [f for f in OVER_THE_LIMIT_UNTIL_MERGED if not (PACKAGE.parent / f).is_file()]
    assert not missing, missing


def test_the_checker_sees_each_limit(tmp_path):
    # The test itself must be able to fail: a long file, a long function and a long class are each found.
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_CLASS_LINES))
    probe = tmp_path / "probe.py"
    probe.write_text(f"class Big:\n{body}\n\n\ndef long():\n{body}\n" + "\n" * MAX_FILE_LINES)
    found = _over_the_limits(probe, "probe.py")
    assert any("lines (limit 400)" in f for f in found), found
    assert any("class Big has 251 lines" in f for f in found), found
    assert any("function long has 251 lines" in f for f in found), found



def _shared_class_names(root: Path) -> list[str]:
    """"Name: where, where" for every class name defined more than once under `root` (nested classes too)."""
    names: dict[str, list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                names.setdefault(node.name, []).append(f"{path.relative_to(root.parent).as_posix()}:{node.lineno}")
    return [f"{name}: {', '.join(where)}" for name, where in names.items() if len(where) > 1]


def test_no_two_classes_share_a_name():
    # One meaning per name (issue 42): a class's name says which one is meant, wherever it is imported.
    shared = _shared_class_names(PACKAGE)
    assert not shared, "give each its own name:\n" + "\n".join(shared)


def test_the_checker_sees_a_shared_class_name(tmp_path):
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "a.py").write_text("class Facts:\n    pass\n")
    (tmp_path / "pkg" / "sub" / "b.py").write_text("def f():\n    class Facts:\n        pass\n")
    assert _shared_class_names(tmp_path / "pkg") == ["Facts: pkg/a.py:1, pkg/sub/b.py:2"]
