"""The layers of DESIGN.md hold: no import circles, nothing imports upward, the front end imports no JAX.

The graph is read from the source with `ast`. For the layers' rules it holds the imports a module
runs when it is imported (its top level, class bodies, top-level if/try blocks): an import inside a
function is a deliberate lazy one (the front end builds the device side only when it makes an
engine). For circles it holds lazy imports too: data flows one way even when an import waits for a
call. Imports under `if TYPE_CHECKING:` never run and count for neither.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("cbjax", "kernels_pallas", "kernels_cpu")
DEVICE_LIBRARIES = ("jax", "jaxlib", "flax", "kernels_pallas", "kernels_cpu")

# (importer prefix, imported prefixes it must not reach, imported prefixes exempt from that)
UPWARD = [
    ("cbjax.core", ("cbjax.engine", "cbjax.entrypoints"), ()),
    ("cbjax.worker", ("cbjax.engine", "cbjax.entrypoints"), ()),
    *[(low, ("cbjax.worker", "cbjax.core", "cbjax.engine", "cbjax.entrypoints"), ())
      for low in ("cbjax.models", "cbjax.checkpoint")],
    *[(kernels, ("cbjax",), ("cbjax.models.layers",)) for kernels in ("kernels_pallas", "kernels_cpu")],
    # The front end and the host policy: no device code at module level (worker/ reads core's data types, not the reverse).
    *[(host, ("cbjax.worker", *DEVICE_LIBRARIES), ()) for host in ("cbjax.engine", "cbjax.core")],
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def source_modules() -> dict[str, Path]:
    return {module_name(path): path for package in PACKAGES for path in sorted((REPO / package).rglob("*.py"))}


def runs_at_import(body: list[ast.stmt], lazy: bool = False):
    """The import statements a module (or class body) runs when it is imported; with `lazy`, also
    those inside its functions."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.ClassDef) or (lazy and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))):
            yield from runs_at_import(node.body, lazy)
        elif isinstance(node, ast.If):
            if not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
                yield from runs_at_import(node.body, lazy)
            yield from runs_at_import(node.orelse, lazy)
        elif isinstance(node, ast.Try):
            for block in (node.body, *[handler.body for handler in node.handlers], node.orelse, node.finalbody):
                yield from runs_at_import(block, lazy)
        elif isinstance(node, (ast.With, ast.For, ast.While)) or (lazy and isinstance(node, ast.AsyncWith)):
            yield from runs_at_import(node.body, lazy)


def imported_names(module: str, path: Path, known: set[str], lazy: bool = False) -> set[str]:
    """Every module `module` imports at import time (with `lazy`, at any time): ours by their full
    names, others by their top package."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in runs_at_import(ast.parse(path.read_text(), str(path)).body, lazy):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from package import module` imports the module; `from module import name` the module.
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        for target in targets:
            names.add(target if target in known else target.split(".")[0])
    return names


def import_graph(lazy: bool = False) -> dict[str, set[str]]:
    modules = source_modules()
    known = set(modules)
    return {module: imported_names(module, path, known, lazy) - {module} for module, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle among our modules (as a path that ends where it starts), or None."""
    done, on_path, path = set(), set(), []

    def visit(module: str) -> list[str] | None:
        on_path.add(module)
        path.append(module)
        for target in sorted(graph.get(module, ())):
            if target in on_path:
                return path[path.index(target):] + [target]
            if target in graph and target not in done:
                cycle = visit(target)
                if cycle:
                    return cycle
        on_path.discard(module)
        path.pop()
        done.add(module)
        return None

    for module in sorted(graph):
        if module not in done:
            cycle = visit(module)
            if cycle:
                return cycle
    return None


