"""Showing modules and variables: ``ps.summary`` and ``ps.display``."""
