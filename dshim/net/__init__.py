"""The network floor: what every part that talks over the network shares.

The channels, the harnesses, ``serve`` and replay all use it; it imports nothing of
dshim above :mod:`dshim.errors`, :mod:`dshim.backoff`, :mod:`dshim.log` and
:mod:`dshim.model`.

- :mod:`dshim.net.http`: the HTTP client (httpx over the h11 transport), the one error
  mapping (``TransportError.request_sent``), capped downloads, Retry-After, access
  tokens;
- :mod:`dshim.net.h11transport`: the h11 connection pool the HTTP client runs on;
- :mod:`dshim.net.ws_session` (sans-IO) and :mod:`dshim.net.ws`: the websocket runner
  over a session protocol, with the connect-before-close handover.
"""
