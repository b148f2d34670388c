"""The ordered inbound pipeline (see :mod:`dshim.pipeline.runtime`)."""

from dshim.model import Verdict
from dshim.pipeline.runtime import BotRuntime, Observer, open_bot_runtime

__all__ = ["BotRuntime", "Observer", "Verdict", "open_bot_runtime"]
