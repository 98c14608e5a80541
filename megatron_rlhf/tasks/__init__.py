"""Synthetic tasks with a known true reward, for the tiny CPU pipeline and tests."""
