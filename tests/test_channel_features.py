"""Which optional features each channel implements, as a literal table.

The optional features are the small runtime-checkable protocols of
:mod:`dshim.channels.base`, :mod:`dshim.outbound` and :mod:`dshim.render`, which the
pipeline, the edit engine and replay discover with ``isinstance``.  The objects checked
are the real ones: each channel runs under its contract rig (``tests/rig_<key>.py``)
through ``serve_bots``, a direct and a group message are answered, and the outbound the
channel handed to ``open_runtime``, the streams it opened and (for an edit-engine
outbound) its transport are looked at; the replay adapter is built from one of the
channel's raw fixtures the way ``dshim replay`` builds it.  Adding a feature, losing one
or misspelling one (a member close to a feature's name) changes what this test sees.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from dshim.channels.base import (
    AcceptsMany,
    BotHost,
    Channel,
    ChannelSpec,
    Collecting,
    ExpandsEvents,
    FindsDirectTargets,
    HasDataDir,
    Inbound,
    Outbound,
    PresentsControlNotices,
    PresentsInteractions,
    ReceivesEvents,
    ReplaySource,
    ReplyStream,
    WatchesDelivery,
    WatchesStop,
    login_hook,
)
from dshim.model import ReplyTarget
from dshim.render import EditOutbound, IdempotentSends, ProbesReachable
from dshim.replay import load_fixture
from tests.channel_contract import ChannelRig, running
from tests.test_channel_contract import RIGS

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"

#: Per channel, the optional features its objects implement (its adapter, outbound,
#: streams, transports and the channel itself).  ``IdempotentSends`` counts when the
#: transport says True (Slack's says False: it has none).
FEATURES: dict[str, set[str]] = {
    "dingtalk": {"ReceivesEvents", "WatchesDelivery"},
    "discord": {
        "FindsDirectTargets",
        "IdempotentSends",
        "PresentsControlNotices",
        "PresentsInteractions",
        "ProbesReachable",
        "WatchesDelivery",
    },
    "feishu": {
        "IdempotentSends",
        "PresentsControlNotices",
        "PresentsInteractions",
        "WatchesDelivery",
    },
    "qq": {"ReceivesEvents", "WatchesDelivery"},
    "slack": {
        "FindsDirectTargets",
        "PresentsControlNotices",
        "PresentsInteractions",
        "ProbesReachable",
        "WatchesDelivery",
        "WatchesStop",
    },
    "telegram": {"Collecting", "ProbesReachable", "WatchesDelivery"},
    "webchat": {"PresentsInteractions", "ReceivesEvents", "WatchesDelivery"},
    "wecom": {"PresentsInteractions", "WatchesDelivery"},
    "weixin": {"Login", "ReceivesEvents", "WatchesDelivery"},
    "whatsapp": {
        "ExpandsEvents",
        "PresentsInteractions",
        "ProbesReachable",
        "ReceivesEvents",
        "WatchesDelivery",
    },
    "whatsapp_web": {"Login", "ProbesReachable", "ReceivesEvents", "WatchesDelivery"},
}

#: Where each feature lives: the object it is looked for on, and its protocol.
ADAPTER_FEATURES = (ReceivesEvents, ExpandsEvents, Collecting)
OUTBOUND_FEATURES = (PresentsInteractions, PresentsControlNotices, FindsDirectTargets)
STREAM_FEATURES = (WatchesDelivery, WatchesStop)
TRANSPORT_FEATURES = (ProbesReachable, IdempotentSends)
ALL_FEATURES = (*ADAPTER_FEATURES, *OUTBOUND_FEATURES, *STREAM_FEATURES, *TRANSPORT_FEATURES)


def _members(protocol: type) -> list[str]:
    return sorted(
        name
        for name in {*protocol.__dict__, *getattr(protocol, "__annotations__", {})}
        if not name.startswith("_")
    )


MEMBER_NAMES = sorted({m for p in ALL_FEATURES for m in _members(p)} | {"login", "login_fn"})


def features_of(obj: object, protocols: tuple[type, ...]) -> set[str]:
    """The protocols ``obj`` implements, each with its own members (never a protocol's
    stub inherited by a class that names the protocol but misspelt the member)."""
    found: set[str] = set()
    for protocol in protocols:
        if not isinstance(obj, protocol):
            continue
        for name in _members(protocol):
            inherited = protocol.__dict__.get(name)
            own = inspect.getattr_static(obj, name, None)
            assert own is not None and own is not inherited, (type(obj), name)
        if protocol is IdempotentSends and not obj.idempotent_sends:  # type: ignore[attr-defined]
            continue
        found.add(protocol.__name__)
    return found


def misspelt(obj: object) -> list[str]:
    """Public members of ``obj`` close to a feature member's name but not it."""
    names = [n for n in dir(type(obj)) if not n.startswith("_") and n not in MEMBER_NAMES]
    return [n for n in names if difflib.get_close_matches(n, MEMBER_NAMES, n=1, cutoff=0.85)]


@dataclass
class Seen:
    """What the channel handed the host while it ran."""

    outbound: Outbound | None = None
    inbound: Inbound | None = None
    host: BotHost | None = None
    streams: list[tuple[ReplyTarget, ReplyStream]] = field(default_factory=list)


