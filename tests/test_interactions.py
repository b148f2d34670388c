"""Approvals and questions over IM, through the real pipeline with the echo harness.

The echo harness asks (``echo:approval``, ``echo:question``) and then answers with what
came back, so every test reads like a chat: what the user saw, what they typed, what the
agent was told.  Autojump clock (timeouts are exact and instant), real SQLite, a hard
deadline per test.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from dshim.harness.echo import EchoHarness
from dshim.model import MediaRef, Option, QuestionRequest, ReplyReference
from dshim.pipeline.interactions import parse_approval, parse_question
from dshim.pipeline.turn import STOPPED_MARK
from tests.harness_rig import open_harness_rig
from tests.helpers import msg

APPROVAL_OPTIONS = [
    Option(id="allow-once", label="Allow once", kind="allow_once"),
    Option(id="allow-always", label="Always allow", kind="allow_always"),
    Option(id="reject-once", label="Reject", kind="reject_once"),
    Option(id="reject-always", label="Never allow", kind="reject_always"),
]


# -- parsing: the current text only ----------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "option_id"),
    [
        ("2", "allow-always"),
        (" 3 ", "reject-once"),
        ("１", "allow-once"),  # full-width digit
        ("yes", "allow-once"),
        ("Y", "allow-once"),
        ("  Approve  ", "allow-once"),
        ("批准", "allow-once"),
        ("同意", "allow-once"),
        ("no", "reject-once"),
        ("N", "reject-once"),
        ("REJECT", "reject-once"),
        ("拒绝", "reject-once"),
        ("不同意", "reject-once"),
        ("always allow", "allow-always"),
        ("never ALLOW", "reject-always"),
    ],
)
def test_approval_answers(text: str, option_id: str) -> None:
    decision = parse_approval(APPROVAL_OPTIONS, text)
    assert decision is not None and decision.option_id == option_id


@pytest.mark.parametrize("text", ["", "5", "0", "yes please", "maybe", "ok", "y n", "> yes"])
def test_approval_non_answers(text: str) -> None:
    assert parse_approval(APPROVAL_OPTIONS, text) is None


def test_no_without_a_reject_option_is_a_cancel() -> None:
    decision = parse_approval([Option(id="go", label="Proceed", kind="allow_once")], "no")
    assert decision is not None and decision.option_id is None and decision.allow is False


def test_question_answer_parsing() -> None:
    q = QuestionRequest(
        question="?", options=[Option(id="r", label="Red"), Option(id="b", label="Blue")]
    )
    assert parse_question(q, "2") == parse_question(q, "blue")
    answer = parse_question(q, "2")
    assert answer is not None and answer.selected == ["b"] and answer.custom is None
    free = parse_question(q, "something else")
    assert free is not None and free.selected == [] and free.custom == "something else"
    strict = QuestionRequest(question="?", options=q.options, allow_free_text=False)
    assert parse_question(strict, "something else") is None
    multi = QuestionRequest(
        question="?",
        options=[Option(id="a", label="A"), Option(id="b", label="B"), Option(id="c", label="C")],
        multi_select=True,
        allow_free_text=False,
    )
    for text in ("1, 3", "1，3", "1 3", "a、C", "1,3,1"):
        got = parse_question(multi, text)
        assert got is not None and got.selected == ["a", "c"], text
    assert parse_question(multi, "1, x") is None


# -- approvals end to end -----------------------------------------------------------------------


async def test_approval_answered_by_number(autojump_clock: object, tmp_path: Path) -> None:
    with trio.fail_after(30):
        async with open_harness_rig(tmp_path, harness=EchoHarness()) as rig:
            await rig.rt.accept(msg("echo:approval"))
            await trio.sleep(1)
            shown = rig.texts[-1]
            assert "echo: run the scripted action" in shown
            assert "1. Allow once" in shown and "2. Allow always" in shown and "3. Reject" in shown
            await rig.rt.accept(msg("2"))
            await rig.rt.wait_idle()
    assert "✅ Approved: Allow always." in rig.texts
    assert rig.texts[-1] == "Approval decision: allow_always"
    assert len(rig.events.prompts) == 1  # "2" was an answer, not a prompt


@pytest.mark.parametrize(
    ("answer", "decision"),
    [
        ("批准", "allow_once"),
        ("  YES ", "allow_once"),
        ("不同意", "reject_once"),
        ("n", "reject_once"),
    ],
)
async def test_approval_answered_by_word(
    autojump_clock: object, tmp_path: Path, answer: str, decision: str
) -> None:
    with trio.fail_after(30):
        async with open_harness_rig(tmp_path, harness=EchoHarness()) as rig:
            await rig.rt.accept(msg("echo:approval"))
            await trio.sleep(1)
            await rig.rt.accept(msg(answer))
            await rig.rt.wait_idle()
    assert rig.texts[-1] == f"Approval decision: {decision}"
    assert len(rig.events.prompts) == 1


async def test_only_the_starter_answers_in_a_group(autojump_clock: object, tmp_path: Path) -> None:
    group = {"conversation_type": "group", "conversation_id": "-100", "addressed": True}
    with trio.fail_after(30):
        async with open_harness_rig(tmp_path, harness=EchoHarness()) as rig:
            await rig.rt.accept(msg("echo:approval", sender_id="1", sender_name="Ada", **group))  # type: ignore[arg-type]
            await trio.sleep(1)
            assert "Only Ada can answer" in rig.texts[-1]
            await rig.rt.accept(msg("yes", sender_id="2", sender_name="Bob", **group))  # type: ignore[arg-type]
            await rig.rt.accept(msg("what is going on?", sender_id="2", **group))  # type: ignore[arg-type]
            await trio.sleep(1)
            assert not [t for t in rig.texts if t.startswith("Approval decision")]
            assert "Only Ada, who started this request, can answer it." in rig.texts
            await rig.rt.accept(msg("3", sender_id="1", **group))  # type: ignore[arg-type]
            await rig.rt.wait_idle()
    decisions = [t for t in rig.texts if t.startswith("Approval decision")]
    assert decisions == ["Approval decision: reject_once"]
    # Bob's ordinary message was queued and answered after the turn, as a prompt of its own.
    assert rig.events.prompts[-1].endswith("what is going on?")
    assert rig.texts[-1].endswith("what is going on?")


@pytest.mark.parametrize("answer", ["yes", "1", "Allow once"])
async def test_a_reply_answers_with_its_own_text(
    autojump_clock: object, tmp_path: Path, answer: str
) -> None:
    with trio.fail_after(30):
        async with open_harness_rig(tmp_path, harness=EchoHarness()) as rig:
            await rig.rt.accept(msg("echo:approval"))
            await trio.sleep(1)
            # The natural gesture: reply to the bot's permission prompt with the answer.
            prompt = ReplyReference(
                message_id="out-1", content="The agent asks for permission", author_name="bot"
            )
            await rig.rt.accept(msg(answer, reply_to=prompt))
            await rig.rt.wait_idle()
    assert [t for t in rig.texts if t.startswith("Approval decision")] == [
        "Approval decision: allow_once"
    ]
    # The answer was consumed: it never reached the agent as a prompt of its own.
    assert len(rig.events.prompts) == 1


async def test_quoted_yes_is_not_an_answer(autojump_clock: object, tmp_path: Path) -> None:
    with trio.fail_after(30):
        async with open_harness_rig(tmp_path, harness=EchoHarness()) as rig:
            await rig.rt.accept(msg("echo:approval"))
            await trio.sleep(1)
            # The user quotes a message whose content is "yes" and asks something: only the
            # message's own text counts, and it is no answer (a reminder, nothing approved).
            await rig.rt.accept(
                msg(
                    "what about this?",
                    reply_to=ReplyReference(message_id="9", content="yes", author_name="Ada"),
                )
            )
            await trio.sleep(5)
            assert not [t for t in rig.texts if t.startswith("Approval decision")]
            assert [t for t in rig.texts if t.startswith("That is not an answer")]
            await rig.rt.accept(msg("no"))
            await rig.rt.wait_idle()
    assert [t for t in rig.texts if t.startswith("Approval decision")] == [
        "Approval decision: reject_once"
    ]
    assert len(rig.events.prompts) == 1


async def test_a_reply_answers_a_question(autojump_clock: object, tmp_path: Path) -> None:
    with trio.fail_after(30):
        async with open_harness_rig(tmp_path, harness=EchoHarness()) as rig:
            await rig.rt.accept(msg("echo:question"))
            await trio.sleep(1)
            question = ReplyReference(
                message_id="out-1", content="❓ Which one?", author_name="bot"
            )
            await rig.rt.accept(msg("2", reply_to=question))
            await rig.rt.wait_idle()
    assert any(t.startswith("Answer sent:") for t in rig.texts)
    assert len(rig.events.prompts) == 1


@pytest.mark.parametrize("answer", ["yes", "1", "approve"])
async def test_forwarded_yes_is_not_an_answer(
    autojump_clock: object, tmp_path: Path, answer: str
) -> None:
    with trio.fail_after(30):
        async with open_harness_rig(tmp_path, harness=EchoHarness()) as rig:
            await rig.rt.accept(msg("echo:approval"))
            await trio.sleep(1)
            # The starter forwards someone's "yes": forwarded content is never an answer
            # (and no reminder either: it is a new message, queued behind the turn).
            await rig.rt.accept(msg(answer, forwarded=True))
            await trio.sleep(5)
            assert not [t for t in rig.texts if t.startswith("Approval decision")]
            assert not [t for t in rig.texts if "not an answer" in t]
            await rig.rt.accept(msg("no"))
            await rig.rt.wait_idle()
    assert [t for t in rig.texts if t.startswith("Approval decision")] == [
        "Approval decision: reject_once"
    ]
    # The forwarded text still reached the agent afterwards, as the message's content.
    assert len(rig.events.prompts) == 2
    assert rig.events.prompts[1].endswith("\n\n" + answer)


async def test_forwarded_answer_to_a_question_is_not_an_answer(
    autojump_clock: object, tmp_path: Path
) -> None:
    with trio.fail_after(30):
        async with open_harness_rig(tmp_path, harness=EchoHarness()) as rig:
            await rig.rt.accept(msg("echo:question"))
            await trio.sleep(1)
            await rig.rt.accept(msg("2", forwarded=True))
            await trio.sleep(5)
            assert not [t for t in rig.texts if t.startswith("Answer:")]
            await rig.rt.accept(msg("red"))
            await rig.rt.wait_idle()
    assert [t for t in rig.texts if t.startswith("Answer:")] == ["Answer: Red"]


async def test_media_message_is_not_an_answer(autojump_clock: object, tmp_path: Path) -> None:
    async def png(limit: int) -> bytes:
        return b"\x89PNG\r\n\x1a\n" + b"0" * 10

    with trio.fail_after(30):
        async with open_harness_rig(tmp_path, harness=EchoHarness()) as rig:
            await rig.rt.accept(msg("echo:approval"))
            await trio.sleep(1)
            await rig.rt.accept(msg("1", images=[MediaRef(kind="image", name="a.png", fetch=png)]))
            await trio.sleep(5)
            assert not [t for t in rig.texts if t.startswith("Approval decision")]
            await rig.rt.accept(msg("1"))
            await rig.rt.wait_idle()
    assert "Approval decision: allow_once" in rig.texts
    assert len(rig.events.prompts) == 2


async def test_other_text_from_the_starter_gets_a_reminder(
    autojump_clock: object, tmp_path: Path
) -> None:
    with trio.fail_after(30):
        async with open_harness_rig(tmp_path, harness=EchoHarness()) as rig:
            await rig.rt.accept(msg("echo:approval"))
            await trio.sleep(1)
            await rig.rt.accept(msg("hmm, what does it do?"))
            await trio.sleep(1)
            assert rig.texts[-1].startswith("That is not an answer to the pending request.")
            await rig.rt.accept(msg("approve"))
            await rig.rt.wait_idle()
    assert rig.texts[-1] == "Approval decision: allow_once"
    assert len(rig.events.prompts) == 1


async def test_no_answer_in_time_rejects_and_tells_the_user(
    autojump_clock: object, tmp_path: Path
) -> None:
    with trio.fail_after(700):  # virtual time: the wait is instant
        async with open_harness_rig(tmp_path, harness=EchoHarness()) as rig:
            t0 = trio.current_time()
            await rig.rt.accept(msg("echo:approval"))
            await rig.rt.wait_idle()
            waited = trio.current_time() - t0
    assert 600 <= waited < 601  # the default: 10 minutes
    assert (
        "⌛ No answer within 10 minutes, so the request “echo: run the scripted action” was rejected."
        in rig.texts
    )
    assert rig.texts[-1] == "Approval decision: reject_once"


async def test_interaction_timeout_is_configurable(autojump_clock: object, tmp_path: Path) -> None:
    with trio.fail_after(100):
        async with open_harness_rig(
            tmp_path, harness=EchoHarness(), harness_cfg={"interaction_timeout_s": 30}
        ) as rig:
            t0 = trio.current_time()
            await rig.rt.accept(msg("echo:question"))
            await rig.rt.wait_idle()
            waited = trio.current_time() - t0
    assert 30 <= waited < 31
    assert "⌛ No answer within 30 seconds, so the question was cancelled." in rig.texts
    assert rig.texts[-1] == "Answer: (none, the question was cancelled)"


async def test_stop_rejects_the_pending_request(autojump_clock: object, tmp_path: Path) -> None:
    with trio.fail_after(30):
        async with open_harness_rig(tmp_path, harness=EchoHarness()) as rig:
            await rig.rt.accept(msg("echo:approval"))
            await trio.sleep(1)
            await rig.rt.accept(msg("/stop"))
            await rig.rt.wait_idle()
            assert not rig.rt.interactions.pending(("42", ""))
            # After /stop a "yes" is an ordinary message again.
            await rig.rt.accept(msg("yes"))
            await rig.rt.wait_idle()
    assert rig.texts[1].endswith(STOPPED_MARK)
    assert not [t for t in rig.texts if "Approved" in t or t.startswith("Approval decision")]
    assert rig.events.prompts[-1].endswith("yes")


# -- questions ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("answer", "reported"),
    [("2", "Answer: Blue"), ("red", "Answer: Red"), ("green, please", "Answer: “green, please”")],
)
async def test_question_answers(
    autojump_clock: object, tmp_path: Path, answer: str, reported: str
) -> None:
    with trio.fail_after(30):
        async with open_harness_rig(tmp_path, harness=EchoHarness()) as rig:
            await rig.rt.accept(msg("echo:question"))
            await trio.sleep(1)
            shown = rig.texts[-1]
            assert shown.startswith("❓ echo: which colour?")
            assert "1. Red" in shown and "2. Blue" in shown and "your own answer" in shown
            await rig.rt.accept(msg(answer))
            await rig.rt.wait_idle()
    assert rig.texts[-1] == reported
    assert len(rig.events.prompts) == 1


async def test_wait_settled_returns_while_a_request_waits_for_the_user(
    autojump_clock: object, tmp_path: Path
) -> None:
    with trio.fail_after(30):
        async with open_harness_rig(tmp_path, harness=EchoHarness()) as rig:
            t0 = trio.current_time()
            await rig.rt.accept(msg("echo:approval"))
            await rig.rt.wait_settled()  # the request is shown and waits: settled
            assert trio.current_time() - t0 < 1
            assert rig.rt.interactions.pending(("42", ""))
            assert rig.texts[-1].startswith("🔐")
            # A forward is never an answer: it is queued behind the waiting turn.
            await rig.rt.accept(msg("queued behind the request", forwarded=True))
            await rig.rt.wait_settled()  # it cannot run before the answer: still settled
            with trio.move_on_after(5) as scope:
                await rig.rt.wait_idle()  # wait_idle keeps its meaning: work is pending
            assert scope.cancelled_caught
            await rig.rt.accept(msg("1"))
            await rig.rt.wait_settled()  # the answer ran the turn and the queued one
            assert trio.current_time() - t0 < 10
    assert "Approval decision: allow_once" in rig.texts
    assert rig.texts[-1].endswith("queued behind the request")
