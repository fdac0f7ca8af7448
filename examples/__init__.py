"""paramstore's examples, importable as a package from a checkout of the repository
(``from examples import lora_recipe``, ``python -m examples.llama``); each is also a script
(``python examples/llama.py``)."""
