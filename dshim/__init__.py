"""dshim: one trio program connecting IM bots on nine platforms to an AI agent harness."""

import sys as _sys

__version__ = "0.1.0"

# structlog imports two optional packages at its own import when they are installed, for
# features dshim does not use: rich (typer brings it), only to render console tracebacks
# prettily (dshim's console lines print plain ones), ~40 ms and ~6 MB; and greenlet (the
# test extra's playwright brings it), for its deprecated thread-local context (dshim binds
# context with contextvars), ~1 MB with the C++ runtime it loads.  Hide both while
# structlog loads; anything that imports them later (typer's help screens, playwright)
# still finds them.
_HIDDEN = ("rich", "greenlet")
if "structlog" not in _sys.modules and not any(name in _sys.modules for name in _HIDDEN):
    for _name in _HIDDEN:
        _sys.modules[_name] = None  # type: ignore[assignment]
    try:
        import structlog as _structlog  # noqa: F401
    finally:
        for _name in _HIDDEN:
            del _sys.modules[_name]
