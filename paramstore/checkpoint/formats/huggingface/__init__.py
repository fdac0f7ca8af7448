"""Hugging Face safetensors checkpoints: plain and sharded files read, and written by ``export_safetensors``."""
