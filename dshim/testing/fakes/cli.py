"""Run a fake platform as a process: ``python -m dshim.testing.fakes.<name>``.

Every fake's ``main`` is built from this module: the same options (``--port``, default 0:
the kernel picks a free port; ``--host``, default 127.0.0.1; ``--json``), the same output
(the fake's base URL, the credentials a dshim configuration needs to talk to it -- the
fake's own test values, nothing real -- and a ready ``[[bots]]`` block for dshim.toml),
then it serves until Ctrl-C or SIGTERM and exits 0.  ``--json`` prints one JSON line
with the settings instead (what the benchmarks in scripts/ read); a fake that floods
(``--flood``, benchmarks) prints that line too.  ``--port`` is the port of the address a
configuration names (the API base; WeCom's websocket); a fake's other listeners (a
gateway, a media host) take free ports, printed with the rest.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import trio

F = TypeVar("F")


@dataclass(frozen=True)
class Announcement:
    """What a fake process prints once it listens."""

    #: "Telegram Bot API", "Slack Web API + Socket Mode", ...
    title: str
    #: The HTTP base URL that answers (an API base, or the media host of WeCom).
    url: str
    #: The dshim channel name of the ``[[bots]]`` block.
    channel: str
    #: The bot's settings in dshim.toml, in order (credentials and the fake's URLs).
    settings: dict[str, str]
    #: Other facts worth printing (a DM's id, a second server); also in the JSON line.
    notes: dict[str, str] = field(default_factory=dict)
    #: The benchmarks' JSON line (default: url, settings and notes).
    json_line: dict[str, Any] | None = None

    def bots_toml(self) -> str:
        """A ``[[bots]]`` block for dshim.toml naming this fake."""
        lines = ["[[bots]]", f'name = "{self.channel}-fake"', f'channel = "{self.channel}"']
        lines += [f"{key} = {json.dumps(value)}" for key, value in self.settings.items()]
        return "\n".join(lines) + "\n"

    def text(self, module: str) -> str:
        """The human-readable announcement."""
        width = max(len(k) for k in (*self.settings, *self.notes))
        rows = [f"  {k:<{width}}  {v}" for k, v in (*self.settings.items(), *self.notes.items())]
        return "\n".join(
            [
                f"fake {self.title} ({module}); Ctrl-C stops it",
                f"url: {self.url}",
                "credentials and addresses (the fake's own test values):",
                *rows,
                "",
                "a bot for dshim.toml:",
                "",
                self.bots_toml(),
            ]
        )

    def as_json(self) -> str:
        line = self.json_line
        if line is None:
            line = {"url": self.url, **self.settings, **self.notes}
        return json.dumps(line)


def parser(doc: str | None, *, module: str, flood: str | None = None) -> argparse.ArgumentParser:
    """The options every fake has, and ``--flood N`` (benchmarks) when ``flood`` says what
    the fake then sends; a fake adds its own to it."""
    first = (doc or module).strip().splitlines()[0]
    p = argparse.ArgumentParser(
        prog=f"python -m {module}",
        description=f"{first}  Prints its URL, credentials and a dshim.toml [[bots]] block, "
        "then serves until Ctrl-C.",
    )
    p.add_argument(
        "--port",
        type=int,
        default=0,
        metavar="PORT",
        help="port of its API (default 0: a free port, printed)",
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        metavar="HOST",
        help="address to listen on and to name in its URLs (default 127.0.0.1)",
    )
    p.add_argument(
        "--json", action="store_true", help="print one JSON line with the settings instead"
    )
    p.add_argument(
        "--lifetime",
        type=float,
        default=None,
        metavar="SECONDS",
        help="exit 0 after this long (default: serve until Ctrl-C)",
    )
    if flood is not None:
        p.add_argument("--flood", type=int, default=None, metavar="N", help=flood)
    return p


def run(
    args: argparse.Namespace,
    *,
    module: str,
    open_fake: Callable[[], AbstractAsyncContextManager[F]],
    announce: Callable[[F], Announcement],
    serve: Callable[[F], Awaitable[None]] | None = None,
    json_line: bool = False,
) -> None:
    """Open the fake, print its :class:`Announcement`, serve until SIGINT/SIGTERM (or
    ``--lifetime``), exit 0.  ``serve`` runs while it is up (a benchmark flood);
    ``json_line`` prints the JSON line whatever ``--json`` says."""

    async def main() -> None:
        # Open before the fake listens: a Ctrl-C at any point after this is ours.
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with open_fake() as fake, trio.open_nursery() as nursery:
                if args.lifetime is not None:
                    nursery.cancel_scope.deadline = trio.current_time() + args.lifetime
                said = announce(fake)
                print(said.as_json() if args.json or json_line else said.text(module), flush=True)

                async def until_signal() -> None:
                    async for _ in signals:
                        nursery.cancel_scope.cancel()
                        return

                nursery.start_soon(until_signal)
                if serve is not None:
                    nursery.start_soon(serve, fake)

    try:
        trio.run(main)
    except KeyboardInterrupt:  # Ctrl-C before the receiver was open: nothing to stop
        pass
    except OSError as exc:  # the port is taken, the host is not ours
        sys.exit(f"{module}: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}")
