"""Generate docs/configuration.md from the configuration structs.

Run ``python -m dshim.docs_config --write`` after changing a key of ``dshim.toml`` (a
struct in :mod:`dshim.config` or a channel's settings struct); without ``--write`` the
page goes to stdout.  ``tests/test_docs.py`` fails when the page in the repository is not
what this module produces.

A key's meaning is the ``#:`` comment right above its field (the Sphinx convention for
attribute docs).  Comments are not part of a class at run time, so they are read from
the source with :mod:`inspect` and :mod:`ast`; a field without one is an error, so a new
key cannot reach the page undocumented.

:func:`schema` gives the same walk as data (table path -> keys) for the docs checks,
which compare every key a ``toml`` example names with it.
"""

from __future__ import annotations

import ast
import functools
import inspect
import operator
import re
import sys
import textwrap
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import msgspec

from dshim import config as cfg

PAGE = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
REGENERATE = "python -m dshim.docs_config --write"

#: The environment variables dshim reads itself (besides ``"${NAME}"`` references).
ENVIRONMENT = (
    ("DSHIM_CONFIG", "the config file, like `--config PATH` (default: `./dshim.toml`)"),
    ("DSHIM_DATA_DIR", "the data directory, like `--data-dir PATH`; wins over `[dshim] data_dir`"),
    ("DSHIM_HTTP_LISTEN", "`serve --listen HOST:PORT`: overrides `[http] listen`"),
    ("DSHIM_STORE_URL", "the PostgreSQL store's URL; wins over `[store] url`"),
    (
        "XDG_STATE_HOME",
        "the default data directory is `$XDG_STATE_HOME/dshim` (else `~/.local/state/dshim`)",
    ),
)

#: Top-level sections, in the order of the page.
SECTIONS: tuple[tuple[str, type[msgspec.Struct]], ...] = (
    ("dshim", cfg.DshimSection),
    ("http", cfg.HttpSection),
    ("store", cfg.StoreSection),
    ("harness", cfg.HarnessConfig),
)


class UndocumentedKey(Exception):
    """A configuration field has no ``#:`` comment."""


@dataclass
class Table:
    """One TOML table of the page: its header, its struct and its rows."""

    header: str  # "[http]", "[[bots]]", "[bots.access]", "[[bots.substitute.targets]]"
    path: str  # "http", "bots", "bots.access", "bots.substitute.targets"
    doc: str
    rows: list[tuple[str, str, str, str]] = field(default_factory=list)
    open_keys: set[str] = field(default_factory=set)  # tables of free keys (harness.env)


# --- reading the structs ----------------------------------------------------------------------


def field_comments(struct: type[msgspec.Struct]) -> dict[str, str]:
    """The ``#:`` comment above each field of ``struct`` (joined into one line)."""
    source = textwrap.dedent(inspect.getsource(struct))
    lines = source.splitlines()
    tree = ast.parse(source)
    node = tree.body[0]
    assert isinstance(node, ast.ClassDef)
    out: dict[str, str] = {}
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        comment: list[str] = []
        i = stmt.lineno - 2  # the line above the field (lineno is 1-based)
        while i >= 0 and lines[i].strip().startswith("#:"):
            comment.insert(0, lines[i].strip()[2:].strip())
            i -= 1
        if comment:
            out[stmt.target.id] = " ".join(comment)
    return out


def _strip_none(tp: Any) -> tuple[Any, bool]:
    """``X | None`` -> (X, True)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) < len(typing.get_args(tp)):
            return (args[0] if len(args) == 1 else functools.reduce(operator.or_, args)), True
    return tp, False


def _is_struct(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, msgspec.Struct)


def _nested(tp: Any) -> tuple[type[msgspec.Struct], bool] | None:
    """(struct, is_array) when the field is a sub-table or an array of tables."""
    tp, _ = _strip_none(tp)
    if _is_struct(tp):
        return tp, False
    if typing.get_origin(tp) is list and _is_struct(typing.get_args(tp)[0]):
        return typing.get_args(tp)[0], True
    return None


def describe_type(tp: Any) -> str:
    """A field's type in TOML words."""
    tp, _ = _strip_none(tp)
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " \\| ".join(_toml(v) for v in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe_type(a) for a in typing.get_args(tp))
    if tp is cfg.Secret:
        return "string (secret)"
    if origin is list:
        return "array of " + _plural(describe_type(typing.get_args(tp)[0]))
    if origin is dict:
        return "table of " + _plural(describe_type(typing.get_args(tp)[1]))
    names = {str: "string", bool: "boolean", int: "integer", float: "number"}
    if tp in names:
        return names[tp]
    if _is_struct(tp):
        return "table"
    raise TypeError(f"no TOML name for {tp!r}")


