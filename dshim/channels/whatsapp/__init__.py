"""WhatsApp Cloud API channel."""
