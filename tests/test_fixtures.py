"""Every replay fixture still produces its golden (what ``dshim replay --check`` does).

A fixture is a list of platform events exactly as the platform delivers them
(``"format": "raw"``) or normalized messages; the golden (``expect``) is what the
pipeline decided and sent, reviewed by hand.  A failure prints the diff: review it,
then refresh with ``dshim replay --update fixtures/<channel>/`` only when the change is
intended.  CHANNELS.md §10 lists the cases every channel's fixtures must cover; each
channel's spec (``dshim/channels/<key>/spec.py``) names them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dshim.channels.registry import CHANNEL_KEYS, spec
from dshim.replay import diff_lines, load_fixture, run_fixture

ROOT = Path(__file__).resolve().parents[1] / "fixtures"
FIXTURES = sorted(ROOT.rglob("*.json"))


@pytest.mark.parametrize("channel", CHANNEL_KEYS)
def test_every_required_case_has_a_fixture(channel: str) -> None:
    """The cases a channel's spec names (``fixture_cases``, beyond its own) all exist."""
    required = spec(channel).fixture_cases
    assert required, f"dshim/channels/{channel}/spec.py names no fixture_cases"
    names = {p.stem for p in (ROOT / channel).glob("*.json")}
    assert required <= names, sorted(required - names)


@pytest.mark.parametrize("path", FIXTURES, ids=[str(p.relative_to(ROOT)) for p in FIXTURES])
def test_fixture_matches_its_golden(path: Path) -> None:
    fixture = load_fixture(path)
    assert fixture.expect is not None, "no golden: run dshim replay --update on it and review"
    actual = run_fixture(path)
    stripped = [{k: v for k, v in line.items() if k != "fixture"} for line in actual]
    assert stripped == fixture.expect, diff_lines(fixture.expect, actual)
