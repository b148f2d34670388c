"""``dshim login BOT`` for WeChat: the iLink QR login.

``get_bot_qrcode`` (with the saved token, if any, in ``local_token_list``) gives a QR
id and the URL to render; the QR is printed to the terminal (segno) with the URL, then
``get_qrcode_status`` is long-polled (protocol.login_step):

- ``wait`` / ``scaned``: keep polling (1 s apart; a client timeout is ``wait``); the
  terminal and the log hear of a status only when it changes, not once a poll;
- ``need_verifycode``: ask for the number the phone shows, poll again with it;
- ``expired`` / ``verify_code_blocked``: a new QR, at most :data:`QR_REFRESHES` times;
- ``scaned_but_redirect``: poll ``https://<redirect_host>`` from now on (only a
  ``*.weixin.qq.com`` host, or the configured host itself: the login answer decides
  where the token goes next, so it is not trusted blindly);
- ``binded_redirect``: the bot is already bound to a saved token: keep it;
- ``confirmed``: save token, bot id, base URL and user (creds.py) — never printed.
"""

from __future__ import annotations

import urllib.parse

import structlog
import trio

from dshim.channels.base import LoginContext
from dshim.channels.kit.qr import render_qr
from dshim.channels.weixin import creds, protocol
from dshim.channels.weixin import models as m
from dshim.channels.weixin.client import CALL_TIMEOUT, USER_AGENT, IlinkClient
from dshim.errors import ChannelError
from dshim.net.http import open_http

log = structlog.get_logger("dshim.weixin")

QR_REFRESHES = 3
POLL_PAUSE_S = 1.0
#: The whole wait for a scan (the plugin's default).
LOGIN_DEADLINE_S = 480.0
TRUSTED_DOMAIN = "weixin.qq.com"


def trusted_base(candidate: str, configured: str) -> str | None:
    """``candidate`` as a base URL when it may receive the token: https on
    ``weixin.qq.com`` or a subdomain, or the configured host (any port, its scheme)."""
    text = candidate.strip()
    if "://" not in text:
        text = "https://" + text
    parts = urllib.parse.urlsplit(text)
    host = (parts.hostname or "").lower()
    conf = urllib.parse.urlsplit(configured)
    if host and host == (conf.hostname or "").lower():
        scheme = conf.scheme
    elif parts.scheme == "https" and (
        host == TRUSTED_DOMAIN or host.endswith("." + TRUSTED_DOMAIN)
    ):
        scheme = "https"
    else:
        return None
    netloc = host if parts.port is None else f"{host}:{parts.port}"
    return f"{scheme}://{netloc}{parts.path.rstrip('/')}"


async def run_login(ctx: LoginContext, *, api_base: str, cdn_base: str) -> int:
    """The QR flow; returns the exit code (0 logged in or already bound, 1 failed)."""
    name = ctx.bot.name
    saved = await creds.load_login(ctx.data_dir, name)
    local = [saved.bot_token] if saved is not None else []
    async with open_http(None, user_agent=USER_AGENT, timeout=CALL_TIMEOUT) as http:
        client = IlinkClient(http, None, cdn_base=cdn_base)
        with trio.move_on_after(LOGIN_DEADLINE_S):
            return await _flow(ctx, client, api_base, local)
    ctx.say("No confirmation in time; run `dshim login` again.")
    return 1


async def _flow(ctx: LoginContext, client: IlinkClient, api_base: str, local: list[str]) -> int:
    host = api_base
    refreshes = 0
    while True:
        qr = await client.get_bot_qrcode(api_base, local)
        if not qr.qrcode or not qr.qrcode_img_content:
            ctx.say("WeChat answered without a QR code; try again later.")
            return 1
        ctx.register_secret(qr.qrcode)
        ctx.say("Scan this QR code with WeChat on your phone:")
        ctx.say(render_qr(qr.qrcode_img_content))
        ctx.say(f"or open: {qr.qrcode_img_content}")
        verify: str | None = None
        shown: tuple[str, str] | None = None  # the last status told: (action, detail)
        while True:
            try:
                status = await client.get_qrcode_status(host, qr.qrcode, verify)
            except ChannelError as exc:
                log.warning("login_poll_failed", error=str(exc))
                await trio.sleep(POLL_PAUSE_S * 2)
                continue
            step = protocol.login_step(status)
            changed = (step.action, step.detail) != shown
            shown = (step.action, step.detail)
            if changed:
                log.info("login_status_changed", action=step.action)
            if step.action == "wait":
                if step.detail and changed:
                    ctx.say(step.detail)
                await trio.sleep(POLL_PAUSE_S)
                continue
            if step.action == "verify":
                verify = (await ctx.ask("Enter the number shown on your phone: ")).strip()
                continue
            if step.action == "redirect":
                target = trusted_base(step.redirect_host or "", api_base)
                if target is None:
                    ctx.say("WeChat redirected the login to an untrusted host; stopping.")
                    return 1
                host = target
                continue
            if step.action == "bound":
                if local:
                    ctx.say("This bot is already bound; the saved login is kept.")
                    return 0
                ctx.say("WeChat says the bot is already bound, but no saved login exists.")
                return 1
            if step.action == "confirmed":
                return await _save(ctx, status, api_base)
            if step.action == "new_qr":
                refreshes += 1
                if refreshes > QR_REFRESHES:
                    ctx.say(f"{step.detail}; giving up after {QR_REFRESHES} new codes.")
                    return 1
                ctx.say(f"{step.detail}; here is a new one.")
                break
            ctx.say(f"Login failed: {step.detail}")
            return 1


async def _save(ctx: LoginContext, status: m.QrStatus, api_base: str) -> int:
    assert status.bot_token is not None and status.ilink_bot_id is not None
    ctx.register_secret(status.bot_token)
    base = api_base
    if status.baseurl:
        trusted = trusted_base(status.baseurl, api_base)
        if trusted is None:
            log.warning("login_baseurl_refused")
        else:
            base = trusted
    login = creds.SavedLogin(
        bot_token=status.bot_token,
        ilink_bot_id=status.ilink_bot_id,
        baseurl=base,
        ilink_user_id=status.ilink_user_id,
    )
    path = await creds.save_login(ctx.data_dir, ctx.bot.name, login)
    ctx.say(f"Logged in as {status.ilink_bot_id}; credentials saved to {path}.")
    return 0
