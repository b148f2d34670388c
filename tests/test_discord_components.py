"""Discord buttons end to end: substitute control notices, approvals and questions.

Testing manifesto: the real Discord channel run by ``dshim.serve.serve_bots`` (through
:func:`tests.test_discord_e2e.running_bot`) against the fake Discord on 127.0.0.1, port
0, with a real SQLite store, on trio's autojump clock (Discord's 3 s answer window is
exact virtual time).  A press is what Discord sends when a person presses a button
(INTERACTION_CREATE with a fresh id and token); the fake checks the callback's token
and window and applies an UPDATE_MESSAGE to the message.  Assertions are what a person
sees: the buttons on a message, its text after the press, the answers in the chat.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio
from structlog.testing import capture_logs

from dshim.outbound import CONTROL_ACTIONS
from dshim.testing.fakes.discord import FakeDiscord, FakeInteraction
from tests.test_discord_e2e import answered, running_bot

OWNER_ID = "111111111111111111"
OPERATOR_ID = "222222222222222222"
OWNER = {"id": OWNER_ID, "username": "olga", "global_name": "Olga"}
OPERATOR = {"id": OPERATOR_ID, "username": "oscar", "global_name": "Oscar"}
SUBSTITUTE = {
    "substitute": {"enabled": True, "targets": [{"name": "Olga", "id": OWNER_ID}]},
    "access": {"operators": [OPERATOR_ID]},
}
STOP_LABEL, DISABLE_LABEL = (label for _, label in CONTROL_ACTIONS)


def buttons(msg: dict[str, Any]) -> list[dict[str, Any]]:
    return [b for row in msg.get("components", []) for b in row["components"]]


def callbacks(inter: FakeInteraction) -> list[tuple[Any, int]]:
    return [(body, status) for _, body, status in inter.callbacks]


async def notice_for(fake: FakeDiscord) -> dict[str, Any]:
    """The control notice in the operator's DM (once it is there)."""
    await fake.wait_until(
        lambda: (
            OPERATOR_ID in fake.dm_channels
            and bool(fake.bot_messages(fake.dm_channels[OPERATOR_ID]))
        )
    )
    [notice] = fake.bot_messages(fake.dm_channels[OPERATOR_ID])
    return notice


async def trigger(fake: FakeDiscord, text: str) -> dict[str, Any]:
    return await fake.user_message(
        fake.text_channel, f"{text} <@{OWNER_ID}>", mention_users=[OWNER]
    )


async def slow_after_notice(fake: FakeDiscord) -> tuple[dict[str, Any], dict[str, Any]]:
    """A first trigger opens the session (the notice follows its answer); then a slow
    second trigger is answering.  Returns (notice, the slow trigger)."""
    await trigger(fake, "are you there?")
    notice = await notice_for(fake)
    asked = await trigger(fake, "echo:slow 30 deploy?")
    await trio.sleep(2)
    return notice, asked


# --- the substitute control notice ------------------------------------------------------------


