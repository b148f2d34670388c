"""Slack: Socket Mode in, Web API out (native streaming, Block Kit buttons)."""
