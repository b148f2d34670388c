"""What channels share, so that a new channel is models/protocol/client/render/channel
plus a fake, with nothing copied from another channel.

- :mod:`dshim.net.http`: the bot's HTTP client, the one httpx error mapping
  (``TransportError.request_sent``), capped downloads, Retry-After, access tokens;
- :mod:`dshim.channels.kit.retry`: run a call until it succeeds, backing off on
  transient errors (identity calls before a channel has started);
- :mod:`dshim.channels.kit.poll`: the long-poll loop with a durable, shielded cursor
  commit after acceptance (Telegram, WeChat iLink);
- :mod:`dshim.net.ws`: the websocket connection runner over a sans-IO session
  protocol (Discord, QQ; Slack, Feishu, DingTalk and WeCom next);
- :mod:`dshim.channels.kit.gateway` (sans-IO) and :mod:`dshim.channels.kit.gateway_run`:
  the Discord-style gateway session (Hello, Identify/Resume, heartbeats and the ACK
  watchdog, op 7/9, close-code classes, the identify budget) that Discord and QQ share,
  parameterized by a :class:`~dshim.channels.kit.gateway.GatewayDialect`;
- :mod:`dshim.channels.kit.index`: the message index of both directions, for platforms
  whose quotes carry only an id (WeChat, DingTalk, QQ, WhatsApp).

The streaming-by-edit engine is :mod:`dshim.render`; the backoff :mod:`dshim.backoff`.
"""

from dshim.backoff import Backoff

__all__ = ["Backoff"]
