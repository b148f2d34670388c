"""The documentation against the code: what a reader follows must exist.

- docs/configuration.md is what ``python -m dshim.docs_config`` generates from the structs;
- every channel of the registry has its docs/channels/<channel>.md page;
- every relative link of README.md and docs/**/*.md, and every repository path in inline
  code or a shell block (`dshim/config.py`, `python scripts/bench_harness.py`), names a
  file or folder that exists;
- every key a ``toml`` example writes (also commented out, ``# key = value``) is a key the
  structs accept in that table; in a ``[[bots]]`` table, the shared keys plus those of the
  channel its ``channel = "..."`` names (all channels' when it names none);
- the commands of ``dshim --help`` are the commands README's command-line section
  documents as ``dshim <command>``.

The checkers are plain functions returning one line per problem, so each is also tested
here on a small page that breaks it (a check that cannot fail checks nothing).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import msgspec
import pytest

from dshim import docs_config
from dshim.channels.registry import CHANNEL_KEYS

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
#: Top-level folders of the repository: a backticked path starting with one is checked.
REPO_DIRS = ("dshim", "tests", "scripts", "docs", "fixtures", ".ci")


def pages() -> list[Path]:
    """README.md and every page under docs/ (whatever exists now)."""
    found = [README] if README.exists() else []
    return found + sorted((REPO / "docs").rglob("*.md"))


def page_ids(paths: list[Path]) -> list[str]:
    return [str(p.relative_to(REPO)) for p in paths]


# --- reading markdown -----------------------------------------------------------------------

_FENCE = re.compile(r"^\s*(```+|~~~+)\s*([A-Za-z0-9_+-]*)")


def lines_of(text: str) -> Iterator[tuple[int, str, str | None]]:
    """(line number, line, the fenced block's language or None outside code)."""
    fence: str | None = None
    lang = ""
    for n, line in enumerate(text.splitlines(), 1):
        m = _FENCE.match(line)
        if fence is None and m:
            fence, lang = m.group(1), m.group(2).lower()
            continue
        if fence is not None and line.strip().startswith(fence[:3]) and not line.strip()[3:]:
            fence = None
            continue
        yield n, line, (lang if fence is not None else None)


_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REF_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)")
SHELL_LANGS = ("sh", "bash", "shell", "console")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
_REPO_PATH = re.compile(
    r"^(?:\./)?((?:" + "|".join(re.escape(d) for d in REPO_DIRS) + r")/[A-Za-z0-9_./-]*)(?::\d+)?$"
)


def broken_links(page: Path, text: str) -> list[str]:
    """Relative links and backticked repository paths of ``page`` that name nothing."""
    out: list[str] = []
    where = page.relative_to(REPO) if page.is_relative_to(REPO) else page
    for n, line, lang in lines_of(text):
        if lang is not None:
            if lang in SHELL_LANGS:  # `python scripts/bench_harness.py` in a command
                for word in line.split():
                    m = _REPO_PATH.match(word.strip("'\"`(),;"))
                    if m and not (REPO / m.group(1)).exists():
                        out.append(f"{where}:{n}: {m.group(1)} does not exist")
            continue
        for span in _CODE_SPAN.finditer(line):
            for word in span.group(2).split():
                m = _REPO_PATH.match(word.strip("'\"(),;"))
                if m and not (REPO / m.group(1)).exists():
                    out.append(f"{where}:{n}: `{m.group(1)}` does not exist")
        prose = _CODE_SPAN.sub("", line)
        targets = [m.group(1) for m in _LINK.finditer(prose)]
        ref = _REF_LINK.match(prose)
        if ref:
            targets.append(ref.group(1))
        for target in targets:
            if _SCHEME.match(target) or target.startswith("#"):
                continue
            path = unquote(target.split("#", 1)[0].split("?", 1)[0])
            if not path:
                continue
            resolved = (REPO / path.lstrip("/")) if path.startswith("/") else page.parent / path
            resolved = Path(os.path.normpath(resolved))
            if not resolved.exists():
                out.append(f"{where}:{n}: link to {target} names a file that does not exist")
    return out


