"""The compiled entry of one traced ``ps.function`` signature: the one owner of a compiled call.

An ``Entry`` holds everything about one signature: its trace's result (the variables it
moves, the outputs' tree), its program (``runner``, a ``jax.jit`` of the lifted jaxpr, and
its masked ``twins``), its staleness (``current``: the flags and placements the trace saw)
and its steady-path state (``last``: the inputs of its next call, when they are exactly its
last call's outputs). ``_core.ownership`` only gathers the variables' arrays, writes them
and records hand-outs; every decision is taken here.

First calls. A program's first call is compiled ahead, outside the lock, then checked
before its results are swapped in: it is waited for, and an error raised while it runs
(out of memory, a failed host callback) leaves every variable as it was. On the CPU backend XLA allocates a program's temporaries
while it runs, after its donated inputs are consumed, so that first call donates private
copies. On GPU/TPU XLA allocates a program's buffers when it launches it, and an
allocation failure is raised by the call before any donation is committed. Later calls
are not waited for (that would serialise host and device: 2x per step on the
dispatch-bound benchmark); a program that ran once needs the same memory again.

``Entry.__call__`` is what every ``ps.function`` call runs once its signature is known. It
is performance-critical (~5 us per call in all): no call layers are added to its steady
path.

The steady path, per program. Every write outside compiled calls empties every cache
(``ownership.release_cached``); a compiled call empties the cache of each other entry whose
inputs it assigns (``dirties``, worked out once when an entry is made). So an entry whose
``last`` is set knows that its inputs are its last outputs (or the arrays it last read): it
skips the gather. A training step alternating with an evaluation step keeps the training
step on it (the evaluation reads the parameters again, a list of arrays, and donates
nothing).

A read between steps. ``v.value()`` hands out the buffer, which must then never be donated.
The hand-out tells each entry that donates ``v`` (``ownership.watch``), which marks that
input (``mask``) and keeps its cache: the next call needs no gather. Rather than copying
the buffer, that call runs a masked twin of the program that donates every input but the
handed-out ones (passed as they are; XLA writes their new values to fresh buffers): no copy
and no memory beyond the handed-out arrays, the others still updated in place. A twin is
compiled in a background thread (never under the lock, no call waits for it) from the
second call that meets the same pattern of hand-outs (a read that recurs, such as a logged
weight); until it is ready, and past ``MAX_TWINS`` patterns, the handed-out arrays are
copied (``private_copy``) as before. ``v.numpy()`` and ``float(v)`` hand nothing out at all
(``ownership.host``). (Train then ``w.value()`` of the dispatch-bound MLP of
``benchmarks/alternating.py``: 1.32x of hand-written ``jax.jit`` with a gather after each
read, see ``benchmarks/README.md`` for the figure with the mask.)
"""

from __future__ import annotations

import itertools
import operator
import threading
import weakref
from collections.abc import Callable
from typing import Any

import jax

from paramstore._core.context import TRACE_EPOCH
from paramstore._core.interrupts import deferred
from paramstore._core.jax_api import EVAL, current_trace, staging
from paramstore._core.ownership import Owned, ownership
from paramstore._core.placement import on_cpu, private_copy
from paramstore.variable import Variable

__all__ = ["Entry", "StaleProgram", "Twin", "MAX_TWINS"]

_CLOCK = itertools.count()  # ticks for least-recently-used eviction of traces
_LIVE: weakref.WeakSet[Entry] = weakref.WeakSet()  # every entry, for ``dirties``
MAX_TWINS = 4  # masked twins per entry (patterns of handed-out inputs); beyond: copies


def _picker(idx: list[int]) -> Callable[[Any], list[Any]]:
    """A function that takes the items at ``idx`` of a sequence, as a list (in C where it
    can: ``operator.itemgetter``)."""
    if not idx:
        return lambda seq: []
    if len(idx) == 1:
        (i,) = idx
        return lambda seq: [seq[i]]
    get = operator.itemgetter(*idx)
    return lambda seq: list(get(seq))


class Twin:
    """A masked twin of an entry's program (see the module docstring) and how to call it:
    which inputs it donates (``kept``) and passes (``held``), the assigned variables in the
    order of its new values, and where each donated variable's new value is among them."""

    __slots__ = ("runner", "assigned", "split", "donated_new")

    def __init__(
        self,
        runner: Callable[..., Any],
        perm: list[int],
        given: tuple[bool, ...],
        assigned: list[Variable],
    ) -> None:
        self.runner = runner
        self.assigned = [assigned[i] for i in perm]
        kept = _picker([i for i, g in enumerate(given) if not g])
        held = _picker([i for i, g in enumerate(given) if g])
        self.split: Callable[[list[Any]], tuple[list[Any], list[Any]]]
        self.split = lambda don: (kept(don), held(don))  # (donated, passed)
        self.donated_new = _picker([perm.index(i) for i in range(len(given))])


