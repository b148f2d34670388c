"""dshim: one trio program connecting IM bots on nine platforms to an AI agent harness."""

import sys as _sys

__version__ = "0.1.0"

# structlog imports rich, when it is installed (typer brings it), only to render console
# tracebacks prettily: ~40 ms of start-up and ~6 MB for every process, for output dshim
# does not use (its console lines print plain tracebacks).  Hide rich while structlog
# loads; typer still finds it later for its help screens.
if "structlog" not in _sys.modules and "rich" not in _sys.modules:
    _sys.modules["rich"] = None  # type: ignore[assignment]
    try:
        import structlog as _structlog  # noqa: F401
    finally:
        del _sys.modules["rich"]
