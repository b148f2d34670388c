"""The QQ official bot channel (C2C, groups and guilds over the v2 gateway)."""
