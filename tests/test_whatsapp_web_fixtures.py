"""The WhatsApp Web fixtures' events are what their generator builds with neonize's classes.

``scripts/fixtures/whatsapp_web_fixtures.py`` writes every event of
``fixtures/whatsapp_web/`` as ``MessageToDict`` of neonize's ``Message`` event; a fixture
edited by hand (or a neonize upgrade that changes the encoding) shows up here.  Refresh
with the script, then ``dshim replay --update fixtures/whatsapp_web/`` and review.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "fixtures" / "whatsapp_web_fixtures.py"


def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("whatsapp_web_fixtures", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GEN = generator()


@pytest.mark.parametrize("name", sorted(GEN.CASES))
def test_fixture_is_what_the_generator_writes(name: str) -> None:
    path = ROOT / "fixtures" / "whatsapp_web" / f"{name}.json"
    data = path.read_bytes()
    assert GEN.render(name, json.loads(data)) == data, (
        f"{path} differs from its generator: run python {SCRIPT.relative_to(ROOT)}"
    )


def test_the_generator_covers_the_spec_cases() -> None:
    from dshim.channels.registry import spec

    assert set(GEN.CASES) == set(spec("whatsapp_web").fixture_cases)
