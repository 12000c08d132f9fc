"""The import graph of tptrain is one-way: each layer imports only itself and the layers below it,
and no module is part of an import cycle, counting imports inside functions too (a function-level
import is how a cycle hides)."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "tptrain"

# Lowest first. The package root (`tptrain/__init__.py`: the public API) and the CLI sit on top.
LAYERS = [
    ("tptrain.losses", "tptrain.distributed", "tptrain.backends", "tptrain.dtypes", "tptrain.checks",
     "tptrain.meta_init",
     "tptrain.layout"),
    ("tptrain.io",),
    ("tptrain.text",),  # tokenizers and chat templates: reads files through io, below training and generation
    ("tptrain.parallel",),
    ("tptrain.generation",),  # model.generate's engine: below the model base class, which reaches it at call time
    ("tptrain.modeling",),
    # The configs are data (no torch) that both backends read. The transformers backend sits below tptrain's own
    # model code: the registry and the Auto classes choose it (importing it inside the functions that do), and it
    # never imports them.
    ("tptrain.models.configuration",),
    ("tptrain.hf",),
    ("tptrain.models",),
    ("tptrain.diagnostics",),
    ("tptrain.training", "tptrain.peft"),
    ("tptrain.cli", "tptrain.__main__", "tptrain"),
]


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """tptrain modules imported anywhere in `path` (module level and inside functions)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from tptrain.distributed import comm` imports the module tptrain.distributed.comm
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                     for a in node.names]
        else:
            continue
        out.update(n for n in names if n.split(".")[0] == "tptrain")
    return out


def _layer(module: str) -> int:
    best = max(((len(prefix), i) for i, layer in enumerate(LAYERS) for prefix in layer
                if module == prefix or module.startswith(prefix + ".")), default=None)
    assert best is not None, f"{module} belongs to no layer: add it to LAYERS"
    return best[1]


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, modules) - {name} for name, path in modules.items()}


def test_every_import_points_down_the_layers():
    upward = [f"{mod} (layer {_layer(mod)}) imports {dep} (layer {_layer(dep)})"
              for mod, deps in sorted(_graph().items()) for dep in sorted(deps) if _layer(dep) > _layer(mod)]
    assert not upward, "imports against the layer order:\n" + "\n".join(upward)


def test_the_backend_choice_imports_the_transformers_backend_and_never_the_reverse():
    # models.registry / models.auto import tptrain.hf inside functions; tptrain.hf imports no tptrain.models module
    # but the configs (the layer order above makes the upward one an error).
    assert _layer("tptrain.models.configuration.base") < _layer("tptrain.hf.model") < _layer("tptrain.models.auto")
    assert _layer("tptrain.hf.model") < _layer("tptrain.models.registry") == _layer("tptrain.models.decoder")
    graph = _graph()
    assert "tptrain.hf.model" in graph["tptrain.models.registry"] | graph["tptrain.models.auto"]
    assert not {dep for mod, deps in graph.items() if mod.startswith("tptrain.hf") for dep in deps
                if dep.startswith("tptrain.models") and not dep.startswith("tptrain.models.configuration")}


def test_no_import_cycle():
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(mod: str, path: list[str]) -> None:
        state[mod] = 1
        for dep in sorted(graph.get(mod, ())):
            if state.get(dep) == 1:
                cycles.append(" -> ".join(path[path.index(dep):] + [dep]) if dep in path else f"{mod} -> {dep}")
            elif dep not in state:
                visit(dep, path + [dep])
        state[mod] = 2

    for mod in sorted(graph):
        if mod not in state:
            visit(mod, [mod])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_checker_sees_function_level_imports(tmp_path):
    # The test itself must be able to fail: a function-level upward import is found.
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from tptrain.training import trainer\n")
    assert "tptrain.training.trainer" in _imports(probe, _modules())


# The transformers backend is the only package that may import transformers (or peft), and it is imported only
# inside the functions that choose it, so the core imports and runs without transformers installed.
OPTIONAL = ("transformers", "peft")
BACKEND = "tptrain.hf"


def _third_party_imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.split(".")[0])
    return out


def _module_level_imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """tptrain modules imported at module level (not inside a function) of `path`."""
    tree = ast.parse(path.read_text())
    nested = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
              for n in ast.walk(f)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in nested:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("tptrain"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tptrain"):
            out.update(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                       for a in node.names)
    return out


def test_only_the_transformers_backend_imports_transformers_and_only_lazily():
    modules = _modules()
    outside = [f"{mod} imports {dep}" for mod, path in sorted(modules.items())
               if not (mod == BACKEND or mod.startswith(BACKEND + "."))
               for dep in sorted(_third_party_imports(path) & set(OPTIONAL))]
    assert not outside, "only tptrain.hf may import transformers/peft:\n" + "\n".join(outside)
    eager = [f"{mod} imports {dep} at module level" for mod, path in sorted(modules.items())
             if not mod.startswith(BACKEND) for dep in sorted(_module_level_imports(path, modules))
             if dep == BACKEND or dep.startswith(BACKEND + ".")]
    assert not eager, "tptrain.hf must be imported only where the backend is chosen:\n" + "\n".join(eager)
    assert "transformers" in _third_party_imports(modules["tptrain.hf.model"])  # the check can see it


def test_the_lazy_import_checker_sees_module_level_imports(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("from tptrain.hf import model\n\ndef f():\n    from tptrain.training import trainer\n")
    assert _module_level_imports(probe, _modules()) == {"tptrain.hf.model"}


def test_the_model_base_class_imports_no_axis():
    """modeling.py loads and saves; every axis is applied from outside the model by the one parallelize
    (tptrain/parallel/parallelize.py), so the base class imports no axis's module."""
    modules = _modules()
    parallel = {dep for dep in _imports(modules["tptrain.modeling"], modules) if dep.startswith("tptrain.parallel")}
    axes = {f"tptrain.parallel.{name}" for name in ("tensor_parallel", "context_parallel", "pipeline_parallel",
                                                    "pipeline_checkpoint", "sequence_parallel", "data_parallel",
                                                    "expert_parallel")}
    assert "tptrain.parallel.parallelize" in parallel and not parallel & axes, sorted(parallel)


ENGINE = ("tptrain.parallel", "tptrain.training", "tptrain.hf", "torch.distributed.fsdp", "torch.distributed.pipelining")


def test_importing_the_models_loads_no_engine_transitively():
    """Every module of tptrain.models imported in a fresh interpreter: nothing of the engine (tptrain.parallel and what
    it builds on: FSDP, pipelining), the training code or the transformers backend is in sys.modules afterwards. The
    model base class reaches the engine only when a model is laid out, loaded or saved (at call time)."""
    names = sorted(mod for mod in _modules() if mod == "tptrain.models" or mod.startswith("tptrain.models."))
    script = ("import importlib, sys\n"
              f"for name in {names!r}:\n    importlib.import_module(name)\n"
              f"print(sorted(m for m in sys.modules if m.startswith({ENGINE!r})))\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]", f"importing tptrain.models loads {proc.stdout.strip()}"
    assert "tptrain.models.decoder" in names and "tptrain.models.auto" in names  # the survey covers the classes


# Each parallel axis's own module; none imports another's (what spans axes is the orchestrator's: parallelize.py,
# and the state's: tptrain/distributed/state.py).
AXES = ("tensor_parallel", "sequence_parallel", "context_parallel", "pipeline_parallel", "expert_parallel",
        "data_parallel")


def test_no_axis_imports_another():
    modules = _modules()
    crossing = [f"{axis} imports {dep}" for axis in AXES for dep in sorted(_imports(modules[f"tptrain.parallel.{axis}"],
                                                                                    modules))
                if dep.rpartition(".")[2] in AXES and dep != f"tptrain.parallel.{axis}"]
    assert not crossing, "\n".join(crossing)
    assert "tptrain.parallel.tensor_parallel" in _imports(modules["tptrain.parallel.parallelize"], modules)