# --- toml examples --------------------------------------------------------------------------

_HEADER = re.compile(r"^\s*#?\s*(\[\[?)\s*([A-Za-z0-9_.-]+)\s*\]\]?\s*(?:#.*)?$")
_KEY = re.compile(r"^\s*#?\s*([A-Za-z_][A-Za-z0-9_-]*(?:\.[A-Za-z_][A-Za-z0-9_-]*)*)\s*=(?!=)\s*\S")
_CHANNEL = re.compile(r"^\s*#?\s*channel\s*=\s*\"([^\"]*)\"")
TOP_TABLES = ("dshim", "http", "harness", "bots")


def toml_blocks(text: str) -> Iterator[list[tuple[int, str]]]:
    """The ```toml blocks of a page, as (line number, line) lists."""
    block: list[tuple[int, str]] = []
    last = 0
    for n, line, lang in lines_of(text):
        if lang == "toml":
            if block and n != last + 1:
                yield block
                block = []
            block.append((n, line))
            last = n
        elif block:
            yield block
            block = []
    if block:
        yield block


def unknown_keys(where: str, block: list[tuple[int, str]], schema: dict[str, Any]) -> list[str]:
    """Keys (and tables) of one toml example that ``dshim.toml`` does not have.

    A block whose tables are all outside dshim.toml (or that has no table header at all)
    is not checked: it is another program's file or a fragment.
    """
    entries: list[tuple[int, str, str]] = []  # (line, "header" | "array" | "key", name)
    in_string = False
    for n, line in block:
        if line.count('"""') % 2 or line.count("'''") % 2:
            in_string = not in_string
            continue
        if in_string:
            continue
        header = _HEADER.match(line)
        if header:
            entries.append((n, "array" if header.group(1) == "[[" else "header", header.group(2)))
            continue
        key = _KEY.match(line)
        if key:
            entries.append((n, "key", key.group(1)))
    headers = [name for _, kind, name in entries if kind != "key"]
    if not any(h.split(".")[0] in TOP_TABLES for h in headers):
        return []
    tables: dict[str, set[str]] = schema["tables"]
    channels: dict[str, dict[str, set[str]]] = schema["channels"]

    # Which channel each [[bots]] table names (and its sub-tables inherit).
    bot_of_line: dict[int, int] = {}
    channel_of_bot: dict[int, str | None] = {}
    bot = -1
    for n, kind, name in entries:
        if kind == "array" and name == "bots":
            bot += 1
            channel_of_bot[bot] = None
        elif kind != "key" and name.split(".")[0] != "bots":
            bot = -1
        bot_of_line[n] = bot
    for n, line in block:
        m = _CHANNEL.match(line)
        if m and bot_of_line.get(n, -1) >= 0:
            channel_of_bot[bot_of_line[n]] = m.group(1)

    def allowed(path: str, bot_index: int) -> set[str] | None:
        keys = set(tables.get(path, set()))
        if path == "bots" or path.startswith("bots."):
            named = channel_of_bot.get(bot_index)
            if named in channels:
                keys |= channels[named].get(path, set())
            elif named is None:
                for own in channels.values():
                    keys |= own.get(path, set())
            if path == "bots" or path in tables or any(path in c for c in channels.values()):
                return keys
            return None
        return keys if path in tables else None

    def known_table(name: str, bot_index: int) -> bool:
        if name in schema["open"]:
            return True
        parent, _, last = name.rpartition(".")
        if not parent:
            return name in tables[""]
        above = allowed(parent, bot_index)
        return above is not None and last in above and allowed(name, bot_index) is not None

    out: list[str] = []
    section: str | None = ""
    for n, kind, name in entries:
        b = bot_of_line[n]
        if kind != "key":
            section = name if known_table(name, b) else None
            if section is None:
                out.append(f"{where}:{n}: [{name}] is not a table of dshim.toml")
            continue
        if section is None:
            continue  # its table is already reported
        *dotted, key = name.split(".")
        path = ".".join(p for p in (section, *dotted) if p)
        if path in schema["open"] or any(path.startswith(o + ".") for o in schema["open"]):
            continue
        if dotted and not known_table(path, b):
            out.append(f"{where}:{n}: {name}: no such table in [{section or '(top level)'}]")
            continue
        keys = allowed(path, b) or set()
        if key not in keys:
            named = channel_of_bot.get(b) if path.split(".")[0] == "bots" else None
            of = f' with channel = "{named}"' if named else ""
            out.append(f"{where}:{n}: {key}: no such key in [{path or '(top level)'}]{of}")
    return out


