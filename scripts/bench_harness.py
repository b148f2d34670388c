"""Time to first token through the OpenAI adapter, side by side with a raw httpx SSE loop.

    python scripts/bench_harness.py [--turns 300] [--warmup 30]

Both runs talk to the same fake OpenAI-compatible server (``dshim.testing.fakes.openai``,
127.0.0.1, chunked SSE, answer without reasoning) in the same process, interleaved turn by
turn so that drift hits both alike:

- floor   the least any client must do: one POST with ``stream: true`` on a shared
          ``httpx.AsyncClient``, ``aiter_lines``, ``json.loads`` of each ``data:`` line,
          stop the clock at the first non-empty ``delta.content``;
- dshim   the prompt handed to the adapter (``harness.prompt`` is called by the real
          pipeline, step 7) -> the first text delta at the renderer
          (``ReplyStream.update``).  This includes what dshim adds per turn: reading the
          session's transcript back from SQLite to rebuild the context, msgspec encoding
          of the request, the hand-written SSE decoder, msgspec decoding of chunks, and
          the pipeline's event loop up to the renderer.
- dshim, accept -> first token: the same, measured from ``BotRuntime.accept`` (dedup and
          the durable inbox, lane hand-off, binding, prompt assembly, transcript write).

Prints p50/p99 in milliseconds, the overhead (dshim minus floor) and the ratio.  Numbers
are for this machine and this run only; compare within one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import msgspec
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dshim.channels.registry import parse_config
from dshim.harness.base import TurnContext  # noqa: E402
from dshim.harness.openai import OpenAIHarness  # noqa: E402
from dshim.log import configure_logging  # noqa: E402
from dshim.model import Delivered, InboundMessage, PromptPart, ReplyTarget, TurnEvent  # noqa: E402
from dshim.pipeline.runtime import open_bot_runtime  # noqa: E402
from dshim.store import open_store  # noqa: E402
from dshim.testing.fakes.openai import FakeOpenAI, open_fake_openai  # noqa: E402
from dshim.testing.outbound import RecordingOutbound, RecordingStream  # noqa: E402

PROMPT = "fake:plain how long until the first token arrives?"


class TimedHarness:
    """Wraps the adapter: notes the moment the pipeline hands it the prompt."""

    def __init__(self, inner: OpenAIHarness) -> None:
        self.inner = inner
        self.kind = inner.kind
        self.handed_at = 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def prompt(
        self, session_id: str, parts: Sequence[PromptPart], ctx: TurnContext
    ) -> AsyncGenerator[TurnEvent, None]:
        self.handed_at = time.perf_counter()
        async for event in self.inner.prompt(session_id, parts, ctx):
            yield event


class TimedOutbound(RecordingOutbound):
    """The renderer: notes the first text update of each stream.

    Like the channels' edit engine (:class:`dshim.render.EditStream`), the stream reports
    its first send through ``watch_delivery`` — here at ``finish``, where the recording
    stream "sends" — so the pipeline's durable delivery mark happens where it does in a
    real channel: at the first send, not on the way of the first token.
    """

    def __init__(self, clock: Any) -> None:
        super().__init__(clock=clock)
        self.first_update_at = 0.0

    @asynccontextmanager
    async def open_stream(self, target: ReplyTarget) -> AsyncIterator[RecordingStream]:
        outbound = self

        class Stream(RecordingStream):
            hook: Callable[[], Awaitable[None]] | None = None

            def watch_delivery(self, hook: Callable[[], Awaitable[None]]) -> None:
                self.hook = hook

            async def update(self, text: str) -> None:
                if not self.update_count:
                    outbound.first_update_at = time.perf_counter()
                await super().update(text)

            async def finish(self, text: str) -> list[Delivered]:
                if self.hook is not None:
                    await self.hook()
                return await super().finish(text)

        stream = Stream(self, target, keep=self.keep_updates)
        yield stream


async def floor_turn(client: httpx.AsyncClient, fake: FakeOpenAI) -> float:
    body = {
        "model": "fake-small",
        "messages": [{"role": "user", "content": PROMPT}],
        "stream": True,
    }
    t0 = time.perf_counter()
    first = 0.0
    async with client.stream("POST", fake.base_url + "/chat/completions", json=body) as resp:
        lines = resp.aiter_lines()
        async for line in lines:
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            for choice in chunk.get("choices") or ():
                if not first and (choice.get("delta") or {}).get("content"):
                    first = time.perf_counter()
        async for _ in lines:  # the rest (normally nothing): the connection is reused
            pass
    return (first - t0) * 1000


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1))))
    return ordered[k]


async def main(args: argparse.Namespace) -> None:
    configure_logging("error", "json")
    config = parse_config(
        {"bots": [{"name": "bench", "channel": "telegram"}]}, env={}, channel_settings=False
    )
    floor: list[float] = []
    adapter: list[float] = []
    accept: list[float] = []
    with tempfile.TemporaryDirectory(prefix="dshim-bench-") as d:
        async with open_fake_openai(chunk_size=64) as fake, httpx.AsyncClient() as raw:
            harness_cfg = parse_config(
                {"harness": {"kind": "openai", "base_url": fake.base_url, "model": "fake-small"}},
                env={},
            ).harness
            async with open_store(Path(d)) as store:
                inner = OpenAIHarness(harness_cfg, bot="bench", store=store)
                harness = TimedHarness(inner)
                out = TimedOutbound(clock=time.time)
                async with open_bot_runtime(
                    config=config,
                    bot=config.bots[0],
                    bot_id="1",
                    store=store,
                    outbound=out,
                    harness=harness,  # type: ignore[arg-type]
                ) as rt:
                    for i in range(args.warmup + args.turns):
                        floor_ms = await floor_turn(raw, fake)
                        msg = InboundMessage(
                            channel="telegram",
                            bot_id="1",
                            message_id=f"m{i}",
                            conversation_id="42",
                            conversation_type="direct",
                            sender_id="42",
                            content=PROMPT,
                            received_at=time.time(),
                        )
                        t0 = time.perf_counter()
                        await rt.accept(msg)
                        await rt.wait_idle()
                        if out.sent[-1].text != "echo: " + PROMPT:
                            raise SystemExit(f"unexpected answer: {out.sent[-1].text!r}")
                        if i >= args.warmup:
                            floor.append(floor_ms)
                            adapter.append((out.first_update_at - harness.handed_at) * 1000)
                            accept.append((out.first_update_at - t0) * 1000)
                await inner.aclose()
    print(
        f"python {sys.version.split()[0]}, trio {trio.__version__}, httpx {httpx.__version__}, "
        f"msgspec {msgspec.__version__}; {args.turns} turns after {args.warmup} warm-up"
    )
    print(f"{'time to first token (ms)':46} {'p50':>8} {'p99':>8} {'mean':>8}")
    rows = [
        ("floor: raw httpx SSE loop", floor),
        ("dshim: prompt handed to adapter -> renderer", adapter),
        ("dshim: accept() -> renderer", accept),
    ]
    for name, values in rows:
        print(
            f"{name:46} {pct(values, 50):8.2f} {pct(values, 99):8.2f} {statistics.fmean(values):8.2f}"
        )
    over50 = pct(adapter, 50) - pct(floor, 50)
    over99 = pct(adapter, 99) - pct(floor, 99)
    print(f"{'overhead added by dshim (adapter - floor)':46} {over50:8.2f} {over99:8.2f}")
    print(
        f"ratio dshim adapter / floor: p50 {pct(adapter, 50) / pct(floor, 50):.2f}x, "
        f"p99 {pct(adapter, 99) / pct(floor, 99):.2f}x"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--turns", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=30)
    trio.run(main, parser.parse_args())
