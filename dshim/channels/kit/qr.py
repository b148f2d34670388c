"""A QR code drawn in the terminal, for the logins that link an account by scanning one
(WeChat, WhatsApp Web)."""

from __future__ import annotations

import io

__all__ = ["render_qr"]


def render_qr(data: str) -> str:
    """The QR of ``data`` as terminal text (segno is imported here: only a login draws
    one, and serving bots should not carry it)."""
    import segno

    out = io.StringIO()
    segno.make(data, error="m").terminal(out=out, compact=True)
    return out.getvalue()
