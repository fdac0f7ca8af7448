"""The sharded checkpoint format (Orbax's array layout, paramstore's integrity records)."""