class SpyHost:
    """The real host, noting the outbound and the runtime ``open_runtime`` gets and
    yields, and every stream the pipeline opens on that outbound."""

    def __init__(self, host: BotHost, seen: Seen) -> None:
        self._host = host
        self._seen = seen
        seen.host = host

    def __getattr__(self, name: str) -> Any:
        return getattr(self._host, name)

    def open_runtime(
        self, *, outbound: Outbound, **kwargs: Any
    ) -> AbstractAsyncContextManager[Inbound]:
        seen = self._seen
        seen.outbound = outbound
        open_stream = outbound.open_stream

        @asynccontextmanager
        async def spied_stream(target: ReplyTarget) -> AsyncIterator[ReplyStream]:
            async with open_stream(target) as stream:
                seen.streams.append((target, stream))
                yield stream

        outbound.open_stream = spied_stream  # type: ignore[method-assign]

        @asynccontextmanager
        async def opened() -> AsyncIterator[Inbound]:
            async with self._host.open_runtime(outbound=outbound, **kwargs) as rt:
                seen.inbound = rt
                yield rt

        return opened()


class SpiedRig:
    """A contract rig whose channel runs on a :class:`SpyHost`."""

    def __init__(self, rig: ChannelRig, seen: Seen) -> None:
        self._rig = rig
        channel = rig.channel
        assert isinstance(channel, ChannelSpec)

        async def run(host: BotHost, *, task_status: trio.TaskStatus[None]) -> None:
            await channel.run(SpyHost(host, seen), task_status=task_status)  # type: ignore[arg-type]

        self.channel: Channel = replace(channel, run_fn=run)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._rig, name)


async def adapter_features(channel: Channel) -> tuple[set[str], list[str]]:
    """The features of the channel's replay adapter, built from its first raw fixture as
    replay builds it, and its misspelt members."""
    for path in sorted((FIXTURES / channel.key).glob("*.json")):
        fx = load_fixture(path)
        if fx.format != "raw":
            continue
        bot_id, username = fx.bot.get("id"), fx.bot.get("username")
        transport = httpx.MockTransport(lambda r: httpx.Response(404))
        async with httpx.AsyncClient(transport=transport) as http:
            source = ReplaySource(
                bot_id=str(bot_id) if bot_id is not None else None,
                bot_username=str(username) if username else None,
                http=http,
                api_base="https://replay.invalid",
                bot_info=dict(fx.bot),
            )
            adapter = channel.replay_adapter(source)
            return features_of(adapter, ADAPTER_FEATURES), misspelt(adapter)
    raise AssertionError(f"no raw fixture for {channel.key}")


async def answered(rig: ChannelRig, seen: Seen, tmp_path: Path) -> None:
    """Run the channel under its rig until a direct and a group message were answered."""
    spied: Any = SpiedRig(rig, seen)
    async with rig.open(), running(spied, tmp_path):
        await rig.receiving()
        await rig.user_dm("hello")
        await rig.wait_until(lambda: len(seen.streams) >= 1)
        await rig.user_group("hello group", mention=True)
        with trio.move_on_after(60):  # a channel without groups (the web chat) has one
            await rig.wait_until(lambda: len(seen.streams) >= 2)
        assert len(seen.streams) >= (1 if rig.channel.key == "webchat" else 2)
        await trio.sleep(10)


@pytest.mark.parametrize("key", sorted(RIGS))
async def test_each_channel_implements_the_optional_features_of_its_table(
    key: str, autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    rig = RIGS[key]()
    seen = Seen()
    await answered(rig, seen, tmp_path)
    outbound, streams = seen.outbound, seen.streams
    assert outbound is not None and streams
    found = features_of(outbound, OUTBOUND_FEATURES)
    checked: list[object] = [outbound]
    for target, stream in streams:
        found |= features_of(stream, STREAM_FEATURES)
        checked.append(stream)
        if isinstance(outbound, EditOutbound):
            transport = outbound.transport(target)
            found |= features_of(transport, TRANSPORT_FEATURES)
            checked.append(transport)
    in_adapter, adapter_typos = await adapter_features(rig.channel)
    found |= in_adapter
    if login_hook(rig.channel) is not None:
        found.add("Login")
    assert found == FEATURES[key]
    assert [(type(o).__name__, misspelt(o)) for o in checked if misspelt(o)] == []
    assert adapter_typos == []
    # The pipeline side every channel gets: a host with a data directory, a runtime that
    # takes a batch in one transaction.
    assert isinstance(seen.host, HasDataDir) and isinstance(seen.inbound, AcceptsMany)


def test_the_table_names_only_known_features() -> None:
    known = {p.__name__ for p in ALL_FEATURES} | {"Login"}
    assert set().union(*FEATURES.values()) <= known
    assert set(FEATURES) == set(RIGS)


def test_a_misspelt_member_is_noticed() -> None:
    class Typo:
        def watch_delivry(self, hook: Callable[[], Awaitable[None]]) -> None: ...

    assert features_of(Typo(), STREAM_FEATURES) == set()
    assert misspelt(Typo()) == ["watch_delivry"]
