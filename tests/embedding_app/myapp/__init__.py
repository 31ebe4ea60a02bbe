"""A small application that embeds apsup (see tests/test_embedding_wheel.py)."""
