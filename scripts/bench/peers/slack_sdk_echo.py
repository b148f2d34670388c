"""slack-sdk Socket Mode echo bot for the benchmark suite's B4 (run in its own venv).

The SDK's built-in ``SocketModeClient`` (threads), acknowledging in its listener before
answering with ``chat.postMessage``.  Env: BENCH_API (the fake's Web API base),
BENCH_TOKEN (bot token), BENCH_APP_TOKEN.  Honours ``echo:sleep S``.
"""

import os
import re
import threading
import time

from slack_sdk.socket_mode import SocketModeClient
from slack_sdk.socket_mode.request import SocketModeRequest
from slack_sdk.socket_mode.response import SocketModeResponse
from slack_sdk.web import WebClient

SLEEP = re.compile(r"^echo:sleep\s+(\d+(?:\.\d+)?)")


def main() -> None:
    web = WebClient(token=os.environ["BENCH_TOKEN"], base_url=os.environ["BENCH_API"] + "/")
    client = SocketModeClient(app_token=os.environ["BENCH_APP_TOKEN"], web_client=web)

    def listener(c: SocketModeClient, req: SocketModeRequest) -> None:
        c.send_socket_mode_response(SocketModeResponse(envelope_id=req.envelope_id))
        if req.type != "events_api":
            return
        ev = req.payload.get("event", {})
        if ev.get("type") != "message" or ev.get("bot_id") or ev.get("subtype"):
            return
        text = ev.get("text") or ""
        m = SLEEP.match(text)
        if m:
            time.sleep(float(m.group(1)))
        c.web_client.chat_postMessage(channel=ev["channel"], text=text)

    client.socket_mode_request_listeners.append(listener)
    client.connect()
    threading.Event().wait()


if __name__ == "__main__":
    main()
