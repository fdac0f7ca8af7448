"""The file formats paramstore reads and writes."""
