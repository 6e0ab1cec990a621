"""splitspec: speculative decoding with drafters as separate services."""

__version__ = "0.1.0"
