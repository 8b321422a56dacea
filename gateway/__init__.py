"""An OpenAI-compatible HTTP gateway in front of a draft service (`specwire gateway`)."""
