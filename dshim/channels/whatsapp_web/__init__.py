"""WhatsApp personal accounts over WhatsApp Web (multi-device), on neonize/whatsmeow."""
