"""The DingTalk Stream client's dead-socket detection (the kit's websocket pings).

A socket can stay open while nothing comes through (NAT timeouts, a half-dead server):
the bot's websocket ping then gets no pong, and within ``ping_interval_s +
pong_timeout_s`` the bot cuts the connection and registers again.  The test puts a TCP
relay between the bot and the fake Stream server and freezes it (nothing is forwarded
in either direction, the sockets stay open), on trio's autojump clock.
"""

from __future__ import annotations

from pathlib import Path

import trio
from structlog.testing import capture_logs

from dshim.channels.dingtalk.client import WS_OPTIONS
from dshim.testing.fakes.dingtalk import FakeDingTalk
from tests.test_dingtalk_e2e import answered, echo, running_bot


class Relay:
    """A TCP relay to ``port`` that can freeze (stop forwarding, keep the sockets)."""

    def __init__(self) -> None:
        self.target = 0
        self.frozen = trio.Event()
        self.port = 0

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            await nursery.start(trio.serve_listeners, self._relay, listeners)
            task_status.started()

    async def _relay(self, client: trio.SocketStream) -> None:
        server = await trio.open_tcp_stream("127.0.0.1", self.target)
        frozen = self.frozen.is_set()

        async def pump(a: trio.SocketStream, b: trio.SocketStream) -> None:
            try:
                while data := await a.receive_some(65536):
                    if self.frozen.is_set() and not frozen:
                        await trio.sleep_forever()  # swallow: the peer hears nothing
                    await b.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return

        async with client, server, trio.open_nursery() as nursery:
            nursery.start_soon(pump, client, server)
            nursery.start_soon(pump, server, client)


async def test_a_socket_that_stops_answering_pings_is_replaced(
    tmp_path: Path, autojump_clock: object
) -> None:
    relay = Relay()

    def via_relay(fake: FakeDingTalk) -> None:
        relay.target = int(fake.ws_url.rsplit(":", 1)[1])
        fake.ws_url = f"ws://127.0.0.1:{relay.port}"

    with capture_logs() as logs:
        async with trio.open_nursery() as nursery:
            await nursery.start(relay.serve)
            async with running_bot(tmp_path, configure=via_relay) as (bot, fake):
                first = fake.connections[-1]
                relay.frozen.set()
                t0 = trio.current_time()
                await fake.wait_until(lambda: len(fake.connections) >= 2)
                waited = trio.current_time() - t0
                assert first.open  # the server never noticed: only the pong was missing
                interval = WS_OPTIONS.ping_interval_s or 0.0
                assert waited <= interval + WS_OPTIONS.pong_timeout_s + 2
                fake.user_message(fake.dm_conversation, "still there?")
                await answered(fake, fake.dm_conversation, echo(fake, "still there?"))
            nursery.cancel_scope.cancel()
    assert [e for e in logs if e["event"] == "ws_pong_timed_out"]