async def test_the_control_notice_has_the_two_buttons_and_stop_stops_the_answer(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with running_bot(tmp_path, **SUBSTITUTE) as (bot, fake):
        notice, asked = await slow_after_notice(fake)
        assert "are you there?" in notice["content"]
        chan = fake.text_channel
        assert [(b["label"], b["custom_id"], b["style"]) for b in buttons(notice)] == [
            (STOP_LABEL, f"dshim:ctl:stop:{chan}:-", 4),
            (DISABLE_LABEL, f"dshim:ctl:disable:{chan}:-", 2),
        ]
        assert all(len(b["custom_id"]) <= 100 for b in buttons(notice))
        pressed = await fake.press(notice, label=STOP_LABEL, user=OPERATOR)
        await fake.wait_until(lambda: bool(pressed.callbacks))
        # Answered within the 3 s: the notice now says what happened, without buttons.
        [(body, status)] = callbacks(pressed)
        assert status == 204 and pressed.callbacks[0][0] - pressed.made_at < 3
        assert body == {"type": 7, "data": {"content": "Stopped the answer.", "components": []}}
        after = fake.messages[notice["id"]]
        assert after["content"] == "Stopped the answer." and after["components"] == []
        # The substitute answer in the group (a thread on the trigger) was stopped.
        await fake.wait_until(lambda: bool(fake.bot_messages(asked["id"])))
        await trio.sleep(20)
        [answer] = fake.bot_messages(asked["id"])
        assert answer["content"].endswith("⏹ Stopped.")
        assert "deploy?" not in answer["content"]


async def test_disable_turns_substitute_off_there_so_a_later_mention_is_no_trigger(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with running_bot(tmp_path, **SUBSTITUTE) as (bot, fake):
        first = await trigger(fake, "can I merge?")
        notice = await notice_for(fake)
        await fake.wait_until(lambda: bool(fake.bot_messages(first["id"])))
        pressed = await fake.press(notice, label=DISABLE_LABEL, user=OPERATOR)
        await fake.wait_until(lambda: bool(pressed.callbacks))
        [(body, status)] = callbacks(pressed)
        assert status == 204
        assert body["data"]["content"].startswith("Substitute mode is off in that chat")
        assert fake.messages[notice["id"]]["components"] == []
        drops = len(bot.drop_reasons())
        later = await trigger(fake, "and now?")
        await trio.sleep(10)
        assert later["id"] not in fake.channels  # no thread opened on it: no answer
        assert fake.bot_messages(later["id"]) == []
        assert bot.drop_reasons()[drops:] == ["unaddressed"]


async def test_a_press_by_someone_who_is_not_an_operator_gets_the_refusal(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with running_bot(tmp_path, **SUBSTITUTE) as (bot, fake):
        notice, asked = await slow_after_notice(fake)
        stranger = fake.make_user("mallory")
        pressed = await fake.press(notice, label=STOP_LABEL, user=stranger)
        await fake.wait_until(lambda: bool(pressed.callbacks))
        [(body, status)] = callbacks(pressed)
        assert status == 204
        assert body["data"]["content"] == "Only the bot's operators may use these buttons."
        # Nothing was stopped: the answer arrives in full.
        await fake.wait_until(lambda: bool(fake.bot_messages(asked["id"])))
        await trio.sleep(20)
        [answer] = fake.bot_messages(asked["id"])
        assert "deploy?" in answer["content"] and "Stopped" not in answer["content"]


async def test_a_late_press_is_still_acted_on_and_the_notice_edited_instead(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    """A press that reaches the bot after Discord's 3 s (a slow gateway, a Resume replay):
    Discord refuses the callback (404 10062) and has shown the operator "This interaction
    failed"; the stop is still done, and the notice is edited to say so (PATCH)."""
    async with running_bot(tmp_path, **SUBSTITUTE) as (bot, fake):
        notice, asked = await slow_after_notice(fake)
        with capture_logs() as logs:
            pressed = await fake.press(notice, label=STOP_LABEL, user=OPERATOR, delay_s=4)
            await fake.wait_until(lambda: bool(pressed.callbacks))
            await fake.wait_until(lambda: fake.messages[notice["id"]]["components"] == [])
        [(_, status)] = callbacks(pressed)
        assert status == 404
        assert fake.messages[notice["id"]]["content"] == "Stopped the answer."
        assert any(e["event"] == "interaction_callback_failed" and e["late"] is True for e in logs)
        await trio.sleep(20)
        [answer] = fake.bot_messages(asked["id"])
        assert answer["content"].endswith("⏹ Stopped.")


async def test_a_replayed_press_is_answered_once_and_the_token_is_never_logged_or_stored(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with running_bot(tmp_path, **SUBSTITUTE) as (bot, fake):
        notice, _ = await slow_after_notice(fake)
        with capture_logs() as logs:
            pressed = await fake.press(notice, label=STOP_LABEL, user=OPERATOR)
            await fake.wait_until(lambda: bool(pressed.callbacks))
            # The same dispatch again (what a Resume replays): no second answer.
            session = fake._current
            assert session is not None
            frame = next(f for _, t, f in session.log if t == "INTERACTION_CREATE")
            conn = fake.live
            assert conn is not None
            conn.push("text", frame)
            await trio.sleep(5)
        assert len(pressed.callbacks) == 1
        assert any(e["event"] == "interaction_duplicate" for e in logs)
        assert pressed.token not in repr(logs)
    assert not files_containing(tmp_path, pressed.token.encode())


def files_containing(root: Path, secret: bytes) -> list[Path]:
    """The files under ``root`` (the store and its journal) in which ``secret`` occurs."""
    return [p for p in root.rglob("*") if p.is_file() and secret in p.read_bytes()]


# --- approvals and questions ---------------------------------------------------------------


async def ask(
    fake: FakeDiscord, channel: str, text: str, **kw: Any
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A user's message that makes the agent ask; returns it and the request with buttons."""
    asked = await fake.user_message(channel, text, **kw)
    await fake.wait_until(lambda: any(buttons(m) for m in fake.bot_messages(channel)))
    return asked, next(m for m in fake.bot_messages(channel) if buttons(m))


async def test_an_approval_shows_buttons_and_a_press_decides_it(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        dm = fake.dm_channel
        asked, request = await ask(fake, dm, "echo:approval")
        assert request["message_reference"]["message_id"] == asked["id"]
        assert [(b["label"], b["style"]) for b in buttons(request)] == [
            ("Allow once", 3),
            ("Allow always", 3),
            ("Reject", 4),
        ]
        assert "run the scripted action" in request["content"]
        pressed = await fake.press(request, label="Allow always")
        await answered(fake, dm, "Approval decision: allow_always")
        assert callbacks(pressed) == [({"type": 6}, 204)]
        after = fake.messages[request["id"]]
        assert after["components"] == []
        assert after["content"].endswith("→ Allow always")
        # The press was one answer: no turn of its own.
        assert not any(m["content"].startswith("<dsh_im") for m in fake.bot_messages(dm))


async def test_an_approval_answered_by_typing_closes_the_buttons(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        dm = fake.dm_channel
        _, request = await ask(fake, dm, "echo:approval")
        shown = list(request["components"])
        await fake.user_message(dm, "no")
        await answered(fake, dm, "Approval decision: reject_once")
        await fake.wait_until(lambda: fake.messages[request["id"]]["components"] == [])
        assert fake.messages[request["id"]]["content"].endswith("This request is closed.")
        # A press on the closed request: buttons gone, nothing reaches the agent.
        fake.messages[request["id"]]["components"] = shown  # a client that did not refresh
        late = await fake.press(request, label="Allow once")
        await fake.wait_until(lambda: bool(late.callbacks))
        [(body, status)] = callbacks(late)
        assert status == 204 and body["type"] == 7 and body["data"]["components"] == []
        assert body["data"]["content"].endswith("This request is closed.")
        await trio.sleep(5)
        assert sum(m["content"].startswith("Approval decision") for m in fake.bot_messages(dm)) == 1


async def test_a_question_in_a_group_is_answered_by_the_starters_press_only(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        chan = fake.text_channel
        _, request = await ask(fake, chan, "echo:question", mention_bot=True)
        assert [b["label"] for b in buttons(request)] == ["Red", "Blue"]
        bob = fake.make_user("bob", global_name="Bob")
        other = await fake.press(request, label="Red", user=bob)
        await fake.wait_until(lambda: bool(other.callbacks))
        await trio.sleep(2)
        # Bob is not the one who asked: the buttons stay, the question still waits.
        assert buttons(fake.messages[request["id"]])
        assert not any(m["content"].startswith("Answer:") for m in fake.bot_messages(chan))
        mine = await fake.press(request, label="Blue")
        await answered(fake, chan, "Answer: Blue")
        assert callbacks(mine) == [({"type": 6}, 204)]
        after = fake.messages[request["id"]]
        assert after["components"] == [] and after["content"].endswith("→ Blue")


async def test_an_approval_inside_a_thread_is_decided_by_a_press_there(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        thread = fake.thread_channel
        _, request = await ask(fake, thread, "echo:approval", mention_bot=True)
        assert {b["custom_id"] for b in buttons(request)} == {
            f"dshim:opt:{n}:{thread}" for n in (1, 2, 3)
        }
        await fake.press(request, label="Reject")
        await answered(fake, thread, "Approval decision: reject_once")
        assert fake.messages[request["id"]]["content"].endswith("→ Reject")


async def test_a_late_press_on_a_request_still_answers_it(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        dm = fake.dm_channel
        _, request = await ask(fake, dm, "echo:approval")
        pressed = await fake.press(request, label="Allow once", delay_s=5)
        await answered(fake, dm, "Approval decision: allow_once")
        assert callbacks(pressed) == [({"type": 6}, 404)]  # Discord: Unknown interaction
        assert fake.messages[request["id"]]["content"].endswith("→ Allow once")


# --- the callback endpoint, as the REST client meets it -----------------------------------------


async def test_the_fake_checks_the_token_the_window_and_a_single_answer(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    from dshim.channels.discord.client import USER_AGENT, RestClient
    from dshim.errors import ChannelError, NotFound
    from dshim.net.http import open_http

    async with running_bot(tmp_path, **SUBSTITUTE) as (bot, fake):
        notice, _ = await slow_after_notice(fake)
        async with open_http(fake.api_base, user_agent=USER_AGENT) as http:
            rest = RestClient(http, token="not-needed-here", api_base=fake.api_base)
            pressed = await fake.press(notice, label=STOP_LABEL, user=OPERATOR)
            await fake.wait_until(lambda: bool(pressed.callbacks))
            update = {"type": 7, "data": {"content": "again"}}
            errors: list[ChannelError] = []
            for token in ("a-wrong-token", pressed.token):  # the bot has answered already
                try:
                    await rest.interaction_callback(pressed.id, token, update)
                except ChannelError as exc:
                    errors.append(exc)
            assert [(e.status, e.code) for e in errors] == [(401, 50027), (400, 40060)]
            fake.interactions[pressed.id].answered = False  # as if never answered, but late
            await trio.sleep(5)
            try:
                await rest.interaction_callback(pressed.id, pressed.token, update)
            except NotFound as exc:
                assert exc.code == 10062 and pressed.token not in str(exc)
            else:  # pragma: no cover - the assertion of this test
                raise AssertionError("a callback after the 3 s was taken")
