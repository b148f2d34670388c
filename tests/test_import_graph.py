"""Floors without loops: the import graph of ``dshim``, drawn from the source.

Every ``import`` of a dshim module counts -- at module level, inside a function (a lazy
import) and under ``if TYPE_CHECKING:`` -- because each is a dependency a reader has to
follow.  Two rules keep the house in order:

- **no cycles**: no strongly connected component of more than one module;
- **floors**: every module sits on a floor and imports only from its own floor or
  below.  A new module must be placed (an unplaced one fails), so the table below is
  the map of the house.

``from pkg import sub`` of a submodule is an arrow to the submodule.  Importing
``pkg.sub`` runs ``pkg/__init__.py`` first, so it is an arrow to the package ``pkg`` as
well -- a package's ``__init__`` counts as the package, and what it imports (eagerly or
in a function) is a dependency of every module that imports anything inside it.  The
packages a module itself sits in are not counted: they are running already when it is
imported.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "dshim"

#: (floor, module pattern): the first pattern that matches a module's name places it.  A
#: package whose ``__init__`` imports nothing of dshim (``dshim``, ``dshim.channels``,
#: ``dshim.net`` ...) is only a folder: it is on the ground floor without a row here.
FLOORS: list[tuple[int, str]] = [
    # Ground: errors, the model (with the backend history a quote recovery reads), text
    # helpers, the network client and websocket runner, the HTTP types, the channel specs
    # (key, starter block, token patterns ...).
    (0, r"dshim\.(errors|backoff|model|text|metrics)"),
    (0, r"dshim\.net\..+|dshim\.http\.types"),
    (0, r"dshim\.channels\.spec|dshim\.channels\.\w+\.spec"),
    # Configuration and the store.
    (1, r"dshim\.config|dshim\.store(\..+)?"),
    # The leases of a shared store (what serve runs its bots under).
    (2, r"dshim\.(leases|sharing)"),
    # The contracts and engines everything above is written against, and what needs only
    # them: logging set-up (it redacts the tokens the channel specs name, so it reads the
    # registry), the normalized form of raw events, replay's output lines.
    (2, r"dshim\.channels\.(base|registry)|dshim\.channels\.kit(\..+)?"),
    (2, r"dshim\.(outbound|render|prompt|reply|log|normalized|lines)|dshim\.streams\..+"),
    (2, r"dshim\.harness\.(base|httpio)"),
    # The parts: channels, harnesses, the pipeline and the capture it feeds.
    (3, r"dshim\.channels\.\w+(\.\w+)?|dshim\.harness(\.\w+(\.\w+)?)?"),
    (3, r"dshim\.pipeline(\..+)?|dshim\.capture"),
    # What runs the parts: the HTTP endpoint, probe, replay (with the recording outbound
    # it replays into), serve.
    (4, r"dshim\.http\.\w+|dshim\.(probe|replay|serve)|dshim\.testing\.outbound"),
    # Entry points and test support.
    (5, r"dshim\.(launch|entry|cli|docs_config|__main__)|dshim\.testing\..+"),
]


def module_names(root: Path) -> dict[str, Path]:
    """Every module of the package under ``root`` by dotted name (``pkg`` for
    ``pkg/__init__.py``)."""
    names: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _resolve(name: str, modules: Mapping[str, object]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _packages(name: str) -> set[str]:
    """The packages ``name`` sits in (``a.b.c`` -> ``a``, ``a.b``)."""
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def import_graph(modules: Mapping[str, Path]) -> dict[str, set[str]]:
    """Module -> the dshim modules it imports (anywhere in its source)."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: list[str] = []
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*up, base] if base else up)
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    targets.append(full if full in modules else base)
        found = {
            module
            for target in targets
            if target.split(".")[0] == "dshim" and (module := _resolve(target, modules)) is not None
        }
        # Importing a module runs its packages' __init__ first (the importer's own
        # packages are running already).
        found |= {package for module in found for package in _packages(module)}
        graph[name] = {m for m in found if m in modules} - _packages(name) - {name}
    return graph


def cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
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


def floor_of(module: str, floors: list[tuple[int, str]] = FLOORS) -> int | None:
    for floor, pattern in floors:
        if re.fullmatch(pattern, module):
            return floor
    return None


def placed(
    graph: Mapping[str, Iterable[str]], floors: list[tuple[int, str]] = FLOORS
) -> dict[str, int | None]:
    """Every module's floor: a package that imports nothing is a folder (floor 0), any
    other module is placed by ``floors`` (None: not placed)."""
    out: dict[str, int | None] = {}
    for module in graph:
        is_folder = not graph[module] and any(m.startswith(f"{module}.") for m in graph)
        out[module] = 0 if is_folder else floor_of(module, floors)
    return out


