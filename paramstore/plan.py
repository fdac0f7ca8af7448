"""``ps.plan(fn, *args, **kwargs)``: will this step fit? Memory per device before allocating.

Contract (docs/api.md, "Memory plan"):

* ``fn`` is a ``ps.function`` (its Python function is planned) or a plain callable that reads
  and assigns variables; the arguments may be arrays or ``jax.ShapeDtypeStruct`` (with or
  without a sharding), the variables concrete or abstract (``ps.abstract()``). Nothing is
  allocated or run: the step is traced as ``ps.pure`` over the variables (shapes only),
  lowered and compiled with ``jax.jit`` for the variables' shardings and memory kinds, the
  assigned variables donated as ``ps.function`` donates them. Variables the trace creates are
  created abstract (inside ``ps.abstract()``).
* The variables are those of the default store and of every ``ps.Module`` reachable from the
  arguments and from ``fn``'s closure and the globals it names; a variable the step does not
  use is not counted (``jax.jit`` drops it).
* Each variable is classified: ``optimizer_state`` (variables of a ``ps.Optimizer`` or
  ``ps.LossScaleOptimizer``), ``parameters`` (the weights of ``ps.nn`` layers, trainable,
  frozen or quantized, and any other trainable variable), ``other_state`` (everything else:
  layer statistics created non-trainable, metrics, EMA shadows, RNG state).
* Exact arithmetic where it is arithmetic: a variable counts, on each device, the bytes of
  its shard there (``sharding.devices_indices_map``); a variable in host memory
  (``pinned_host``/``unpinned_host``) counts on ``plan.host``, every copy. Inputs: the
  non-variable arguments, by their sharding (as compiled). Outputs: the results and the new
  values of variables that are not written over their donated buffer. Temporaries: XLA's
  ``memory_analysis().temp_size_in_bytes`` of the compiled program. ``peak`` on a device is
  its variables + inputs + outputs + temporaries (XLA holds them all at the step's
  high-water mark: an upper bound that is tight for a training step).
* ``plan.fits(limit=None)``: every device's ``peak <= limit`` (default: the device's own
  ``bytes_limit`` from ``memory_stats()``; where the backend reports none, ``limit`` is
  required: ``ValueError``). ``str(plan)`` is a table (equal device rows merged).
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, fields
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from paramstore._core.store import default_store
from paramstore._variable import abstract as _abstract
from paramstore.averaging import ExponentialMovingAverage
from paramstore.functional import pure
from paramstore.module import Module
from paramstore.nn._base import Layer, is_statistic
from paramstore.nn.repeat import Repeat
from paramstore.optimizer import Optimizer
from paramstore.optimizer.loss_scale import LossScaleOptimizer
from paramstore.variable import Variable

__all__ = ["Plan", "PlanRow", "plan"]

HOST_KINDS = ("pinned_host", "unpinned_host")
KINDS = ("parameters", "optimizer_state", "other_state")


@dataclass
class PlanRow:
    """Bytes on one device (or in host memory): each attribute an int."""

    parameters: int = 0
    optimizer_state: int = 0
    other_state: int = 0
    inputs: int = 0
    outputs: int = 0
    temporaries: int = 0
    peak: int = 0

    def total(self) -> int:
        """The sum of every field but ``peak``."""
        return sum(getattr(self, f.name) for f in fields(self) if f.name != "peak")


def _human(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{n} B"


def _limit_of(device: Any) -> int | None:
    try:
        stats = device.memory_stats()
    except Exception:  # a backend without memory statistics
        return None
    limit = (stats or {}).get("bytes_limit")
    return int(limit) if limit else None


class Plan:
    """What ``ps.plan`` found: ``devices`` (``{device: PlanRow}``), ``host`` (a
    ``PlanRow``), ``peak`` (the largest device peak), ``fits(limit=None)`` and a table."""

    def __init__(self, devices: dict[Any, PlanRow], host: PlanRow, stats: object) -> None:
        self.devices = devices
        self.host = host
        self.memory_analysis = stats  #: XLA's ``CompiledMemoryStats`` of the program

    @property
    def peak(self) -> int:
        """The largest peak over the devices, in bytes."""
        return max((row.peak for row in self.devices.values()), default=0)

    def fits(self, limit: int | None = None) -> bool:
        """Whether every device's peak is at most ``limit`` bytes (default: each device's
        own memory limit; ``ValueError`` where the backend reports none)."""
        if limit is not None:
            if isinstance(limit, bool) or not isinstance(limit, (int, np.integer)) or limit < 0:
                raise ValueError(f"Plan.fits: limit must be a number of bytes >= 0, got {limit!r}.")
            return all(row.peak <= limit for row in self.devices.values())
        for device, row in self.devices.items():
            own = _limit_of(device)
            if own is None:
                raise ValueError(
                    f"Plan.fits: device {device} does not report a memory limit (the "
                    f"{device.platform} backend has no bytes_limit): pass limit= in bytes, "
                    "e.g. plan.fits(limit=16 * 2**30)."
                )
            if row.peak > own:
                return False
        return True

    def _groups(self) -> list[tuple[str, PlanRow, int | None]]:
        groups: dict[tuple[Any, ...], list[Any]] = {}
        for device, row in self.devices.items():
            key = (*(getattr(row, f.name) for f in fields(row)), _limit_of(device))
            groups.setdefault(key, []).append(device)
        out = []
        for key, devices in groups.items():
            ids = ",".join(str(d.id) for d in devices)
            label = f"{devices[0].platform}:{ids}" if len(devices) < 5 else (
                f"{devices[0].platform} x{len(devices)}"
            )  # fmt: skip
            out.append((label, self.devices[devices[0]], key[-1]))
        return out

    def __str__(self) -> str:
        names = [f.name for f in fields(PlanRow)]
        header = ["memory", *names, "limit"]
        rows = [
            [label, *(_human(getattr(row, n)) for n in names), _human(lim) if lim else "-"]
            for label, row, lim in self._groups()
        ]
        rows.append(["host", *(_human(getattr(self.host, n)) for n in names), "-"])
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in [header, *rows]]  # fmt: skip
        lines.insert(1, "-" * len(lines[0]))
        lines.append(f"peak per device: {_human(self.peak)}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<ps.Plan peak={_human(self.peak)} on {len(self.devices)} device(s)>"


# ------------------------------------------------------------------- finding the state


def _walk(x: Any, found: dict[int, Any], depth: int = 0) -> None:
    """Modules and Variables inside ``x`` (lists, tuples, dicts; bounded depth)."""
    if depth > 4 or id(x) in found:
        return
    if isinstance(x, (Module, Variable)):
        found[id(x)] = x
    elif isinstance(x, (list, tuple)):
        for item in x:
            _walk(item, found, depth + 1)
    elif isinstance(x, Mapping):
        for item in x.values():
            _walk(item, found, depth + 1)
    elif not isinstance(x, (type, types.ModuleType, types.FunctionType)) and hasattr(x, "__dict__"):
        found[id(x)] = None  # an object holding the step's state (a trainer): its attributes
        for item in vars(x).values():
            _walk(item, found, depth + 1)


def _roots(fn: Callable[..., Any], args: Any, kwargs: Any) -> list[Any]:
    found: dict[int, Any] = {}  # id -> Module or Variable (None: an object walked)
    _walk(list(args) + list(kwargs.values()), found)
    target = inspect.unwrap(fn)
    self_ = getattr(target, "__self__", None)
    if self_ is not None:
        _walk(self_, found)
        target = getattr(target, "__func__", target)
    try:
        closure = inspect.getclosurevars(target)
    except (TypeError, ValueError):
        closure = None
    if closure is not None:
        for value in (*closure.nonlocals.values(), *closure.globals.values()):
            _walk(value, found)
    return [x for x in found.values() if x is not None]


def _classify(roots: list[Any]) -> tuple[list[Variable], dict[int, str]]:
    """Every variable reachable from ``roots`` and the default store, and its kind."""
    kind: dict[int, str] = {}
    every: dict[int, Variable] = {}
    modules: dict[int, Module] = {}
    for r in roots:
        if isinstance(r, Module):
            for m in (r, *r.submodules):
                modules[id(m)] = m
        elif isinstance(r, Variable):
            every[id(r)] = r
    for m in modules.values():
        for v in m.variables:
            every[id(v)] = v
        if isinstance(m, (Optimizer, LossScaleOptimizer)):
            for v in m.variables:
                kind.setdefault(id(v), "optimizer_state")
    statistics: set[int] = set()
    for m in modules.values():
        if isinstance(m, Repeat) and m.built:
            for key, tvar in zip(m._order, m._template.tvars):
                if is_statistic(tvar) or tvar._is_key:
                    statistics.add(id(m.stacked[key]))
    for m in modules.values():
        if isinstance(m, ExponentialMovingAverage):
            for v in m.variables:
                kind.setdefault(id(v), "other_state")
    for m in modules.values():
        if isinstance(m, Layer):
            for v in m.variables:
                weight = not (is_statistic(v) or v._is_key or id(v) in statistics)
                kind.setdefault(id(v), "parameters" if weight else "other_state")
    for v in default_store().variables():
        every.setdefault(id(v), v)
    for v in every.values():
        kind.setdefault(id(v), "parameters" if v.trainable else "other_state")
    return [v for v in every.values() if not v._is_string], kind


# ------------------------------------------------------------------- bytes per device


def _sharding(x: Any) -> Any:
    s = getattr(x, "sharding", None)
    return s if s is not None else SingleDeviceSharding(jax.devices()[0])


def _per_device(shape: tuple[int, ...], dtype: Any, sharding: Any) -> Iterator[tuple[Any, int]]:
    """``(device, bytes of the shard there)`` for an array of ``shape`` and ``dtype``."""
    key = jnp.issubdtype(dtype, jax.dtypes.prng_key)
    itemsize = 8 if key else np.dtype(dtype).itemsize  # a key: two uint32 words
    for device, index in sharding.devices_indices_map(tuple(shape)).items():
        n = 1
        for dim, sl in zip(shape, index):
            start, stop, step = sl.indices(dim)
            n *= len(range(start, stop, step))
        yield device, n * itemsize


def _add(rows: dict[Any, PlanRow], host: PlanRow, field: str, x: Any, sharding: Any) -> None:
    in_host = getattr(sharding, "memory_kind", None) in HOST_KINDS
    for device, nbytes in _per_device(x.shape, x.dtype, sharding):
        row = host if in_host else rows.setdefault(device, PlanRow())
        setattr(row, field, getattr(row, field) + nbytes)


def _spec(x: Any) -> Any:
    if isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)):
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=getattr(x, "sharding", None))
    return x


def plan(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Plan:
    """Trace, lower and compile ``fn(*args, **kwargs)`` for the variables' shardings without
    allocating or running anything, and report the bytes it needs per device and in host
    memory (see the module docstring)."""
    if not callable(fn):
        raise TypeError(
            f"ps.plan: fn must be a ps.function or a callable, got {type(fn).__name__}."
        )
    bound = getattr(fn, "_bound", None)
    instance = bound() if callable(bound) else None
    inner = getattr(fn, "__wrapped__", fn)
    if instance is not None:  # a ps.function method: its instance is state, not an input
        args = (instance, *args)
    held = [a for a in (*args, *kwargs.values()) if isinstance(a, (Module, Variable))]
    target = _closing_over(inner, args, kwargs)  # Modules and Variables are read, not passed
    args = tuple(jax.tree_util.tree_map(_spec, a) for a in args if not _is_state(a))
    kwargs = {k: jax.tree_util.tree_map(_spec, v) for k, v in kwargs.items() if not _is_state(v)}
    with _abstract.abstract():  # a variable the trace creates is created abstract
        roots = _roots(inner, (*held, *args), kwargs)
        for attempt in range(3):  # again when the trace created variables (lazy builds)
            variables, kind = _classify(roots)
            known = {id(v) for v in variables}
            names = [v.name for v in variables]
            if len(set(names)) != len(names):  # two stores with one name: keep the first
                seen: set[str] = set()
                variables = [v for v in variables if not (v.name in seen or seen.add(v.name))]  # type: ignore[func-returns-value]
            by_name = {v.name: v for v in variables}
            step = pure(target, variables)
            specs = _specs(variables)
            try:
                closed, (_out_shape, new_shape) = jax.make_jaxpr(step, return_shape=True)(
                    specs, *args, **kwargs
                )
                break
            except Exception as e:
                created = [v for v in _classify(roots)[0] if id(v) not in known]
                if not created or attempt == 2:
                    if isinstance(e, (_abstract.AbstractUseError, _abstract.AbstractTraceError)):
                        e.add_note(
                            "ps.plan traces the step inside ps.abstract(), where a variable "
                            "made from another variable's value (an EMA shadow) cannot be "
                            "created: create it before planning (one ema.apply(...) call)."
                        )
                    raise
    used, written = _usage(closed, specs, args, kwargs, new_shape)
    donated = {k: specs[k] for k in written}
    readonly = {k: specs[k] for k in used if k not in written}
    rest = {k: specs[k] for k in specs if k not in donated and k not in readonly}

    def program(donated: Any, readonly: Any, rest: Any, *args: Any, **kwargs: Any) -> Any:
        out, new = step({**donated, **readonly, **rest}, *args, **kwargs)
        return out, {k: _place(new[k], by_name[k]) for k in donated}

    with _abstract.abstract():
        lowered = jax.jit(program, donate_argnums=0).lower(donated, readonly, rest, *args, **kwargs)
    compiled = lowered.compile()
    stats = compiled.memory_analysis()
    rows: dict[Any, PlanRow] = {}
    host = PlanRow()
    placed_vars = {**compiled.input_shardings[0][0], **compiled.input_shardings[0][1]}
    for name in (*donated, *readonly):  # as compiled: a variable with no sharding gets one
        v = by_name[name]
        _add(rows, host, kind[id(v)], v, placed_vars.get(name) or _sharding(v))
    given = jax.tree_util.tree_leaves((args, kwargs))
    placed = jax.tree_util.tree_leaves(
        (compiled.input_shardings[0][3:], compiled.input_shardings[1])
    )
    for spec, sharding in zip(given, placed):
        _add(rows, host, "inputs", spec, sharding)
    out_info = jax.tree_util.tree_leaves(lowered.out_info[0])
    out_shardings = jax.tree_util.tree_leaves(compiled.output_shardings[0])
    for info, sharding in zip(out_info, out_shardings):
        _add(rows, host, "outputs", info, sharding)
    undonated = _undonated(stats, donated, by_name)
    for name in undonated:  # a new value XLA could not write over its donated buffer
        _add(rows, host, "outputs", by_name[name], _sharding(by_name[name]))
    for row in rows.values():
        row.temporaries = int(stats.temp_size_in_bytes) if stats is not None else 0
        row.peak = row.total()
    host.temporaries = int(getattr(stats, "host_temp_size_in_bytes", 0) or 0)
    host.peak = host.total()
    for device in {d for s in specs.values() for d in _sharding(s).device_set}:
        rows.setdefault(device, PlanRow())
    return Plan(dict(sorted(rows.items(), key=lambda kv: kv[0].id)), host, stats)


def _is_state(x: Any) -> bool:
    return isinstance(x, (Module, Variable))


def _closing_over(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``fn`` taking only the array arguments: the Modules and Variables among ``args`` and
    ``kwargs`` put back in their places (as ``ps.function`` reads them, never passes them)."""
    if not any(_is_state(a) for a in (*args, *kwargs.values())):
        return fn
    slots = [a if _is_state(a) else None for a in args]
    fixed = {k: v for k, v in kwargs.items() if _is_state(v)}

    def call(*dyn: Any, **kw: Any) -> Any:
        it = iter(dyn)
        full = [s if s is not None else next(it) for s in slots]
        return fn(*full, *it, **kw, **fixed)

    return call


