"""The ordered inbound pipeline (DESIGN.md §3): gates, commands, lanes, turns."""

from dshim.pipeline.runtime import BotRuntime, Observer, Verdict, open_bot_runtime

__all__ = ["BotRuntime", "Observer", "Verdict", "open_bot_runtime"]