def arrows_up(
    graph: Mapping[str, Iterable[str]], floors: list[tuple[int, str]] = FLOORS
) -> list[str]:
    """``a (n) -> b (m)`` for every import of a higher floor's module."""
    floor = placed(graph, floors)
    out = []
    for module in sorted(graph):
        here = floor[module]
        for target in sorted(graph[module]):
            there = floor.get(target)
            if here is not None and there is not None and there > here:
                out.append(f"{module} ({here}) -> {target} ({there})")
    return out


# --- the rules on dshim ------------------------------------------------------------------


GRAPH = import_graph(module_names(PACKAGE))


def test_the_graph_is_drawn_from_the_whole_package() -> None:
    # Sanity of the drawing itself: known arrows of each kind are there.
    assert "dshim.channels.base" in GRAPH["dshim.channels.telegram.channel"]  # module level
    assert "dshim.http.types" in GRAPH["dshim.channels.base"]
    assert "dshim.harness.echo" in GRAPH["dshim.harness"]  # lazy, in a function
    assert "dshim.capture" in GRAPH["dshim.pipeline.turn"]  # under TYPE_CHECKING
    assert "dshim.store" in GRAPH["dshim.capture"]  # the package of dshim.store.base
    assert "dshim.harness" not in GRAPH["dshim.harness.echo"]  # its own package
    assert len(GRAPH) > 150


def test_no_module_imports_itself_back() -> None:
    assert cycles(GRAPH) == [], "import cycles: " + "; ".join(
        " <-> ".join(c) for c in cycles(GRAPH)
    )


def test_every_module_has_a_floor() -> None:
    assert [m for m, floor in sorted(placed(GRAPH).items()) if floor is None] == []


def test_no_module_imports_from_a_higher_floor() -> None:
    assert arrows_up(GRAPH) == []


def test_the_folders_are_the_packages_that_import_nothing() -> None:
    # dshim.channels says so in its docstring: importing a channel's spec costs nothing.
    folders = [m for m, floor in placed(GRAPH).items() if floor == 0 and floor_of(m) is None]
    assert {"dshim", "dshim.channels", "dshim.net", "dshim.testing"} <= set(folders)
    assert "dshim.harness" not in folders and "dshim.pipeline" not in folders


# --- the checks check ----------------------------------------------------------------------


def test_a_cycle_through_a_lazy_or_type_checking_import_is_found(tmp_path: Path) -> None:
    pkg = tmp_path / "dshim"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from dshim import b\n")
    (pkg / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from dshim.sub.c import X\n"
    )
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("def f():\n    from ..a import g\n")
    graph = import_graph(module_names(pkg))
    assert graph["dshim.a"] == {"dshim.b"}
    assert graph["dshim.sub.c"] == {"dshim.a"}
    assert cycles(graph) == [["dshim.a", "dshim.b", "dshim.sub.c"]]


def test_an_arrow_up_is_reported_with_both_floors() -> None:
    floors = [(0, r"low"), (1, r"high")]
    graph = {"low": {"high"}, "high": {"low"}}
    assert arrows_up(graph, floors) == ["low (0) -> high (1)"]
    assert floor_of("elsewhere", floors) is None


def test_importing_inside_a_package_depends_on_its_init(tmp_path: Path) -> None:
    # pkg/__init__ builds its adapters lazily; one adapter needs a module that reaches
    # for pkg.base: through pkg/__init__ that is a cycle, though no module names another
    # twice.
    pkg = tmp_path / "dshim"
    (pkg / "pkg").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "pkg" / "__init__.py").write_text("def make():\n    from dshim.pkg.impl import I\n")
    (pkg / "pkg" / "base.py").write_text("")
    (pkg / "pkg" / "impl.py").write_text("from dshim.pkg import base\nfrom dshim import low\n")
    (pkg / "low.py").write_text("from dshim.pkg.base import B\n")
    graph = import_graph(module_names(pkg))
    assert graph["dshim.low"] == {"dshim.pkg", "dshim.pkg.base"}
    assert graph["dshim.pkg.impl"] == {"dshim.pkg.base", "dshim.low"}  # not its own package
    assert cycles(graph) == [["dshim.low", "dshim.pkg", "dshim.pkg.impl"]]
    floors = [(0, r"dshim\.low"), (1, r"dshim\.pkg(\..+)?")]
    assert placed(graph, floors)["dshim"] == 0  # a folder
    assert arrows_up(graph, floors) == [
        "dshim.low (0) -> dshim.pkg (1)",
        "dshim.low (0) -> dshim.pkg.base (1)",
    ]
