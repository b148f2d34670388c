"""Markdown as WhatsApp's own formatting, for both WhatsApp channels (the Cloud API and
WhatsApp Web): ``*bold*``, ``_italic_``, ``~strike~``, code as it is.

Agents write Markdown; WhatsApp shows ``**b**`` literally.  The mapping is the same
whichever way the text reaches WhatsApp, so it is written once here.
"""

from __future__ import annotations

import re

__all__ = ["to_whatsapp"]

_FENCE = re.compile(r"(```.*?```)", re.DOTALL)
_INLINE_CODE = re.compile(r"(`[^`\n]+`)")
_ITALIC_STAR = re.compile(r"(?<![*\w])\*(?![\s*])([^*\n]+?)(?<!\s)\*(?![*\w])")
_BOLD = re.compile(r"\*\*(?!\s)(.+?)(?<!\s)\*\*|__(?!\s)(.+?)(?<!\s)__")
_STRIKE = re.compile(r"~~(?!\s)(.+?)(?<!\s)~~")
_HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.MULTILINE)
_LINK = re.compile(r"\[([^\]\n]+)\]\((https?://[^)\s]+)\)")
_BULLET = re.compile(r"^([ \t]*)[*+][ \t]+", re.MULTILINE)


def _inline(text: str) -> str:
    text = _HEADING.sub(lambda mt: f"**{mt.group(1)}**", text)
    text = _BULLET.sub(lambda mt: f"{mt.group(1)}- ", text)
    text = _ITALIC_STAR.sub(lambda mt: f"_{mt.group(1)}_", text)
    text = _BOLD.sub(lambda mt: f"*{mt.group(1) or mt.group(2)}*", text)
    text = _STRIKE.sub(lambda mt: f"~{mt.group(1)}~", text)
    return _LINK.sub(lambda mt: f"{mt.group(1)} ({mt.group(2)})", text)


def to_whatsapp(markdown: str) -> str:
    """The agent's Markdown as WhatsApp formatting: ``**b**``/``__b__``/headings ->
    ``*b*``, ``*i*`` -> ``_i_``, ``~~s~~`` -> ``~s~``, ``[t](url)`` -> ``t (url)``,
    ``* item`` -> ``- item``; code blocks and inline code are kept as they are."""
    out: list[str] = []
    for i, block in enumerate(_FENCE.split(markdown)):
        if i % 2 == 1:
            out.append(block)
            continue
        pieces = _INLINE_CODE.split(block)
        out.append("".join(p if j % 2 else _inline(p) for j, p in enumerate(pieces)))
    return "".join(out)
