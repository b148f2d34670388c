"""The pipeline's ``retract`` (Feishu's recall): a withdrawn message that still waits in
its lane is dropped, a running one is stopped like ``/stop`` (the user is told once, by the
stopped answer), anything else is left alone -- and a retraction never starts a turn.
Runs the real pipeline on a SQLite store, the echo harness and the autojump clock."""

from __future__ import annotations

from pathlib import Path

import trio

from dshim.pipeline.turn import STOPPED_MARK
from tests.helpers import msg, open_rig


async def test_retract_drops_queued_and_stops_running(
    autojump_clock: object, tmp_path: Path
) -> None:
    async with open_rig(tmp_path) as rig:
        await rig.rt.accept(msg("echo:slow 20 long", message_id="m-run"))
        await rig.rt.accept(msg("waiting", message_id="m-queued"))
        await trio.sleep(2)  # the first turn streams
        assert await rig.rt.retract("42", "m-queued") == "dropped"
        assert await rig.rt.retract("42", "m-run") == "stopped"
        assert await rig.rt.retract("42", "m-unknown") == "none"
        await rig.rt.wait_idle()
        await rig.rt.accept(msg("after", message_id="m-after"))
        await rig.rt.wait_idle()
        pending = await rig.store.inbox_pending(rig.rt.bot.name)
    assert len(rig.events.prompts) == 2  # the long one and "after": never "waiting"
    assert not any("waiting" in p for p in rig.events.prompts)
    assert [t.endswith(STOPPED_MARK) for t in rig.texts] == [True, False]
    assert pending == []  # the dropped message's inbox entry is finished too


async def test_retract_after_the_turn_is_nothing(autojump_clock: object, tmp_path: Path) -> None:
    async with open_rig(tmp_path) as rig:
        await rig.rt.accept(msg("quick", message_id="m-1"))
        await rig.rt.wait_idle()
        assert await rig.rt.retract("42", "m-1") == "none"
        await rig.rt.wait_idle()
    assert len(rig.texts) == 1 and not rig.texts[0].endswith(STOPPED_MARK)
