"""The web chat page in a real browser: headless Chromium driven by Playwright.

dshim runs in the test's trio run on the real clock (the store, the local HTTP endpoint
on 127.0.0.1 port 0, the echo harness); the browser is driven with Playwright's sync API
in a worker thread (``trio.to_thread.run_sync``: Playwright's async API does not run on
trio).  Every Playwright wait has a timeout and the test has a hard deadline, so a
broken page fails instead of hanging.  The system Chromium is used, ``$CHROMIUM`` when set
(Playwright's own browser download is not available here); nothing leaves 127.0.0.1.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import trio
from playwright.sync_api import Browser, Page, expect, sync_playwright
from structlog.testing import capture_logs

from dshim.channels.webchat import channel as webchat_channel
from dshim.harness.echo import EchoHarness
from tests.rig_webchat import bot_quote, serving, source_block

#: The browser: ``$CHROMIUM`` when set (a path), else Debian's (``scripts/chromium`` installs it).
CHROMIUM = os.environ.get("CHROMIUM") or "/usr/bin/chromium"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
WAIT_MS = 15_000


def open_page(browser: Browser, url: str, name: str) -> Page:
    page = browser.new_page() if not browser.contexts else browser.contexts[0].new_page()
    page.set_default_timeout(WAIT_MS)
    page.goto(url)
    expect(page.locator("#status")).to_have_text("connected")
    page.fill("#name", name)
    page.press("#name", "Tab")  # the change event: this tab is now that person
    return page


def say(page: Page, text: str) -> None:
    page.fill("#input", text)
    page.press("#input", "Enter")


def bot_messages(page: Page):  # type: ignore[no-untyped-def]
    return page.locator("#messages li.msg.bot")


def user_id(page: Page) -> str:
    identity = page.evaluate("sessionStorage.getItem('dshim.identity')")
    return str(json.loads(identity)["id"])


def drive(url: str) -> None:
    """Everything the issue asks the page to do, in one browser session."""
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            browser.new_context()
            ann = open_page(browser, url, "Ann")
            ann_id = user_id(ann)
            direct = source_block("direct", ann_id, "Ann")

            # A message, and its echo streamed in: shown while written, then final.
            say(ann, "echo:slow 5 hello from the page")
            expect(bot_messages(ann).first).to_have_class(re.compile(r"\bstreaming\b"))
            first = bot_messages(ann).first
            expect(first).not_to_have_class(re.compile(r"\bstreaming\b"))
            answer = f"{direct}\n\necho:slow 5 hello from the page"
            expect(first.locator(".body")).to_have_text(answer, use_inner_text=True)
            answer_id = first.get_attribute("data-id")
            assert answer_id and answer_id.startswith("b-")

            # "Reply" quotes the bot's answer: the agent gets the exact reply block.
            first.get_by_role("button", name="Reply").click()
            expect(ann.locator("#reply-preview")).to_be_visible()
            say(ann, "why that?")
            expect(bot_messages(ann)).to_have_count(2)
            quoted = bot_messages(ann).nth(1)
            expected = f"{direct}\n\n{bot_quote(answer_id, answer)}\n\nwhy that?"
            expect(quoted.locator(".body")).to_have_text(expected, use_inner_text=True)
            expect(ann.locator("#messages li.msg.mine").nth(1).locator(".quote")).to_contain_text(
                "web: <dsh_im_source>"
            )

            # echo:slow, then /stop: the partial answer ends marked as stopped.
            say(ann, "echo:slow 40 a long story")
            expect(bot_messages(ann).nth(2)).to_have_class(re.compile(r"\bstreaming\b"))
            say(ann, "/stop")
            expect(bot_messages(ann).nth(2).locator(".body")).to_contain_text("⏹ Stopped.")
            expect(bot_messages(ann).nth(2)).not_to_have_class(re.compile(r"\bstreaming\b"))

            # An approval, answered with its button.
            say(ann, "echo:approval")
            allow = ann.get_by_role("button", name="Allow once")
            allow.click()
            expect(ann.locator("#messages")).to_contain_text("Approval decision: allow_once")
            expect(allow).to_have_count(0)  # the request no longer waits: no buttons

            # A message with markup is text: nothing of it runs or becomes an element.
            hostile = '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2">'
            say(ann, hostile)
            mine = ann.locator("#messages li.msg.mine").last
            expect(mine.locator(".body")).to_have_text(hostile, use_inner_text=True)
            expect(bot_messages(ann).last.locator(".body")).to_contain_text(hostile)
            assert ann.locator("#messages script, #messages img").count() == 0
            assert ann.evaluate("window.__pwned") is None
            shown = bot_messages(ann).count()

            # An upload within the limits goes with the message; one over them does not.
            png = b"\x89PNG\r\n\x1a\n" + b"\0" * 64
            ann.set_input_files(
                "#files", [{"name": "cat.png", "mimeType": "image/png", "buffer": png}]
            )
            say(ann, "a picture")
            expect(ann.locator("#messages li.msg.mine").last.locator(".files")).to_have_text(
                "🖼 cat.png"
            )
            expect(bot_messages(ann)).to_have_count(shown + 1)
            big = png + b"\0" * (5 * 1024 * 1024)
            ann.set_input_files(
                "#files", [{"name": "big.png", "mimeType": "image/png", "buffer": big}]
            )
            expect(ann.locator("#notice")).to_have_text(
                "big.png is 5.0 MiB: an image can be at most 5.0 MiB."
            )
            say(ann, "too big to send")
            expect(ann.locator("#notice")).to_be_visible()
            assert ann.locator("#messages").get_by_text("too big to send").count() == 0
            ann.set_input_files("#files", [])
            ann.fill("#input", "")
            shown = bot_messages(ann).count()

            # Reload: the history comes back from the store, answers and quotes included.
            ann.reload()
            expect(ann.locator("#status")).to_have_text("connected")
            expect(bot_messages(ann)).to_have_count(shown)
            expect(ann.locator("#messages li.msg.mine").nth(1).locator(".quote")).to_contain_text(
                "web: <dsh_im_source>"
            )
            expect(ann.locator("#messages")).to_contain_text("Approval decision: allow_once")

            # A room, two tabs as two people: only an @web message is answered.
            ann.click("#new-room")
            ann.fill("#room-name", "Lab")
            ann.press("#room-name", "Enter")
            expect(ann.locator("#title")).to_have_text("# lab")
            bob = open_page(browser, url, "Bob")
            bob.click("#new-room")
            bob.fill("#room-name", "lab")
            bob.press("#room-name", "Enter")
            expect(bob.locator("#title")).to_have_text("# lab")
            say(bob, "just chatting among us")
            expect(ann.locator("#messages li.msg.other")).to_contain_text("just chatting among us")
            say(bob, "@web what is this room?")
            expect(ann.locator("#messages li.msg.other")).to_have_count(2)
            expect(bot_messages(bob)).to_have_count(1)
            expect(bot_messages(ann)).to_have_count(1)
            room = source_block("group", user_id(bob), "Bob")
            expect(bot_messages(ann).first.locator(".body")).to_have_text(
                f"{room}\n\nwhat is this room?", use_inner_text=True
            )
        finally:
            browser.close()


@pytest.mark.deadline(180)
async def test_the_page_in_chromium(tmp_path: Path) -> None:
    async with serving(tmp_path, harness=EchoHarness(slow_interval_s=0.25), inline=False) as s:
        await trio.to_thread.run_sync(drive, s.url + "/", abandon_on_cancel=True)


TOKEN = "a-token-for-the-browser-test-0123456789"


def sign_in_and_chat(url: str) -> None:
    """With a token: the page first shows the login form, then chats with the cookie."""
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            page = browser.new_page()
            page.set_default_timeout(WAIT_MS)
            page.goto(url)
            expect(page.locator("form#login")).to_be_visible()  # redirected to /login
            page.fill("#token", "not the token")
            page.press("#token", "Enter")
            expect(page.locator("body")).to_contain_text("not the token")
            page.goto(url)
            page.fill("#token", TOKEN)
            page.press("#token", "Enter")
            expect(page.locator("#status")).to_have_text("connected")
            assert "dshim" not in page.evaluate("document.cookie")  # HttpOnly: not for scripts
            [cookie] = page.context.cookies()
            assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
            assert TOKEN not in cookie["value"]
            say(page, "signed in")
            expect(bot_messages(page).first.locator(".body")).to_contain_text("signed in")
        finally:
            browser.close()


@pytest.mark.deadline(120)
async def test_with_a_token_the_page_signs_in_once_and_chats(tmp_path: Path) -> None:
    async with serving(tmp_path, inline=False, token=TOKEN) as s:
        await trio.to_thread.run_sync(sign_in_and_chat, s.url + "/", abandon_on_cancel=True)


def closed_and_back(url: str, close: Callable[[], None]) -> None:
    """dshim closes the page's socket as it closes one that did not join: the page
    reconnects, joins at once and chats on."""
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            page = open_page(browser, url, "Ann")
            say(page, "before")
            expect(bot_messages(page)).to_have_count(1)
            close()
            # Sent on the new socket (or from the outbox once it is open): it is answered
            # only if that socket joined the conversation.
            say(page, "echo:slow 8 after the close")
            expect(bot_messages(page)).to_have_count(2)
            expect(bot_messages(page).nth(1)).not_to_have_class(re.compile(r"\bstreaming\b"))
            expect(bot_messages(page).nth(1).locator(".body")).to_contain_text("after the close")
            expect(page.locator("#status")).to_have_text("connected")
        finally:
            browser.close()


@pytest.mark.deadline(120)
async def test_the_page_joins_at_once_and_comes_back_after_dshim_closes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A join deadline much shorter than 10 s: a page that did not join as soon as its
    # socket opens would be closed for it during the slow answer (2 s) below.
    monkeypatch.setattr(webchat_channel, "JOIN_DEADLINE_S", 0.5)
    with capture_logs() as logs:
        async with serving(tmp_path, harness=EchoHarness(slow_interval_s=0.25), inline=False) as s:
            close = functools.partial(
                trio.from_thread.run,
                s.endpoint.close_sockets,
                webchat_channel.JOIN_TIMEOUT_CODE,
                "no join within 10 s",
            )
            drive = functools.partial(closed_and_back, s.url + "/", close)
            await trio.to_thread.run_sync(drive, abandon_on_cancel=True)
    dismissed = [e for e in logs if e["event"] == "tab_dismissed"]
    assert dismissed == []
