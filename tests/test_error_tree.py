"""The error tree drawn in ``dshim/errors.py`` is the tree the code defines.

Every dshim module is imported (``dshim.__main__`` would run the CLI), then every
``DshimError`` subclass must appear in the drawing under its own base and with its own
module, and every class the drawing names must exist there.  The exception classes of
dshim outside the tree must be the ones its "Outside the tree" list names.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from collections.abc import Iterator

import dshim
import dshim.errors
from dshim.errors import DshimError

#: (class name, module) -> the name of its base in the tree (None for the root).
Tree = dict[tuple[str, str], str | None]

_CONNECTOR = re.compile(r"(├── |└── )(\w+)(?:\s+\[([\w.]+)\])?")
_OUTSIDE = re.compile(r"^\* ([\w, ]+) \[([\w.]+)\] — ")


def _modules() -> list[str]:
    names = [
        info.name
        for info in pkgutil.walk_packages(dshim.__path__, "dshim.")
        if info.name != "dshim.__main__"
    ]
    for name in names:
        importlib.import_module(name)
    return names


def _module(bracket: str | None) -> str:
    """The module a drawn ``[bracket]`` names: under dshim.channels, else under dshim."""
    if bracket is None:
        return "dshim.errors"
    for candidate in (f"dshim.channels.{bracket}", f"dshim.{bracket}"):
        try:
            importlib.import_module(candidate)
        except ModuleNotFoundError:
            continue
        return candidate
    return f"dshim.{bracket}"  # no such module: reported as a drawn class that does not exist


def _docstring() -> str:
    doc = dshim.errors.__doc__
    assert doc is not None
    return doc


def drawn_tree() -> Tree:
    lines = _docstring().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "DshimError")
    root_indent = lines[start].index("DshimError")
    tree: Tree = {("DshimError", "dshim.errors"): None}
    parents = ["DshimError"]  # parents[depth]: the last class drawn at that depth
    for line in lines[start + 1 :]:
        if not line.strip():
            break
        found = _CONNECTOR.search(line)
        if found is None:
            continue  # the continuation of a description
        depth = (found.start() - root_indent) // 4 + 1
        name, module = found.group(2), _module(found.group(3))
        assert (name, module) not in tree, f"{name} [{module}] is drawn twice"
        tree[(name, module)] = parents[depth - 1]
        del parents[depth:]
        parents.append(name)
    return tree


def _subclasses(cls: type[BaseException]) -> Iterator[type[BaseException]]:
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def defined_tree() -> Tree:
    _modules()
    tree: Tree = {("DshimError", "dshim.errors"): None}
    for cls in _subclasses(DshimError):
        base = next(b for b in cls.__bases__ if issubclass(b, DshimError))
        tree[(cls.__qualname__, cls.__module__)] = base.__qualname__
    return tree


def test_every_dshim_error_is_drawn_under_its_base() -> None:
    drawn, defined = drawn_tree(), defined_tree()
    missing = sorted(f"{n} [{m}]" for n, m in defined.keys() - drawn.keys())
    extra = sorted(f"{n} [{m}]" for n, m in drawn.keys() - defined.keys())
    moved = sorted(
        f"{n} [{m}]: drawn under {drawn[(n, m)]}, defined under {defined[(n, m)]}"
        for n, m in drawn.keys() & defined.keys()
        if drawn[(n, m)] != defined[(n, m)]
    )
    assert (missing, extra, moved) == ([], [], []), (
        "dshim/errors.py draws the error tree: add the missing classes, drop the extra ones"
    )


def test_drawn_tree_is_not_empty() -> None:
    # A drawing the parser cannot read would make the test above compare nothing.
    tree = drawn_tree()
    assert len(tree) > 40
    assert tree[("Deleted", "dshim.errors")] == "NotFound"
    assert tree[("Throttled", "dshim.channels.whatsapp.protocol")] == "TransportError"


def test_exceptions_outside_the_tree_are_the_listed_ones() -> None:
    listed: set[tuple[str, str]] = set()
    for line in _docstring().splitlines():
        found = _OUTSIDE.match(line)
        if found is not None:
            module = _module(found.group(2))
            listed |= {(name.strip(), module) for name in found.group(1).split(",")}
    assert listed, "the drawing lists no class outside the tree"
    _modules()
    outside = set()
    for cls in _subclasses(BaseException):
        module = cls.__module__
        if not module.startswith("dshim.") or module.startswith("dshim.testing"):
            continue
        if cls.__name__.startswith("_") or issubclass(cls, DshimError):
            continue
        outside.add((cls.__qualname__, module))
    assert sorted(outside) == sorted(listed)