def _plural(word: str) -> str:
    if " or " in word or "\\|" in word:
        return word.replace("string or integer", "strings or integers")
    return word + "s"


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return (
            "{ " + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + " }"
            if value
            else "{}"
        )
    raise TypeError(f"no TOML form for {value!r}")


def describe_default(info: msgspec.structs.FieldInfo) -> str:
    if info.required:
        return "**required**"
    if info.default is not msgspec.NODEFAULT:
        value = info.default
    else:
        value = info.default_factory()
    if value is None:
        return "unset"
    return "`" + _toml(value).replace("|", "\\|") + "`"


_ROLE = re.compile(r":(?P<role>[a-z]+):`~?(?P<name>[^`]+)`")


def markdown(text: str, module: types.ModuleType) -> str:
    """A ``#:`` comment or docstring in Markdown: ``code`` becomes `code`; a
    :data:`NAME` reference becomes the constant's value, other roles the plain name."""

    def role(m: re.Match[str]) -> str:
        name = m.group("name")
        if m.group("role") == "data" and hasattr(module, name):
            return str(getattr(module, name))
        return "`" + name.rsplit(".", 1)[-1] + "`"

    text = _ROLE.sub(role, text).replace("``", "`")
    return " ".join(text.split())


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


# --- walking ------------------------------------------------------------------------------------


def tables_of(
    struct: type[msgspec.Struct],
    path: str,
    *,
    array: bool = False,
    skip: frozenset[str] = frozenset(),
) -> list[Table]:
    """``struct`` as a table at ``path`` followed by its sub-tables (depth first)."""
    module = sys.modules[struct.__module__]
    comments = {k: markdown(v, module) for k, v in field_comments(struct).items()}
    header = f"[[{path}]]" if array else f"[{path}]"
    doc = markdown(inspect.cleandoc(struct.__doc__), module) if struct.__doc__ else ""
    if doc.startswith(f"`{header}`: "):
        doc = doc[len(header) + 4 :]
        doc = doc[:1].upper() + doc[1:]
    table = Table(header=header, path=path, doc=doc)
    below: list[Table] = []
    for info in msgspec.structs.fields(struct):
        if info.name in skip:
            continue
        if info.name not in comments:
            where = f"{struct.__module__}.{struct.__qualname__}.{info.name}"
            raise UndocumentedKey(
                f"{where}: add a `#:` comment above the field saying what it means"
            )
        nested = _nested(info.type)
        if nested is not None:
            sub, sub_array = nested
            below.extend(tables_of(sub, f"{path}.{info.encode_name}", array=sub_array))
            kind = "array of tables" if sub_array else "table"
            where = (
                f"`[[{path}.{info.encode_name}]]`"
                if sub_array
                else f"`[{path}.{info.encode_name}]`"
            )
            table.rows.append((info.encode_name, kind, f"see {where}", comments[info.name]))
            continue
        if typing.get_origin(_strip_none(info.type)[0]) is dict:
            table.open_keys.add(info.encode_name)
        table.rows.append(
            (
                info.encode_name,
                describe_type(info.type),
                describe_default(info),
                comments[info.name],
            )
        )
    return [table, *below]


def channel_settings() -> list[tuple[str, type[msgspec.Struct]]]:
    """(key, settings struct) of every channel of the registry."""
    from dshim.channels.registry import CHANNEL_KEYS, settings_for

    return [(key, settings_for(key)) for key in CHANNEL_KEYS]


def bot_tables() -> list[Table]:
    """``[[bots]]``'s shared keys and their sub-tables."""
    return tables_of(cfg.BotConfig, "bots", array=True, skip=frozenset({"settings"}))


def schema() -> dict[str, Any]:
    """The keys the structs accept, as data for the docs checks::

        {"tables": {"dshim": {...}, "bots": {shared keys}, "bots.access": {...}, ...},
         "open": {"harness.env", ...},
         "channels": {"telegram": {"bots": {...}, "bots.welcome": {...}}, ...}}

    A table path maps to its keys (a sub-table's name is a key of its parent); ``open``
    names tables whose keys are free (``[harness] env``).
    """
    tables: dict[str, set[str]] = {"": {name for name, _ in SECTIONS} | {"bots"}}
    open_paths: set[str] = set()
    for name, struct in SECTIONS:
        for t in tables_of(struct, name):
            tables[t.path] = {r[0] for r in t.rows}
            open_paths |= {f"{t.path}.{k}" for k in t.open_keys}
    for t in bot_tables():
        tables[t.path] = {r[0] for r in t.rows}
        open_paths |= {f"{t.path}.{k}" for k in t.open_keys}
    channels: dict[str, dict[str, set[str]]] = {}
    for key, struct in channel_settings():
        own: dict[str, set[str]] = {}
        for t in tables_of(struct, "bots"):
            own[t.path] = {r[0] for r in t.rows}
            open_paths |= {f"{t.path}.{k}" for k in t.open_keys}
        channels[key] = own
    return {"tables": tables, "open": open_paths, "channels": channels}


