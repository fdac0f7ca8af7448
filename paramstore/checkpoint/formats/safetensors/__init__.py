"""The single-file checkpoint format (safetensors with paramstore's checksums) and its file I/O."""
