"""The bottom layer: the thread-local context, the owner of variables' arrays, binding frames, stores, seeds, dtypes, placement and layouts, and every JAX internal paramstore uses."""
