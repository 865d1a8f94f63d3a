"""No import circles among specdec's modules, and the runtime never imports the layers above it
(docs/architecture.md, "Contracts and invariants").

Every import counts, those inside functions too: a function-level import only hides a circle
until someone moves it. `from package import name` counts as importing the submodule where
`name` is one, else the package itself (its __init__).
"""

from __future__ import annotations

import ast
from pathlib import Path

import specdec

SOURCE = Path(specdec.__file__).resolve().parent.parent  # the folder holding specdec/


def module_texts() -> dict[str, tuple[str, bool]]:
    """specdec's modules: name -> (source text, whether it is a package's __init__)."""
    modules = {}
    for path in (SOURCE / "specdec").rglob("*.py"):
        parts = list(path.relative_to(SOURCE).with_suffix("").parts)
        package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if package else parts)] = (path.read_text(), package)
    return modules


def import_graph(modules: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """module -> the specdec modules it imports anywhere in its text."""
    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, (text, is_package) in modules.items():
        package = module if is_package else module.rpartition(".")[0]
        targets = []
        for node in ast.walk(ast.parse(text, module)):
            if isinstance(node, ast.Import):
                targets += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, level - 1 packages up
                    parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                targets += [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                            for alias in node.names]
        graph[module] = {known(target) for target in targets if target.startswith("specdec")} - {None, module}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = counter
                    counter += 1
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph[successor]))))
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_no_module_imports_itself_back_through_others():
    graph = import_graph(module_texts())
    assert len(graph) > 50 and "specdec.models.native.model" in graph["specdec.models.native.runner"]
    assert circles(graph) == []


RUNTIME = ("planning", "sampling", "models", "proposers", "engine")
RESEARCH = ("analysis", "bench", "training")
ABOVE_RUNTIME = (*RESEARCH, "server", "factory", "api", "cli", "cli_options", "costs_cli", "demo", "doctor",
                 "generate_cli", "replay_cli", "research_cli", "serve_cli", "train_cli")


def in_layer(module: str, layer: tuple[str, ...]) -> bool:
    return any(module == f"specdec.{name}" or module.startswith(f"specdec.{name}.") for name in layer)


def upward_imports(graph: dict[str, set[str]], layer: tuple[str, ...], above: tuple[str, ...]) -> dict:
    return {module: sorted(target for target in targets if in_layer(target, above))
            for module, targets in graph.items() if in_layer(module, layer) and any(in_layer(t, above) for t in targets)}


def test_the_runtime_never_imports_the_layers_above_it():
    """What decodes (down to the k it drafts) must not need what measures it or what calls it:
    adaptive k and tree budgets read planning/, which analysis/ reads too. The server, a front
    door, builds engines through the factory but never needs the research layers."""
    graph = import_graph(module_texts())
    assert "specdec.planning.theory" in graph["specdec.engine.adaptive"]
    assert upward_imports(graph, RUNTIME, ABOVE_RUNTIME) == {}
    assert upward_imports(graph, ("server",), RESEARCH) == {}
    assert in_layer("specdec.analysis.replay", ABOVE_RUNTIME) and not in_layer("specdec.cli_x", ABOVE_RUNTIME)


def test_the_research_layers_point_one_way():
    """analysis/ (replay, prediction, endpoint checks) reads bench/'s runs, prompts and OpenAI client;
    bench/ never reads analysis/: one arrow, so either can change below the other's line."""
    graph = import_graph(module_texts())
    assert "specdec.bench.openai_client" in graph["specdec.analysis.endpoint_verify"]
    assert upward_imports(graph, ("bench",), ("analysis",)) == {}


def test_a_circle_hidden_in_a_function_is_found():
    texts = {"specdec.a": ("from specdec.b import f\n", False),
             "specdec.b": ("def g():\n    from specdec.pkg import c\n", False),
             "specdec.pkg": ("", True),
             "specdec.pkg.c": ("from . import d\nimport specdec.a\n", False),
             "specdec.pkg.d": ("", False)}
    graph = import_graph(texts)
    assert graph == {"specdec.a": {"specdec.b"}, "specdec.b": {"specdec.pkg.c"}, "specdec.pkg": set(),
                     "specdec.pkg.c": {"specdec.pkg.d", "specdec.a"}, "specdec.pkg.d": set()}
    assert circles(graph) == [["specdec.a", "specdec.b", "specdec.pkg.c"]]