def within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def test_the_graph_sees_a_known_edge():
    """The reader works: the scheduler imports the block manager; an import inside a function counts only as lazy."""
    graph = import_graph()
    assert "cbjax.core.kv.block_manager" in graph["cbjax.core.sched.scheduler"]
    assert "cbjax.worker.build" not in graph["cbjax.engine.llm_engine"]  # LLMEngine imports it in its constructor
    assert "jax" in graph["cbjax.worker.model_runner"]
    assert "cbjax.worker.build" in import_graph(lazy=True)["cbjax.engine.llm_engine"]


def test_no_import_circles():
    """Lazy imports count: an import inside a function still makes the two modules depend on each other."""
    cycle = find_cycle(import_graph(lazy=True))
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_no_module_imports_upward():
    offending = [
        f"{importer} imports {target} ({layer} must not import {', '.join(forbidden)})"
        for importer, targets in sorted(import_graph().items())
        for layer, forbidden, exempt in UPWARD if within(importer, layer)
        for target in sorted(targets)
        if any(within(target, f) for f in forbidden) and not any(within(target, e) for e in exempt)
    ]
    assert not offending, "upward imports:\n" + "\n".join(offending)


FRONT_END_MODULES = ["cbjax", "cbjax.engine.async_llm", "cbjax.engine.process_client", "cbjax.entrypoints.openai.app"]


def test_the_front_end_modules_import_no_jax():
    """Transitively too (the graph above sees only direct imports), in a fresh interpreter."""
    code = (f"import importlib, json, sys; [importlib.import_module(m) for m in {FRONT_END_MODULES!r}]; "
            f"print(json.dumps(sorted(m for m in {DEVICE_LIBRARIES!r} if m in sys.modules)))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []


# Put first on the server's PYTHONPATH: each process it starts writes, as it exits, which device
# libraries it had imported (the front end exits normally on SIGTERM; the core is its child). A report
# appears whole or not at all: a helper process exiting late (multiprocessing's resource tracker) is still
# writing its own while the test reads the others.
REPORT_AT_EXIT = """
import atexit, json, os, sys
def _report():
    path = os.path.join({folder!r}, f"{{os.getpid()}}.json")
    with open(path + ".partial", "w") as out:
        json.dump(sorted(m for m in {libraries!r} if m in sys.modules), out)
    os.replace(path + ".partial", path)
atexit.register(_report)
"""


def test_the_serve_front_end_process_never_imports_jax(tmp_path):
    """`cbjax serve --engine-process`: the process answering HTTP, having served a completion, had no
    jax in sys.modules; the engine core's process did the device work."""
    from server_process import ServerProcess
    from tiny_checkpoint import make_tiny_checkpoint

    _, checkpoint = make_tiny_checkpoint(tmp_path / "model", "llama")
    hook, reports = tmp_path / "hook", tmp_path / "reports"
    hook.mkdir()
    reports.mkdir()
    (hook / "sitecustomize.py").write_text(REPORT_AT_EXIT.format(folder=str(reports), libraries=DEVICE_LIBRARIES))
    server = ServerProcess(checkpoint, tmp_path / "server.log", "--engine-process", "--max-model-len", "64",
                           "--max-num-seqs", "2", "--max-num-batched-tokens", "16", "--block-size", "8",
                           "--num-kv-blocks", "24", "--dtype", "float32", "--served-model-name", "tiny",
                           env={"PYTHONPATH": os.pathsep.join([str(hook), str(REPO), os.environ.get("PYTHONPATH", "")])})
    try:
        response = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": [5, 17, 42], "max_tokens": 3, "temperature": 0.0, "ignore_eos": True})
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 3
    finally:
        assert server.stop() == 0
    imported = {int(report.stem): json.loads(report.read_text()) for report in reports.glob("*.json")}
    log = (tmp_path / "server.log").read_text()[-3000:]
    assert server.process.pid in imported, f"the server's process wrote no report at exit; log:\n{log}"
    assert imported.pop(server.process.pid) == []
    assert [libraries for libraries in imported.values() if "jax" in libraries], "the engine core's process ran the model"
