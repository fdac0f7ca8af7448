"""The machinery of ``ps.function``: static arguments, tracing a signature, the compiled entry and its steady path."""
