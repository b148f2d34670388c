"""The DingTalk channel (Stream mode robot, AI-card answers)."""
