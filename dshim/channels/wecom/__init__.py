"""WeCom (企业微信) AI bot: the long-connection channel (see channel.py)."""
