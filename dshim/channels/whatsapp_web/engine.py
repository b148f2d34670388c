"""The one door to neonize (WhatsApp Web over whatsmeow): everything else of the
channel is sans-IO and never imports it.

neonize is an optional extra (``dshim[whatsapp-web]``): :func:`load_neonize` imports it
on demand and says how to install it when it is missing.  Its import runs
``os.popen("uname -a").read()`` and never closes the pipe (neonize 0.5.2,
``utils/platform.py``), which leaves a child to reap and an unclosed file for the garbage
collector; during the import ``os.popen`` is one that runs the command to completion and
hands back its output, so nothing is left behind.
"""

from __future__ import annotations

import importlib
import io
import os
import subprocess
import threading
from types import ModuleType
from typing import IO, Any

from dshim.errors import ConfigError

#: The versions the adapter is written against (pyproject's extra pins the same range).
NEONIZE_RANGE = ">=0.5.2,<0.6"


def load_neonize(module: str = "neonize") -> ModuleType:
    """Import ``module`` of neonize (``neonize``, ``neonize.proto.Neonize_pb2`` ...)."""
    with _IMPORT_LOCK:
        real, os.popen = os.popen, _popen_done  # type: ignore[assignment]  # for reading only
        try:
            return importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name is not None and exc.name.split(".")[0] == "neonize":
                raise ConfigError(
                    "channel 'whatsapp_web' needs neonize: pip install 'dshim[whatsapp-web]'"
                ) from None
            raise
        finally:
            os.popen = real


_IMPORT_LOCK = threading.Lock()


def _popen_done(cmd: str, mode: str = "r", buffering: int = -1, **_: Any) -> IO[str]:
    """``os.popen`` for reading, with the child finished and the pipe closed."""
    done = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=10, check=False)
    return io.StringIO(done.stdout)


#: What the adapter calls on ``neonize.client.NewClient``: the method and the parameters
#: it passes by name (the fake engine offers the same calls; ``tests/test_whatsapp_web_engine.py``
#: checks them against the installed neonize, so neither can drift from the library).
CLIENT_CALLS: dict[str, tuple[str, ...]] = {
    "__init__": ("name", "jid", "props", "uuid"),
    "connect": (),
    "disconnect": (),
    "logout": (),
    "get_me": (),
    "PairPhone": ("phone", "show_push_notification"),
    "send_message": ("to", "message", "link_preview"),
    "build_reply_message": ("message", "quoted", "link_preview"),
    "edit_message": ("chat", "message_id", "new_message"),
    "send_chat_presence": ("jid", "state", "media"),
    "mark_read": ("chat", "sender", "receipt", "timestamp"),
    "download_any": ("message",),
}

#: What the adapter reads as properties of ``NewClient`` (not calls).
CLIENT_PROPERTIES = ("is_connected", "is_logged_in")

#: The events the adapter subscribes to (``neonize.events``): messages, the QR and pair
#: code of a login, the connection's state, and the two ends that need the user (logged
#: out from the phone) or another client (the session taken over).
EVENTS = (
    "MessageEv",
    "QREv",
    "PairStatusEv",
    "ConnectedEv",
    "DisconnectedEv",
    "LoggedOutEv",
    "StreamReplacedEv",
    "ConnectFailureEv",
    "KeepAliveTimeoutEv",
    "TemporaryBanEv",
)
