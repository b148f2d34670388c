"""The ``dshim`` console script (and ``python -m dshim``).

``dshim serve`` with no other command is parsed here and started without importing the
typer application (:mod:`dshim.cli`), so a bot starts fast; every other command goes to
the application.  This module sits above both, so neither imports the other's caller.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from dshim.launch import Exit, parse_serve, serve


def main(argv: Sequence[str] | None = None) -> None:
    """Console-script entry point (``dshim``, ``python -m dshim``)."""
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        parsed = parse_serve(args)
        if parsed is None:
            from dshim.cli import app

            app() if argv is None else app(args=args)
            return
        try:
            code = serve(*parsed)
        except Exit as exc:
            code = exc.code
        sys.exit(code)
    except KeyboardInterrupt:  # pragma: no cover - interactive only
        sys.exit(130)
