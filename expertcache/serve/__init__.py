"""The OpenAI-compatible server: one engine and one expert cache shared by every request."""