class StaleProgram(Exception):
    """Raised by a call (nothing run, nothing written) of an entry that is no longer
    current (a flag or placement its trace saw has changed): the function traces anew."""


class Entry:
    """One traced signature: its program, its variables, staleness and steady path."""

    def __init__(
        self,
        owner: str,
        runner: Callable[..., Any],
        donated: list[Variable],
        readonly: list[Variable],
        assigned: list[Variable],
        out_tree: Any,
        ref_pos: list[int],
        refs: list[Any],
        n_leaves: int,
        donate: bool,
        wait: bool,
        shared: list[Variable],
        layout: tuple[Any, ...],
        masked: Callable[[tuple[bool, ...]], tuple[Callable[..., Any], list[int]]] | None = None,
    ) -> None:
        self.owner = owner
        self.runner = runner
        self.donated = donated  # read and assigned, their old buffers donated
        self.readonly = readonly  # read only
        self.assigned = assigned  # in the order of the runner's new values
        self.shared = shared  # whose array an output may be after each call: handed out
        self.donate = donate and not wait
        self.wait = wait  # host callbacks: no donation, waited for under the lock
        self.steady = not shared  # no output shares a variable's buffer: steady path
        self.n_donated = len(donated)
        self.copy_first = self.donate and any(  # see the module docstring, "First calls"
            on_cpu(getattr(ownership.peek(v), "sharding", None)) for v in donated
        )
        self._masked = masked
        # compiled twins that donate all but the handed-out inputs, by which were handed out
        # (None: none is made for that pattern, more than MAX_TWINS: those arrays are copied)
        self.twins: dict[tuple[bool, ...], Twin | None] = {}
        self.seen: dict[tuple[bool, ...], int] = {}  # calls with each pattern, before a twin
        self.warm = False  # the first call succeeded: jit's C++ dispatch has it
        self.fast = False  # warm and steady: the steady path
        self.last: Any = None  # (donated, read-only) inputs of the next call, or None
        # which of `last`'s donated inputs were handed out since (None: none was)
        self.mask: tuple[bool, ...] | None = None
        self.index = {id(v): i for i, v in enumerate(donated)} if self.donate else {}
        self.singles: dict[int, tuple[bool, ...]] = {}  # the mask of each input alone
        self.touches = bool(donated or readonly or assigned)
        self.out_tree = out_tree
        self.one_out = out_tree is not None and out_tree.num_nodes == out_tree.num_leaves == 1
        self.ref_pos = ref_pos
        self.refs = [weakref.ref(r) for r in refs]
        self.array_pos = [i for i in range(n_leaves) if i not in set(ref_pos)]
        self.tick = next(_CLOCK)  # when last called, for least-recently-used eviction
        # The trainable flags the trace saw (freezing between calls must take effect) and
        # the shardings its program writes back on: checked again only when some flag or
        # placement somewhere has changed since (TRACE_EPOCH).
        self.moved = list({id(v): v for v in (*donated, *readonly, *assigned)}.values())
        self.flags: list[bool] | None = [v.trainable for v in self.moved]
        self.structure = TRACE_EPOCH.structure  # a layer restructured since: trace anew
        self.layout = layout
        # ``epoch``: what ``Function``'s fast path checks, without the lock; ``checked``:
        # what ``current`` checks under it (the epoch it last found everything current at)
        self.epoch = self.checked = TRACE_EPOCH.epoch
        self.dirties: list[weakref.ref[Entry]] = []
        self._link()

    def _link(self) -> None:
        """Which entries' cached inputs a call of this one changes, and the reverse."""
        mine = {id(v) for v in self.moved}
        writes = {id(v) for v in self.assigned}
        with ownership.lock:  # no call walks a `dirties` list meanwhile; one link at a time
            for other in list(_LIVE):
                if writes & {id(v) for v in other.moved}:
                    self.dirties.append(weakref.ref(other))
                if mine & {id(v) for v in other.assigned}:
                    other.dirties.append(weakref.ref(self))
            _LIVE.add(self)
        if self.index:
            ownership.watch(self, self.donated)

    def handed(self, var: Owned) -> None:
        """``var`` (one of the donated inputs) was handed out: the next call passes its
        array undonated (``ownership`` calls this under the lock)."""
        i = self.index.get(id(var))
        if i is None or self.last is None:
            return  # no cache: the next call gathers, and sees the hand-out itself
        mask = self.mask
        if mask is None:  # the usual case, one read between two calls: a cached mask
            # (0.02 us against 0.29 us to build the 26-input tuple of alternating.py's step)
            single = self.singles.get(i)
            if single is None:
                single = self.singles[i] = (
                    *([False] * i),
                    True,
                    *[False] * (self.n_donated - i - 1),
                )
            self.mask = single
        elif not mask[i]:
            self.mask = (*mask[:i], True, *mask[i + 1 :])

    def current(self) -> bool:
        """Whether the trainable flags and the assigned variables' shardings are those
        the trace saw (hold the lock for an answer that stays true until the call)."""
        epoch = TRACE_EPOCH.epoch
        if self.checked == epoch:
            return True
        if self.flags is None or [v.trainable for v in self.moved] != self.flags:
            return False
        if self.structure != TRACE_EPOCH.structure:
            return False
        if any(TRACE_EPOCH.is_retired(v) for v in self.moved):
            return False  # a layer replaced it (ps.nn.quantize / dequantize)
        if tuple(getattr(ownership.peek(v), "sharding", None) for v in self.assigned) != (
            self.layout
        ):
            return False
        self.epoch = self.checked = epoch
        return True

    still_holds = current

    def retire(self) -> None:
        """Forget the cached inputs (its function dropped this entry)."""
        with ownership.lock:
            self.last = None
        _LIVE.discard(self)
        if self.index:
            ownership.unwatch(self, self.donated)

    def __call__(self, leaves: list[Any]) -> Any:
        self.tick = next(_CLOCK)  # ~40 ns
        trace = current_trace()
        if trace is not EVAL and self.touches and (self.assigned or staging(trace)):
            self._transformed()
        if self.ref_pos:  # Variables/Modules passed as arguments are read, not passed
            leaves = [leaves[i] for i in self.array_pos]
        if not self.fast:
            out = self._cold(leaves)
        else:
            out = self._steady(leaves)
        return out[0] if self.one_out else jax.tree_util.tree_unflatten(self.out_tree, out)

    def _steady(self, leaves: list[Any]) -> Any:
        """A warm call: gather (or the cached inputs), dispatch, write, under the lock."""
        own = ownership
        if own.open:  # a call with host callbacks runs: refused in one of its callbacks
            own.refuse_callback()
        masked: tuple[bool, ...] | None = None
        with own.lock:
            runner = self.runner
            last = self.last
            if last is not None:
                don, ro = last  # the steady path: ~0.1 us a call
                masked = self.mask  # (what was handed out since)
            else:
                if self.checked != TRACE_EPOCH.epoch and not self.current():
                    raise StaleProgram
                don, ro, given = own.gather(self.donated, self.readonly)
                self.mask = None  # (what a hand-out marked on a cache since emptied)
                if given is not None and self.donate:
                    masked = tuple(given)
            if masked:
                out = self._masked_call(don, ro, masked, leaves)
            else:
                # before the donation: no cache outlives the inputs it holds
                self.last = None
                for ref in self.dirties:
                    other = ref()
                    if other is not None:
                        other.last = None
                new, out = own.dispatch(runner, don, ro, leaves, self.assigned)
                own.keep(self, (new[: self.n_donated], ro))
        return out  # after the block (a `return f()` inside it is not interrupt-safe)

    def _masked_call(
        self, don: list[Any], ro: list[Any], given: tuple[bool, ...], leaves: list[Any]
    ) -> Any:
        """A call (under the lock) whose donated inputs include handed-out arrays: the twin
        for exactly those donates the others and passes these (no copy). Until that twin
        is compiled (in the background, from the second call with the same hand-outs:
        ``_compile_twin``) and past ``MAX_TWINS`` patterns, the handed-out arrays are
        copied and the call runs the program itself."""
        twin = self.twins.get(given)
        self.last = self.mask = None
        for ref in self.dirties:
            other = ref()
            if other is not None:
                other.last = None
        if twin is None:
            if given not in self.twins and self._masked is not None:
                seen = self.seen.get(given, 0) + 1
                self.seen[given] = seen
                if seen >= 2:  # a read that recurs (a logged weight): worth a twin
                    self.twins[given] = None  # pending
                    if len(self.twins) <= MAX_TWINS:
                        threading.Thread(
                            target=self._compile_twin, args=(given, leaves)
                        ).start()  # not a daemon: the interpreter's exit waits for it
            don = [private_copy(x) if g else x for x, g in zip(don, given)]
            new, out = ownership.dispatch(self.runner, don, ro, leaves, self.assigned)
            ownership.fresh([v for v, g in zip(self.donated, given) if g])
            ownership.keep(self, (new[: self.n_donated], ro))
        else:
            kept, held = twin.split(don)
            new, out = ownership.dispatch(twin.runner, kept, (held, ro), leaves, twin.assigned)
            # (no ``fresh``: the hand-out record of each held variable names its held
            # array, alive while read; a cache never consults it, and a gather that
            # meets a reused id passes that input undonated: the safe direction)
            ownership.keep(self, (twin.donated_new(new), ro))
        return out  # its new values are all owned: the next call donates them all

    def _compile(self, runner: Any, leaves: list[Any], given: tuple[bool, ...] = ()) -> None:
        """Compile ``runner`` for these inputs outside the lock (see ``ownership.specs``);
        an error here is left to the call to raise. ``given``: a masked twin's pattern."""
        don = ownership.specs(self.donated)
        ro = ownership.specs(self.readonly)
        rest: Any = ro
        if given:
            rest = ([x for x, g in zip(don, given) if g], ro)
            don = [x for x, g in zip(don, given) if not g]
        try:
            runner.lower(don, rest, leaves).compile()
        except Exception:  # noqa: BLE001
            pass

    def _compile_twin(self, given: tuple[bool, ...], leaves: list[Any]) -> None:
        """Make and compile the twin for ``given`` (in a background thread: no call waits
        for it, none holds the lock meanwhile); calls use it once it is ready."""
        if self._masked is None:
            return
        runner, perm = self._masked(given)
        self._compile(runner, leaves, given)
        self.twins[given] = Twin(runner, perm, given, self.assigned)

    def _cold(self, leaves: list[Any]) -> Any:
        """A first call (compiled first, outside the lock), a call of a program whose
        outputs may share a variable's buffer, or of one with host callbacks: interrupts
        deferred; a first call (and every call with host callbacks) waited for before
        anything is written, so an error while it runs changes nothing."""
        if not self.warm:
            self._compile(self.runner, leaves)
        own = ownership
        with deferred():
            try:
                own.acquire()
                if not self.current():
                    raise StaleProgram
                self.last = None
                own.release_cached()
                if self.wait:  # no donation, the lock held until it is written
                    don, ro = own.values(self.donated), own.values(self.readonly)
                    new, out = own.run_open(self.runner, don, ro, leaves)
                    own.store(self.assigned, new, self.shared)
                    self.warm = True
                    return out
                first = not self.warm
                don, ro, given = own.gather(self.donated, self.readonly)
                if self.donate and first and self.copy_first:
                    # the first call on CPU donates private copies (ownership's docstring)
                    don = [private_copy(x) for x in don]
                elif self.donate and given is not None:
                    don = [private_copy(x) if g else x for x, g in zip(don, given)]
                new, out = self.runner(don, ro, leaves)
                if first:  # an error while it runs: raised here, nothing written
                    jax.block_until_ready((new, out))  # type: ignore[no-untyped-call]
                own.store(self.assigned, new, self.shared)
                if self.steady:
                    self.mask = None
                    own.keep(self, (new[: self.n_donated], ro))
                self.warm = True
                self.fast = self.steady
            finally:
                try:
                    own.lock.release()
                except RuntimeError:
                    pass
        return out

    def _transformed(self) -> None:
        names = ", ".join(v.name for v in (self.assigned or [*self.donated, *self.readonly]))
        what = "assigns" if self.assigned else "reads"
        raise TypeError(
            f"{self.owner}, which {what} variables ({names:.200}), was called inside a plain "
            "JAX transformation (jax.jit, jax.vmap, jax.grad, lax control flow ...), where "
            "new values would be leaked tracers and read values would be baked in. Call it "
            "outside, make the outer function a ps.function too, or use ps.pure."
        )

    def alive(self, leaves: list[Any]) -> bool:
        """Whether the Variables/Modules this entry was traced with are still these."""
        return all(r() is leaves[i] for r, i in zip(self.refs, self.ref_pos))
