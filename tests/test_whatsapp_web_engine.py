"""The WhatsApp Web adapter against the installed neonize: every call it makes exists
with the parameters it passes, every event it subscribes to exists, and importing
neonize leaves no child process or open pipe behind."""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap

import pytest

from dshim.channels.whatsapp_web.engine import (
    CLIENT_CALLS,
    EVENTS,
    load_neonize,
)
from dshim.errors import ConfigError


@pytest.mark.parametrize(("name", "params"), sorted(CLIENT_CALLS.items()))
def test_every_client_call_exists_with_the_parameters_the_adapter_passes(
    name: str, params: tuple[str, ...]
) -> None:
    client = load_neonize("neonize.client").NewClient
    method = getattr(client, name, None)
    assert callable(method), f"NewClient.{name} is gone"
    accepted = inspect.signature(method).parameters
    assert [p for p in params if p not in accepted] == []


def test_every_event_the_adapter_subscribes_to_exists() -> None:
    events = load_neonize("neonize.events")
    assert [name for name in EVENTS if not hasattr(events, name)] == []


def test_a_missing_neonize_names_the_extra_to_install() -> None:
    with pytest.raises(ConfigError, match=r"dshim\[whatsapp-web\]"):
        load_neonize("neonize.not_a_module_of_neonize_at_all")


def test_importing_neonize_leaves_nothing_behind() -> None:
    code = textwrap.dedent(
        """\
        import gc, warnings
        warnings.simplefilter("error")
        from dshim.channels.whatsapp_web.engine import load_neonize
        load_neonize("neonize")
        gc.collect()
        print("clean")
        """
    )
    done = subprocess.run(
        [sys.executable, "-X", "dev", "-c", code], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "clean", done.stderr[-2000:]
    assert "ResourceWarning" not in done.stderr