def _specs(variables: list[Variable]) -> dict[str, jax.ShapeDtypeStruct]:
    """Each variable's shape, dtype and sharding. Where others span a mesh, a variable on
    one device or on none yet (an abstract variable with no sharding, its host-memory slots)
    is replicated over that mesh, as a run commits such a value."""
    mesh = next(
        (s.mesh for v in variables if isinstance(s := v.sharding, NamedSharding)
         and s.mesh.size > 1), None,
    )  # fmt: skip

    def sharding(v: Variable) -> Any:
        s = v.sharding
        if mesh is not None and (s is None or isinstance(s, SingleDeviceSharding)):
            kind = getattr(s, "memory_kind", None)
            return NamedSharding(mesh, PartitionSpec(), memory_kind=kind)
        return s

    return {v.name: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding(v)) for v in variables}


def _place(value: Any, var: Variable) -> Any:
    """The new value on its variable's sharding (host memory included), as ps.function
    writes it back."""
    s = var.sharding
    if s is None or isinstance(s, SingleDeviceSharding):
        return value
    if getattr(s, "memory_kind", None) in HOST_KINDS:
        return jax.device_put(value, s)
    return jax.lax.with_sharding_constraint(value, s)  # type: ignore[no-untyped-call]


def _usage(closed: Any, specs: dict[str, Any], args: Any, kwargs: Any, new_shape: Any) -> tuple[list[str], list[str]]:  # fmt: skip
    """The variables the step reads, and those it assigns (their new value is not the
    value passed in)."""
    jaxpr = closed.jaxpr
    leaves = jax.tree_util.tree_flatten_with_path(specs)[0]
    keys = [path[0].key for path, _ in leaves]
    invars = jaxpr.invars[: len(keys)]
    seen: set[Any] = set()
    for eqn in jaxpr.eqns:
        seen.update(id(v) for v in eqn.invars)
    n_out = len(jax.tree_util.tree_leaves(new_shape))
    new_vars = jaxpr.outvars[len(jaxpr.outvars) - n_out :]
    new_keys = [path[0].key for path, _ in jax.tree_util.tree_flatten_with_path(new_shape)[0]]
    outs = {id(v) for v in jaxpr.outvars[: len(jaxpr.outvars) - n_out]}
    written = [k for k, o in zip(new_keys, new_vars) if o is not invars[keys.index(k)]]
    used = [k for k, v in zip(keys, invars) if id(v) in seen or id(v) in outs or k in written]
    return used, written


def _undonated(stats: Any, donated: dict[str, Any], by_name: dict[str, Variable]) -> list[str]:
    """Donated variables whose buffers XLA did not alias (nothing when it aliased all)."""
    if stats is None or not donated:
        return []
    device_bytes = sum(
        max(
            (b for _, b in _per_device(by_name[k].shape, by_name[k].dtype, _sharding(by_name[k]))),
            default=0,
        )  # fmt: skip
        for k in donated
        if getattr(by_name[k].sharding, "memory_kind", None) not in HOST_KINDS
    )
    return [] if stats.alias_size_in_bytes >= device_bytes else list(donated)