# --- the page ---------------------------------------------------------------------------------

INTRO = """\
# Configuration reference

<!-- Generated by `{regenerate}` from the structs in dshim/config.py and each
channel's settings struct; do not edit by hand (tests/test_docs.py fails when it differs). -->

dshim reads one TOML file: `--config PATH`, else `$DSHIM_CONFIG`, else `./dshim.toml`.
Without a file, `dshim serve` runs the built-in default (the echo harness and one web chat
bot named `web` on <http://127.0.0.1:8910/>); `dshim init` writes a commented starter
file. Every key below is optional unless its default says **required**; an unknown key, a
missing required key or a value of the wrong type stops dshim at start with an error that
names the file and the key path (exit code 2), for example
`dshim: dshim.toml: bots[0].access.mode: expected "open" or "allowlist", got "safe"`.

A number of seconds (`*_s`) may be written as an integer or with a fraction.

## Secrets and environment variables

A string value that is exactly `"${{NAME}}"` is replaced by the environment variable
`NAME` when the file loads; an unset or empty variable is an error naming the key. Write
every credential this way (`token = "${{TELEGRAM_BOT_TOKEN}}"`), never in the file.
Values of the type *string (secret)* never appear in logs, errors or `dshim probe`
output.

dshim also reads these variables itself:

| variable | meaning |
|---|---|
"""

BOTS_INTRO = """\
## Bots

Each `[[bots]]` table is one bot. Its keys are the shared keys below plus the keys of its
channel (`channel = "..."`), listed per channel further down; the sub-tables
(`[bots.access]`, `[bots.reply]` ...) belong to the `[[bots]]` table written above them.

```toml
[[bots]]
name = "tg"
channel = "telegram"
token = "${TELEGRAM_BOT_TOKEN}"

[bots.access]
mode = "allowlist"
users = ["12345678"]
```
"""

CHANNELS_INTRO = """\
## Channel keys

The keys a `[[bots]]` table takes besides the shared ones, by channel. The set-up of each
platform is in [docs/channels/](channels/).
"""


def _table_md(t: Table, level: str) -> list[str]:
    out = [f"{level} `{t.header}`", ""]
    if t.doc:
        out += [t.doc, ""]
    out += ["| key | type | default | meaning |", "|---|---|---|---|"]
    for key, kind, default, meaning in t.rows:
        out.append(f"| `{key}` | {kind} | {default} | {_cell(meaning)} |")
    out.append("")
    return out


def render() -> str:
    """The whole page."""
    lines = [INTRO.format(regenerate=REGENERATE).rstrip("\n")]
    for name, meaning in ENVIRONMENT:
        lines.append(f"| `{name}` | {_cell(meaning)} |")
    lines.append("")
    for name, struct in SECTIONS:
        for i, t in enumerate(tables_of(struct, name)):
            lines += _table_md(t, "##" if i == 0 else "###")
    lines.append(BOTS_INTRO)
    for i, t in enumerate(bot_tables()):
        if i == 0:
            t.doc = ""  # the section's introduction says it
        lines += _table_md(t, "###")
    lines.append(CHANNELS_INTRO)
    for key, struct in channel_settings():
        tables = tables_of(struct, "bots")
        first, rest = tables[0], tables[1:]
        lines += [f'### `channel = "{key}"`', ""]
        if first.doc:
            lines += [first.doc + f" Set-up: [channels/{key}.md](channels/{key}.md).", ""]
        lines += ["| key | type | default | meaning |", "|---|---|---|---|"]
        for k, kind, default, meaning in first.rows:
            lines.append(f"| `{k}` | {kind} | {default} | {_cell(meaning)} |")
        lines.append("")
        for t in rest:
            lines += _table_md(t, "####")
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    try:
        page = render()
    except UndocumentedKey as exc:
        print(f"dshim.docs_config: {exc}", file=sys.stderr)
        return 1
    if args == ["--write"]:
        PAGE.write_text(page, encoding="utf-8")
        print(f"wrote {PAGE}", file=sys.stderr)
    elif not args:
        sys.stdout.write(page)
    else:
        print("usage: python -m dshim.docs_config [--write]", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
