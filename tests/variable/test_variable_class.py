"""``ps.Variable`` is one class in one place (issue 23): everything it has is defined in
``paramstore/variable.py`` itself, except what its two bases give (``ArrayOps``: the operators
shared with ``VariableSlice``; ``Owned``: the fields only ``_core.ownership`` touches)."""

from __future__ import annotations

import inspect
import typing

import jax
import jax.numpy as jnp

import paramstore as ps
from paramstore import variable as variable_module
from paramstore._core import ownership as ownership_module
from paramstore._core.ownership import Owned
from paramstore._variable import abstract as abstract_module
from paramstore._variable.ops import ArrayOps

BASES = (ArrayOps, Owned)


def _defined_by(name: str) -> type:
    """The class in ``ps.Variable``'s MRO whose ``__dict__`` defines ``name``."""
    return next(cls for cls in ps.Variable.__mro__ if name in vars(cls))


def _public_attributes() -> list[str]:
    return [name for name in dir(ps.Variable) if not name.startswith("_")]


def test_the_class_has_exactly_two_bases_and_no_mixin_of_its_own():
    assert ps.Variable.__mro__ == (ps.Variable, ArrayOps, Owned, object)
    assert ps.Variable.__module__ == "paramstore.variable"
    assert inspect.getsourcefile(ps.Variable) == inspect.getsourcefile(variable_module)


def test_every_public_attribute_is_defined_in_the_class_itself():
    public = _public_attributes()
    assert {"assign", "assign_add", "assign_sub", "value", "numpy", "name", "shape"} <= set(public)
    elsewhere = {
        name: _defined_by(name).__qualname__
        for name in public
        if _defined_by(name) is not ps.Variable and _defined_by(name) not in BASES
    }
    assert elsewhere == {}
    # and the functions behind them are written in paramstore/variable.py
    for name in public:
        member = vars(_defined_by(name))[name]
        fn = member.fget if isinstance(member, property) else member
        if _defined_by(name) is ps.Variable and inspect.isfunction(fn):
            assert fn.__module__ == "paramstore.variable", name
            assert fn.__qualname__ == f"Variable.{fn.__name__}", name


def test_the_bases_hold_no_public_api_of_a_variable():
    """``ArrayOps`` adds operators and conversions (dunders) only, computed on ``value()``,
    which it declares and the class defines; ``Owned`` only its slots."""
    assert [n for n in vars(ArrayOps) if not n.startswith("_")] == ["value"]
    assert _defined_by("value") is ps.Variable
    assert [n for n in vars(Owned) if not n.startswith("_")] == []
    assert set(Owned.__slots__) == {"_value", "_given", "_override", "_donors"}


def test_every_slot_is_declared_once_with_its_annotation():
    slots = [s for s in ps.Variable.__slots__ if s != "__weakref__"]
    assert len(slots) == len(set(slots))
    # (each class's annotations in its own module's names: Owned's are ownership's)
    hints = typing.get_type_hints(ps.Variable, {**vars(ownership_module), **vars(variable_module)})
    own = ps.Variable.__annotations__
    assert list(own) == slots  # one annotation per slot, in the slots' order
    assert set(slots) <= set(hints)
    # no other class of the MRO declares a field of the variable (Owned: ownership's four)
    declared = [n for cls in ps.Variable.__mro__[1:] for n in getattr(cls, "__slots__", ())]
    assert sorted(declared) == ["_donors", "_given", "_override", "_value"]


def test_the_other_kinds_live_next_to_the_class_and_add_no_field():
    with ps.VariableStore(), ps.abstract():
        abstract = ps.Variable(lambda: jnp.zeros(2), name="a")
    kinds = {type(abstract)}
    leaf = ps.Variable(1.0, name="leaf")
    kinds.add(type(jax.tree_util.tree_map(lambda x: x, leaf)))
    for kind in kinds:
        assert kind.__mro__[1] is ps.Variable
        assert kind.__module__ == "paramstore.variable"
        assert kind.__slots__ == ()
    assert abstract.is_abstract
    abstract_module.set_initial_value(abstract, [1.0, 2.0])
    assert type(abstract) is ps.Variable  # concrete: a plain Variable again
    assert variable_module.set_initial_value is abstract_module.set_initial_value
