"""dshim: one trio program connecting IM bots on nine platforms to an AI agent harness."""

__version__ = "0.1.0"
