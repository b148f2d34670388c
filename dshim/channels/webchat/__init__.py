"""The web chat channel: dshim's own chat page, served by the local HTTP endpoint."""
