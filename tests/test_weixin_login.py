"""``dshim login BOT`` for WeChat: the QR flow against the fake iLink login API."""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Any

import trio
from typer.testing import CliRunner

from dshim.channels.registry import parse_config
from dshim.channels.weixin import creds
from dshim.channels.weixin.channel import CHANNEL
from dshim.cli import app
from dshim.testing.fakes.weixin import TEST_TOKEN, USER, FakeWeixin, open_fake_weixin
from tests.rig_weixin import (
    BOT,
    DEADLINE,
    echo_of,
    polling,
    running_bot,
    texts,
    weixin_world,
)


class Terminal:
    """A scripted terminal: answers ``ask`` in order, keeps what was said."""

    def __init__(self, fake: FakeWeixin, data_dir: Path, answers: list[str] | None = None) -> None:
        config = parse_config(
            {"bots": [{"name": BOT, "channel": "weixin", "api_base": fake.url}]}, env={}
        )
        self.bot = config.bots[0]
        self.data_dir = data_dir
        self.answers = list(answers or [])
        self.said: list[str] = []
        self.asked: list[str] = []
        self.secrets: list[str] = []

    def settings_as(self, kind: Any) -> Any:
        assert isinstance(self.bot.settings, kind)
        return self.bot.settings

    def register_secret(self, secret: str) -> None:
        self.secrets.append(secret)

    def say(self, text: str) -> None:
        self.said.append(text)

    async def ask(self, prompt: str) -> str:
        self.asked.append(prompt)
        return self.answers.pop(0)


async def login(term: Terminal) -> int:
    assert CHANNEL.login_fn is not None
    return await CHANNEL.login_fn(term)


async def test_qr_login_with_verify_code_and_redirect_saves_the_credentials(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    with trio.fail_after(DEADLINE):
        async with open_fake_weixin() as fake:
            fake.login_script = [
                {"status": "wait"},
                {"status": "scaned"},
                {"status": "need_verifycode"},
                {"status": "scaned_but_redirect"},
                {"status": "wait"},
                {"status": "confirmed"},
            ]
            term = Terminal(fake, tmp_path, answers=["17", fake.verify_code])
            assert await login(term) == 0
    saved = await creds.load_login(tmp_path, BOT)
    assert saved is not None
    assert (saved.bot_token, saved.ilink_bot_id, saved.ilink_user_id) == (
        TEST_TOKEN,
        fake.bot_id,
        USER,
    )
    assert saved.baseurl == fake.url
    path = creds.login_path(tmp_path, BOT)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    said = "\n".join(term.said)
    assert "https://liteapp.weixin.qq.com/q/fake1" in said  # the URL, next to the QR
    assert "█" in said or "▀" in said or "▄" in said  # the QR itself
    assert TEST_TOKEN not in said and TEST_TOKEN in term.secrets
    assert len(term.asked) == 2  # a wrong number is asked again
    polls = fake.calls_to("get_qrcode_status")
    assert [c.query.get("verify_code") for c in polls[3:5]] == ["17", fake.verify_code]
    redirect_host = fake.redirect_url.split("://", 1)[1]
    assert [c.host == redirect_host for c in polls] == [False] * 5 + [True] * 2


async def test_an_expired_qr_is_refreshed_at_most_3_times(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    with trio.fail_after(DEADLINE):
        async with open_fake_weixin() as fake:
            fake.login_script = [{"status": "expired"}]
            term = Terminal(fake, tmp_path)
            assert await login(term) == 1
    assert len(fake.calls_to("get_bot_qrcode")) == 4
    assert await creds.load_login(tmp_path, BOT) is None


async def test_binded_redirect_keeps_the_existing_login(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    with trio.fail_after(DEADLINE):
        async with open_fake_weixin() as fake:
            old = creds.SavedLogin(bot_token="old-token-1234567", ilink_bot_id="old@im.bot")
            await creds.save_login(tmp_path, BOT, old)
            fake.login_script = [{"status": "binded_redirect"}]
            term = Terminal(fake, tmp_path)
            assert await login(term) == 0
    saved = await creds.load_login(tmp_path, BOT)
    assert saved is not None and saved.bot_token == "old-token-1234567"
    assert fake.calls_to("get_bot_qrcode")[0].body == {"local_token_list": ["old-token-1234567"]}


async def test_a_redirect_to_a_foreign_host_is_refused(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    with trio.fail_after(DEADLINE):
        async with open_fake_weixin() as fake:
            fake.login_script = [{"status": "scaned_but_redirect", "redirect_host": "evil.example"}]
            assert await login(Terminal(fake, tmp_path)) == 1
    assert await creds.load_login(tmp_path, BOT) is None


async def test_serve_uses_the_saved_login_when_the_config_has_no_token(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    with trio.fail_after(DEADLINE):
        async with weixin_world(tmp_path) as w:
            term = Terminal(w.fake, tmp_path)
            assert await login(term) == 0
            async with running_bot(w, token=None, bot_id=None):
                await polling(w.fake)
                w.fake.user_message("after login")
                await w.fake.wait_until(lambda: echo_of("after login") in texts(w.fake))


async def test_serve_without_token_or_login_is_fatal_and_says_how_to_log_in(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    with trio.fail_after(DEADLINE):
        async with weixin_world(tmp_path) as w, running_bot(w, token=None) as run:
            await trio.sleep(60)
            assert run.results == {BOT: "fatal"}
    assert w.fake.calls == []


def test_login_verb_on_a_channel_without_login_exits_2(tmp_path: Path) -> None:
    cfg = tmp_path / "dshim.toml"
    cfg.write_text(
        '[[bots]]\nname = "tg"\nchannel = "telegram"\ntoken = "123456:abcdefghijklmnopqrstuvwxyz"\n'
    )
    result = CliRunner().invoke(
        app, ["--config", str(cfg), "--data-dir", str(tmp_path / "d"), "login", "tg"]
    )
    assert result.exit_code == 2
    assert "has no login step" in result.output
    result = CliRunner().invoke(app, ["--config", str(cfg), "login", "nobody"])
    assert result.exit_code == 2 and "no bot named 'nobody'" in result.output


def test_the_login_verb_runs_the_qr_flow_in_the_terminal(tmp_path: Path) -> None:
    """``dshim login wx`` end to end: the fake in a thread of its own, the code typed in."""
    import threading

    ready = threading.Event()
    stop = threading.Event()
    box: dict[str, Any] = {}

    def serve() -> None:
        async def main() -> None:
            async with open_fake_weixin() as fake:
                fake.login_script = [{"status": "need_verifycode"}, {"status": "confirmed"}]
                box["fake"] = fake
                ready.set()
                await trio.to_thread.run_sync(stop.wait)

        trio.run(main)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        assert ready.wait(10)
        fake = box["fake"]
        cfg = tmp_path / "dshim.toml"
        cfg.write_text(f'[[bots]]\nname = "wx"\nchannel = "weixin"\napi_base = "{fake.url}"\n')
        result = CliRunner().invoke(
            app,
            ["--config", str(cfg), "--data-dir", str(tmp_path / "data"), "login", "wx"],
            input=f"{fake.verify_code}\n",
        )
    finally:
        stop.set()
        thread.join(10)
    assert result.exit_code == 0, result.output
    assert "Enter the number shown on your phone" in result.output
    assert "https://liteapp.weixin.qq.com/q/fake1" in result.output
    assert TEST_TOKEN not in result.output
    saved = creds.login_path(tmp_path / "data", "wx").read_text()
    assert TEST_TOKEN in saved
