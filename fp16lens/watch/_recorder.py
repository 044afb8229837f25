"""The recorder: module hooks name the running module, a TorchDispatchMode sees every
aten op. Each float op output becomes an *event* (site, producer events, max |v|, a
sampled stats vector); events are reduced once per forward call, never holding on
to activations (producers are tracked through weak references to the tensors).
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fp16lens._core import WatchError, threads
from fp16lens._core.compat import autocast_dtype, dispatch_mode_paused
from fp16lens._core.model_dtype import model_float_dtype
from fp16lens._trace import FirstCall, Frame, ModuleTracker, pause_at_boundary
from fp16lens.report import SATURATED
from fp16lens.watch import _fused_kernels, _internal
from fp16lens.watch._halfdtypes import HalfTrace
from fp16lens.watch._inputs import describe_inputs
from fp16lens.watch._opinfo import OpInfo
from fp16lens.watch._options import WatchOptions
from fp16lens.watch._sitetable import SiteInfo, SiteTable
from fp16lens.watch._tensorstats import extremes, flat_view, take_sample
from fp16lens.watch._underflow import RELEVANT as _FLUSH_OPS
from fp16lens.watch._underflow import ZeroShadow

INPUT_SITE = -1
_DERIVE_MIN = 1 << 19  # below this many elements a pass costs less than deriving


@dataclass
class Forward:
    """Events of one forward call, reduced by the accumulator when the call ends."""

    index: int
    sites: list[int] = field(default_factory=list)  # site id per event (INPUT_SITE for inputs)
    inputs: list[tuple[int, ...]] = field(default_factory=list)  # producer events per event
    extremes: list = field(default_factory=list)  # (min, max) per event: a tensor, or floats on CPU
    samples: list[torch.Tensor] = field(default_factory=list)
    numels: list[int] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)
    exact_over: dict[int, int] = field(default_factory=dict)  # event -> exact overflow count
    fp32: set[int] = field(default_factory=set)  # events inside FP32 islands, or that a
    # .half() model computes in FP32 (half_fp32: those of the second kind)
    half_fp32: set[int] = field(default_factory=set)
    fp16: set[int] = field(default_factory=set)  # events an FP32 model computes in float16
    # (torch.autocast inside its forward, a .half() there): FP16's own values
    handoff: set[int] = field(default_factory=set)  # events an FP32 island hands back to FP16:
    # stored in FP16 by a .half() model, so judged as FP16 values (never in fp32)
    saturated: dict[int, tuple[float, int]] = field(default_factory=dict)  # event -> (max |v| below
    # SATURATED, count of saturated values): masking constants do not count as overflow
    finite_max: dict[int, float] = field(default_factory=dict)  # event holding NaN -> max |v|
    # of its finite values: used when the inputs carry NaN/inf (the data's problem)
    internal: list[tuple[int, str, torch.Tensor, dict]] = field(default_factory=list)
    internal_of: list[int] = field(default_factory=list)  # the event of each internal entry
    # (-1: none that can be FP32), to drop those of FP32 events found after the call
    outputs: tuple[int, ...] = ()
    input_shapes: list[list[int]] = field(default_factory=list)
    input_specs: list[dict] = field(default_factory=list)  # watch/_inputs.describe_inputs
    input_names: list[str] = field(default_factory=list)  # per float input: its argument
    # underflow (watch/_underflow.py): the singular ops run, and event -> vanished constant
    flush: list = field(default_factory=list)
    consts: dict[int, str] = field(default_factory=dict)


def _float_tensors(obj, out: list) -> list:
    """Float tensors in nested args (lists/tuples, dicts, dataclass fields)."""
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point():
            out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            _float_tensors(o, out)
    elif isinstance(obj, dict):
        for o in obj.values():
            _float_tensors(o, out)
    elif hasattr(obj, "__dataclass_fields__"):
        for name in obj.__dataclass_fields__:
            _float_tensors(getattr(obj, name, None), out)
    return out


def _scalar_args(args, kwargs) -> bool:
    """Every argument after the first is a number (or None): the op is then an
    elementwise function of its first argument alone."""
    for a in args[1:]:
        if not (
            a is None
            or isinstance(a, (int, float))
            or (isinstance(a, torch.Tensor) and a.dim() == 0 and a.device.type == "cpu")
        ):
            return False
    return all(v is None or isinstance(v, (int, float)) for v in kwargs.values())


class Recorder(TorchDispatchMode):
    """Records every op run inside the watched model's forward, attributed to the running
    module by a ModuleTracker. Enter it as a dispatch mode while its tracker is attached."""

    def __init__(self, model: torch.nn.Module, options: WatchOptions, on_forward_end):
        super().__init__()
        self.options = options
        self.fp32_model = model_float_dtype(model) == torch.float32
        self.tracker = ModuleTracker(model, self._enter, self._leave)
        self.stack = self.tracker.stack  # the running modules, innermost last
        self.table = SiteTable(model, self.tracker.names)
        self.sites: list[SiteInfo] = self.table.sites
        # (site id, call number within a forward) that a .half() model computes in FP32
        # (see _halfdtypes); None until traced, at the end of the first forward call with
        # a value out of range (``half_dtypes_of``), from the first call's inputs
        self.half_fp32: set[tuple[int, int]] | None = None if options.half_dtypes else set()
        self.first: FirstCall | None = None
        self.trace: HalfTrace | None = None  # the meta FP16 run, while it runs
        self.paused = None  # (frame, exit stack): the Linear recorded at its boundary
        self.calls: dict[int, int] = {}  # site id -> calls so far in this forward
        # id(tensor) -> (weak ref, producer events, version counter, min, max) for the
        # tensors of the running forward call; the extremes are exact while the version
        # counter is unchanged (-1: not known). Cleared when the call ends.
        self.known: dict[int, tuple] = {}
        self.ops: dict = {}  # aten overload -> OpInfo
        self.forward: Forward | None = None
        self.forwards = 0
        self.last_site = ""
        self.raised_in = ""  # the innermost module whose forward raised
        self.on_forward_end = on_forward_end
        # True while a compiled scan captures a forward into a graph (watch/_compiled.py):
        # every event then takes the off-CPU path (tensor extremes, no host sync, nothing
        # derived from earlier values), so what runs is the same for every batch
        self.static = False
        # where FP16 holds a 0 that FP32 does not, for this forward (watch/_underflow.py)
        self.shadow = ZeroShadow(
            lambda t: (self._lookup(t) or (None, ()))[1],
            lambda: self.forward.fp32 if self.forward is not None else (),
            lambda: self.static,
        )

    # ---- module boundaries (the tracker's callbacks) -------------------------------
    def _enter(self, frame: Frame, args, kwargs) -> None:
        if self.trace is not None:
            self.trace.enter(frame)
            return
        if not self.stack:  # the model, or one of its modules called on its own
            self._begin_forward(frame, args, kwargs)
        # a Linear runs several aten ops (t, addmm, views) for one output: its output
        # is recorded at the module boundary, with this mode paused inside
        if self.paused is None:
            self.paused = pause_at_boundary(self, frame)

    def _leave(self, frame: Frame, args, output) -> None:
        if self.trace is not None:
            self.trace.leave(frame, output)
            return
        if self.forward is None:
            return
        # always_call hooks also run after a raise, with output None; an exception being
        # handled around the whole watch (watch called in an except block) is not a raise
        raised = output is None and sys.exc_info()[1] is not None
        if not self.raised_in and raised:
            self.raised_in = frame.name
        if self.paused is not None and self.paused[0] is frame:
            # still paused: the stats ops below are not the model's
            if (
                not raised
                and isinstance(output, torch.Tensor)
                and output.is_floating_point()
                and output.numel()
            ):
                site = self.table.site(frame, "")
                self.last_site = self.sites[site].name
                previous = threads.narrow(output.numel()) if output.is_cpu else 0
                try:
                    eid = self._add_event(site, self._producers(args, {}), output)
                finally:
                    threads.restore(previous)
                self._mark_fp32(site, eid, frame.fp32)
            self._resume()
        inside = bool(self.stack) and self.stack[-1].fp32  # an island within an island: stays FP32
        if (
            frame.island
            and not raised
            and not inside
            and not getattr(frame.module, "fp32_out", False)
        ):
            self._hand_off(output)
        if not self.stack:
            self._end_forward(output)

    @property
    def running(self) -> Forward:
        """The forward being recorded (events come only while one runs)."""
        assert self.forward is not None
        return self.forward

    def _hand_off(self, output) -> None:
        """An FP32 island's output goes back to the model's dtype: the events that made it
        are FP16 values there (an island must not hand on what FP16 cannot hold)."""
        fw = self.running
        for t in _float_tensors(output, []):
            ent = self._lookup(t)
            for e in ent[1] if ent is not None else ():
                fw.fp32.discard(e)
                fw.half_fp32.discard(e)
                fw.handoff.add(e)

    def _resume(self) -> None:
        if self.paused is not None:
            self.paused[1].close()
            self.paused = None

    # ---- forward boundaries ------------------------------------------------------
    def _begin_forward(self, frame: Frame, args, kwargs) -> None:
        # each float input with the argument it came in (its position, or its keyword)
        named = [(str(i), t) for i, a in enumerate(args or ()) for t in _float_tensors(a, [])]
        named += [(str(k), t) for k, v in (kwargs or {}).items() for t in _float_tensors(v, [])]
        floats = [t for _, t in named]
        device = floats[0].device.type if floats else "cpu"
        if self.fp32_model and autocast_dtype(device) == torch.float16:
            raise WatchError(
                f"the forward runs under torch.autocast({device!r}, dtype=torch.float16), so its "
                "values are FP16's own (inf where FP16 overflowed, not how far FP32 goes); run "
                "the watched forward without autocast: fp16lens shows from the FP32 values where "
                "FP16 overflows"
            )
        if self.half_fp32 is None and self.first is None:
            try:
                self.first = FirstCall(frame.module, args, kwargs)
            except Exception:  # inputs that cannot go to meta: nothing known, as on a failed trace
                self.half_fp32 = set()
        self.calls = {}
        fw = self.forward = Forward(index=self.forwards)
        self.raised_in = ""
        self.forwards += 1
        if not self.static:  # a captured forward has no values to read (nor needs them again)
            with dispatch_mode_paused(self):  # fp16lens's own reductions are not the model's ops
                fw.input_specs = describe_inputs(args, kwargs)
        for name, t in named:
            fw.input_shapes.append(list(t.shape))
            if t.numel():  # an empty input has no range to record
                fw.input_names.append(name)
                self._add_event(INPUT_SITE, (), t)

    def _end_forward(self, output) -> None:
        fw, self.forward = self.running, None
        outs: set[int] = set()
        if output is not None:
            for t in _float_tensors(output, []):
                ent = self._lookup(t)
                if ent is not None:
                    outs.update(ent[1])
        fw.outputs = tuple(sorted(outs))
        fw.flush, fw.consts = self.shadow.reset()
        self.known.clear()
        self.on_forward_end(fw)

    def half_dtypes_of(self, fw: Forward) -> None:
        """Mark the events of ``fw`` (recorded before the meta trace ran) that a .half()
        model computes in FP32, running the trace first; the accumulator calls this for
        a forward with a value out of range. Events of later calls are marked as recorded."""
        if self.half_fp32 is not None:
            return
        self._trace_half_dtypes()
        if not self.half_fp32:
            return
        calls: dict[int, int] = {}  # call numbers as _call_number gives them: in event order
        for e, site in enumerate(fw.sites):
            if site == INPUT_SITE:
                continue
            k = calls.get(site, 0)
            calls[site] = k + 1
            if (site, k) in self.half_fp32 and e not in fw.handoff:
                fw.half_fp32.add(e)
                fw.fp32.add(e)

    def _trace_half_dtypes(self) -> None:
        """Run the first forward call's module in FP16 on meta once, recording which site
        calls come out FP32; this mode is paused meanwhile, the trace's own mode sees the ops."""
        first, self.first = self.first, None
        self.half_fp32 = set()
        if first is None:
            return
        depth = len(self.stack)
        self.trace = trace = HalfTrace(self.tracker, self.table, self.ops, self.options.ops)
        try:
            with dispatch_mode_paused(self), trace:
                try:
                    first.run_half_on_meta()
                finally:
                    trace.unpause()
            self.half_fp32 = trace.found
        except Exception:  # needs real values (or mixes devices): nothing known
            self.half_fp32 = set()
        finally:
            self.trace = None
            del self.stack[depth:]

    def _mark_fp32(self, site: int, eid: int, island: bool) -> bool:
        """Whether the event's values are FP32 in a .half() model (an island, or the
        model's own FP32 compute; ``island``: run inside an FP32 island): such values
        cannot overflow FP16."""
        half = self.half_fp32  # None: not known yet (half_dtypes_of marks them later)
        upcast = half is not None and bool(half) and (site, self._call_number(site)) in half
        if upcast:
            self.running.half_fp32.add(eid)
        if upcast or island:
            self.running.fp32.add(eid)
            return True
        return False

    def _call_number(self, site: int) -> int:
        k = self.calls.get(site, 0)
        self.calls[site] = k + 1
        return k

    def abort_forward(self) -> None:
        """The forward raised: reduce what ran so far, with no outputs."""
        self._resume()
        if self.forward is not None:
            self.stack.clear()
            self._end_forward(None)

    # ---- events --------------------------------------------------------------------
    def _record_fused(self, name: str, func, args, kwargs, prods: tuple[int, ...]):
        """Events for the steps a fused kernel stores inside; returns the site of its
        output and that output's producers (the op's own when it is not decomposed)."""
        steps = _fused_kernels.stored(name, func, args, kwargs)
        if not steps:
            return self.table.site(self.stack[-1], name), prods
        eids: list[int] = []
        for st in steps:
            ins = tuple(sorted({e for i in st.inputs for e in (prods if i < 0 else (eids[i],))}))
            site = self.table.fused_site(self.stack[-1], st.name, st.op)
            if st.value is None:  # the op's output, recorded by the caller
                out = site, ins
            else:
                eids.append(self._add_event(site, ins, st.value))
            fp32 = st.value is not None and self._mark_fp32(site, eids[-1], self.stack[-1].fp32)
            if (
                st.internal is not None
                and self.options.internal
                and not fp32
                and not self.stack[-1].fp32
            ):
                self.running.internal.append((site, *st.internal))
                self.running.internal_of.append(eids[-1] if st.value is not None else -1)
        return out

    def _lookup(self, t: torch.Tensor):
        """(ref, producer events, version, min, max) recorded for ``t`` in this forward."""
        ent = self.known.get(id(t))
        return ent if ent is not None and ent[0]() is t else None

    def _remember(
        self, t: torch.Tensor, prods: tuple[int, ...], lo=None, hi=None, bump: int = 0
    ) -> None:
        # exact extremes are kept only on the CPU (a sync is free there) and while the
        # tensor is unmodified: its version counter tells (an in-place op's bump lands
        # after this mode returns, hence ``bump``); inference tensors have no counter
        if lo is not None:
            try:
                self.known[id(t)] = (weakref.ref(t), prods, t._version + bump, lo, hi)
                return
            except RuntimeError:  # an inference tensor: no version counter
                pass
        self.known[id(t)] = (weakref.ref(t), prods, -1, None, None)

    def _known_range(self, t: torch.Tensor) -> tuple[float, float] | None:
        """(min, max) of ``t`` when recorded in this call and unmodified since."""
        ent = self._lookup(t)
        if ent is None or ent[2] < 0 or t._version != ent[2]:
            return None
        return ent[3], ent[4]

    def _producers(self, args, kwargs) -> tuple[int, ...]:
        found: list[int] = []
        for a in (*args, *kwargs.values()) if kwargs else args:
            if isinstance(a, torch.Tensor):
                ent = self._lookup(a)
                if ent is not None:
                    found.extend(ent[1])
            elif isinstance(a, (list, tuple)):
                for b in a:
                    if isinstance(b, torch.Tensor):
                        ent = self._lookup(b)
                        if ent is not None:
                            found.extend(ent[1])
        if len(found) < 2:
            return tuple(found)
        return tuple(sorted(set(found)))

    def _add_event(
        self,
        site: int,
        inputs: tuple[int, ...],
        t: torch.Tensor,
        known: tuple[float, float] | None = None,
        inplace: bool = False,
    ) -> int:
        fw = self.running
        eid = len(fw.sites)
        out = t  # the tensor the model sees: the one remembered
        if t.requires_grad:
            t = t.detach()
        flat = t if t.is_contiguous() else flat_view(t)  # elements in memory order
        fw.sites.append(site)
        fw.inputs.append(inputs)
        if self.fp32_model and t.dtype == torch.float16 and site != INPUT_SITE:
            fw.fp16.add(eid)
        fw.samples.append(take_sample(flat, self.options.sample_size))
        fw.numels.append(t.numel())
        fw.shapes.append(t.shape)
        if self.static or t.device.type != "cpu":  # no host sync per op: extremes are
            # reduced per forward
            fw.extremes.append(extremes(flat))
            self._remember(out, (eid,))
            return eid
        # on the CPU a sync is free: keep Python floats, and exact counts
        if known is None:
            lo, hi = torch.aminmax(flat)
            lo, hi = lo.item(), hi.item()
        else:
            lo, hi = known
        fw.extremes.append((lo, hi))
        peak = hi if hi >= -lo else -lo  # NaN when the tensor holds NaN
        if not peak <= self.options.threshold:
            self._count_over(eid, t, peak)
        self._remember(out, (eid,), lo, hi, int(inplace))
        return eid

    def _count_over(self, eid: int, t: torch.Tensor, peak: float) -> None:
        """Exact counts for an output past the threshold (rare: one more pass)."""
        fw = self.running
        a = t.abs()
        if peak != peak:  # NaN: keep the largest finite value beside it
            fw.finite_max[eid] = float(torch.where(a.isfinite(), a, 0).max())
        if peak >= SATURATED:
            huge = a >= SATURATED
            rest = torch.where(huge, 0, a)
            fw.saturated[eid] = (float(rest.max()), int(huge.sum()))
            a = rest
        fw.exact_over[eid] = int((a > self.options.threshold).sum()) + int(a.isnan().sum())

    def _derived(self, func, info: OpInfo, args, kwargs, numel: int) -> tuple[float, float] | None:
        """Exact extremes of a monotone elementwise op's output from those of its input
        (relu, clamp, leaky_relu, scaling by a number...): the op applied to the
        input's (min, max) gives the output's, since rounding is monotone too. Saves a
        pass over the largest tensors; only when the input is a recorded, unmodified
        tensor on the CPU."""
        if (
            not info.monotone
            or numel < _DERIVE_MIN
            or not args
            or not isinstance(args[0], torch.Tensor)
        ):
            return None
        x = args[0]
        rng = self._known_range(x)
        if rng is None or not _scalar_args(args, kwargs):
            return None
        pair = torch.tensor(rng, dtype=x.dtype)
        try:
            r = func(pair, *args[1:], **kwargs).tolist()
        except (RuntimeError, TypeError):
            return None
        if not (isinstance(r, list) and len(r) == 2):
            return None
        a, b = r
        return (a, b) if not b < a else (b, a)

    def _pass_through(
        self, info: OpInfo, x: torch.Tensor, out: torch.Tensor, func=None, args=(), kwargs=None
    ):
        """A view or copy of its first argument (the common case, kept short): the output
        inherits the producers, and the extremes when the values are unchanged."""
        if not out.is_floating_point():
            return out
        ent = self._lookup(x)
        if ent is None:
            return out  # a parameter or constant: nothing to inherit
        rng = self._known_range(x) if info.preserving else None
        if self.shadow.masks:
            self.shadow.view(func, args, kwargs or {}, out, int(info.mutable))
        lo, hi = rng or (None, None)
        self._remember(out, ent[1], lo, hi, int(info.mutable))
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **kwargs) if kwargs else func(*args)
        if not self.stack:
            return out
        if self.forward is None:
            return out
        info = self.ops.get(func)
        if info is None:
            info = self.ops[func] = OpInfo.of(func)
        if info.factory:
            return out
        if (
            info.single_source
            and isinstance(out, torch.Tensor)
            and args
            and isinstance(args[0], torch.Tensor)
        ):
            return self._pass_through(info, args[0], out, func, args, kwargs)
        kwargs = kwargs or {}
        outs: Sequence[torch.Tensor]
        if isinstance(out, torch.Tensor):
            if not out.is_floating_point():
                return out
            outs = (out,)
        else:
            outs = _float_tensors(out, [])
            if not outs:
                return out
        prods = self._producers(args, kwargs)
        first = outs[0]
        if (
            info.passthrough
            or first.numel() == 0
            or (not self.options.ops and not self.stack[-1].leaf)
        ):
            rng = (
                self._known_range(args[0])
                if info.preserving and args and isinstance(args[0], torch.Tensor)
                else None
            )
            lo, hi = rng or (None, None)
            for t in outs:
                self._remember(t, prods, lo, hi, int(info.mutable))
            if self.shadow.masks and info.passthrough and isinstance(out, torch.Tensor):
                self.shadow.view(func, args, kwargs, out, int(info.mutable))
            return out
        previous = threads.narrow(first.numel()) if first.is_cpu else 0
        try:
            self._record(func, info, args, kwargs, first, prods)
        finally:
            threads.restore(previous)
        return out

    def _record(
        self, func, info: OpInfo, args, kwargs, first: torch.Tensor, prods: tuple[int, ...]
    ) -> None:
        """The op's event (statistics of its first output) and its internal check."""
        if info.fused:  # the kernel's inner steps become events: its output is the last
            site, prods = self._record_fused(info.name, func, args, kwargs, prods)
        else:
            site = self.table.site(self.stack[-1], info.name)
        self.last_site = self.sites[site].name
        known = self._derived(func, info, args, kwargs, first.numel()) if info.monotone else None
        eid = self._add_event(site, prods, first, known, inplace=info.mutable)
        fp32 = self._mark_fp32(site, eid, self.stack[-1].fp32)
        if info.name in _FLUSH_OPS:
            self.shadow.op(
                info.name, args, kwargs, first, site, eid, fp32, int(info.mutable), prods
            )
        if info.internal and self.options.internal and not fp32:
            found = _internal.check(
                info.name, func, args, kwargs, first, self._known_range, self.options.threshold
            )
            if found is not None:
                self.running.internal.append((site, *found))
                self.running.internal_of.append(eid)
