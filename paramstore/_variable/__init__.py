"""The parts of ``ps.Variable``: reads, writes, operators, slices, initial values, creation and abstract variables (the class itself is ``paramstore.variable``)."""
