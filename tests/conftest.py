"""Hypothesis runs derandomized: the same examples on every machine, so a CI failure reproduces."""

from hypothesis import settings

settings.register_profile("repo", derandomize=True, deadline=None)
settings.load_profile("repo")