def toml_problems(page: Path, text: str, schema: dict[str, Any]) -> list[str]:
    where = str(page.relative_to(REPO) if page.is_relative_to(REPO) else page)
    out: list[str] = []
    for block in toml_blocks(text):
        out += unknown_keys(where, block, schema)
    return out


# --- the command line -----------------------------------------------------------------------


def cli_commands() -> set[str]:
    """The commands ``dshim --help`` lists."""
    env = {**os.environ, "COLUMNS": "200", "TERM": "dumb", "NO_COLOR": "1"}
    r = subprocess.run(
        [sys.executable, "-m", "dshim", "--help"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=True,
    )
    found: set[str] = set()
    listing = False
    for line in r.stdout.splitlines():
        plain = line.strip(" │|╭╮╰╯─")
        if re.match(r"^Commands\b", plain):
            listing = True
            continue
        if listing:
            m = re.match(r"^([a-z][a-z0-9-]*)(?:\s{2,}|$)", plain)
            if m and line.startswith(("  ", "│ ")):
                found.add(m.group(1))
            elif plain and not line.startswith(" " * 4) and not line.startswith("│"):
                listing = False
    return found


_CMD_LINE = (
    re.compile(r"^\s*(?:\$\s*)?dshim\s+([a-z][a-z0-9-]*)\b"),  # a line of a code block
)
_CMD_PROSE = (
    re.compile(r"^\|\s*`dshim ([a-z][a-z0-9-]*)"),  # a table row's first cell
    re.compile(r"^\s*(?:[-*+]|\d+\.)\s+`dshim ([a-z][a-z0-9-]*)"),  # a list item
    re.compile(r"^#+\s+`?dshim ([a-z][a-z0-9-]*)"),  # a heading
)


def documented_commands(text: str) -> set[str] | None:
    """``dshim <command>`` names in README's command-line section (None: no section).

    Counted where a command is introduced: the first cell of a table row, the start of a
    list item or a heading, a line of a code block — not mentions inside sentences.
    """
    lines = text.splitlines()
    start = level = None
    for i, line in enumerate(lines):
        m = re.match(r"^(#+)\s+(.*)$", line)
        if m and re.search(r"command[ -]line", m.group(2), re.IGNORECASE):
            start, level = i, len(m.group(1))
            break
    if start is None or level is None:
        return None
    section: list[str] = []
    for line in lines[start + 1 :]:
        m = re.match(r"^(#+)\s", line)
        if m and len(m.group(1)) <= level:
            break
        section.append(line)
    found: set[str] = set()
    for _, line, lang in lines_of("\n".join(section)):
        patterns = _CMD_LINE if lang is not None else _CMD_PROSE
        for pattern in patterns:
            m = pattern.match(line)
            if m:
                found.add(m.group(1))
    return found


def command_problems(cli: set[str], documented: set[str] | None) -> list[str]:
    if documented is None:
        return ["README.md has no command-line section (a heading with 'Command line')"]
    out = [
        f"`dshim {c}` is a command but README's command line does not list it"
        for c in sorted(cli - documented)
    ]
    out += [
        f"README's command line lists `dshim {c}`, which dshim does not have"
        for c in sorted(documented - cli)
    ]
    return out


# --- the checks -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    return docs_config.schema()


def test_configuration_page_is_generated_from_the_structs() -> None:
    page = docs_config.PAGE
    assert page.exists(), f"docs/configuration.md is missing: run `{docs_config.REGENERATE}`"
    assert page.read_text(encoding="utf-8") == docs_config.render(), (
        "docs/configuration.md differs from the configuration structs: "
        f"run `{docs_config.REGENERATE}` and commit the page"
    )


def test_the_page_lists_every_key_the_loader_accepts() -> None:
    text = docs_config.PAGE.read_text(encoding="utf-8")
    assert "| `public_host` | string | unset |" in text
    assert "| `max_queue` | integer | `8` |" in text
    assert '| `kind` | "echo" \\| "openai" \\| "acp" \\| "dsh" | `"echo"` |' in text
    for key in CHANNEL_KEYS:
        assert f'### `channel = "{key}"`' in text
    # Telegram's own key, shown in its section with the default its settings struct has
    # (read from the struct: the test names no platform host itself).
    from dshim.channels.registry import load_channel

    settings = load_channel("telegram").settings
    default = next(f.default for f in msgspec.structs.fields(settings) if f.name == "api_base")
    telegram = text.split('### `channel = "telegram"`')[1].split("### ")[0]
    assert f'| `api_base` | string | `"{default}"` |' in telegram


class _Undocumented(msgspec.Struct):
    #: Has a meaning.
    fine: int = 1
    lacking: str = ""


def test_an_undocumented_key_stops_the_generator() -> None:
    with pytest.raises(docs_config.UndocumentedKey, match=r"_Undocumented\.lacking: add a `#:`"):
        docs_config.tables_of(_Undocumented, "x")


def missing_channel_pages(docs: Path) -> list[str]:
    """The channels of the registry without their ``docs/channels/<channel>.md``."""
    return [key for key in CHANNEL_KEYS if not (docs / "channels" / f"{key}.md").is_file()]


def test_every_channel_has_its_page() -> None:
    missing = missing_channel_pages(REPO / "docs")
    assert not missing, "no docs/channels/<channel>.md page for: " + ", ".join(missing)


def test_a_missing_channel_page_is_reported(tmp_path: Path) -> None:
    (tmp_path / "channels").mkdir()
    for key in CHANNEL_KEYS:
        if key != "qq":
            (tmp_path / "channels" / f"{key}.md").write_text("# page\n")
    assert missing_channel_pages(tmp_path) == ["qq"]


@pytest.mark.parametrize("page", pages(), ids=page_ids(pages()))
def test_links_and_paths_exist(page: Path) -> None:
    problems = broken_links(page, page.read_text(encoding="utf-8"))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", pages(), ids=page_ids(pages()))
def test_toml_examples_name_real_keys(page: Path, schema: dict[str, Any]) -> None:
    problems = toml_problems(page, page.read_text(encoding="utf-8"), schema)
    assert not problems, "\n".join(problems)


def test_the_command_line_section_lists_every_command() -> None:
    cli = cli_commands()
    assert {"serve", "probe", "replay", "init", "login"} <= cli
    problems = command_problems(cli, documented_commands(README.read_text(encoding="utf-8")))
    assert not problems, "\n".join(problems)


# --- the checkers fail when they should -------------------------------------------------------


def test_a_broken_link_and_a_missing_path_are_reported(tmp_path: Path) -> None:
    page = REPO / "docs" / "example.md"  # never written: the checker reads the text given
    text = (
        "See [the reference](configuration.md), [gone](channels/nope.md#setup),\n"
        "[web](https://example.com), [top](#top), `dshim/config.py` and `dshim/nope.py`.\n"
        "```text\n[in code](missing.md) `dshim/also-nope.py`\n```\n"
        "[ref]: ../scripts/nothing.sh\n"
        "`files/<bot>/`, `tests/test_*.py` and `dshim.toml` are not repository paths;\n"
        "run `python scripts/bench_harness.py` or `python scripts/bench_nope.py --x`.\n"
        "```sh\nscripts/chromium && python tests/gone.py\n```\n"
    )
    assert broken_links(page, text) == [
        "docs/example.md:1: link to channels/nope.md#setup names a file that does not exist",
        "docs/example.md:2: `dshim/nope.py` does not exist",
        "docs/example.md:6: link to ../scripts/nothing.sh names a file that does not exist",
        "docs/example.md:8: `scripts/bench_nope.py` does not exist",
        "docs/example.md:10: tests/gone.py does not exist",
    ]


def test_unknown_keys_in_toml_examples_are_reported(schema: dict[str, Any]) -> None:
    text = """
```toml
[http]
listen = "127.0.0.1:8910"
port = 8910

[harness]
kind = "acp"
env = { X = "1" }

[harness.env]
ANYTHING = "free"

[[bots]]
name = "tg"
channel = "telegram"
token = "${TELEGRAM_BOT_TOKEN}"
app_secret = "x"          # a Feishu key, not Telegram's

[bots.acces]
mode = "open"

[[bots]]
name = "wc"
channel = "wecom"
# secret = "${WECOM_BOT_SECRET}"
# bogus = 1

[bots.welcome]
text = "hi"

[[bots]]
name = "any"
domain = "lark"           # no channel named: any channel's key is fine
```

```toml
[projects."/tmp"]
trust_level = "trusted"   # another program's file: not checked
```
"""
    page = REPO / "docs" / "example.md"
    assert toml_problems(page, text, schema) == [
        "docs/example.md:5: port: no such key in [http]",
        'docs/example.md:18: app_secret: no such key in [bots] with channel = "telegram"',
        "docs/example.md:20: [bots.acces] is not a table of dshim.toml",
        'docs/example.md:27: bogus: no such key in [bots] with channel = "wecom"',
    ]


def test_a_welcome_table_outside_wecom_is_reported(schema: dict[str, Any]) -> None:
    block = (
        '```toml\n[[bots]]\nname = "t"\nchannel = "telegram"\n\n[bots.welcome]\ntext = "hi"\n```\n'
    )
    problems = toml_problems(REPO / "x.md", block, schema)
    assert problems[0] == "x.md:6: [bots.welcome] is not a table of dshim.toml"


def test_commands_missing_from_or_extra_in_readme_are_reported() -> None:
    readme = """
# dshim
Run `dshim serve` first.

## Command line

| command | what it does |
|---|---|
| `dshim serve [--bot NAME]` | prints `dshim is running: open URL` |
| `dshim frobnicate` | gone |

- `dshim init [PATH]`: a starter file

```
dshim probe --send-test
```

## In-chat commands
| `dshim replay` | not in the section |
"""
    documented = documented_commands(readme)
    assert documented == {"serve", "frobnicate", "init", "probe"}
    assert command_problems({"serve", "init", "probe", "replay"}, documented) == [
        "`dshim replay` is a command but README's command line does not list it",
        "README's command line lists `dshim frobnicate`, which dshim does not have",
    ]
    assert command_problems({"serve"}, documented_commands("# dshim\n`dshim serve`\n")) == [
        "README.md has no command-line section (a heading with 'Command line')"
    ]


class _AnyEnv(dict[str, str]):
    """An environment in which every variable is set."""

    def get(self, key: str, default: Any = None) -> str:  # type: ignore[override]
        return f"value-of-{key}"


def test_every_harness_example_loads() -> None:
    import tomllib

    from dshim.channels.registry import parse_config

    text = (REPO / "docs" / "harnesses.md").read_text(encoding="utf-8")
    blocks = ["\n".join(line for _, line in block) for block in toml_blocks(text)]
    assert len(blocks) >= 7
    kinds = set()
    for block in blocks:
        config = parse_config(tomllib.loads(block), label="docs/harnesses.md", env=_AnyEnv())
        kinds.add(config.harness.kind)
    assert kinds == {"echo", "acp", "dsh", "openai"}
