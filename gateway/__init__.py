"""The OpenAI-compatible HTTP gateway (FastAPI). It never imports torch."""
