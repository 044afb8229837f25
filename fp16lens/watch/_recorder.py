"""The recorder: module hooks name the running module, a TorchDispatchMode sees every
aten op. Each float op output becomes an *event* (site, producer events, max |v|, a
sampled stats vector); events are reduced once per forward call, never holding on
to activations (producers are tracked through weak references to the tensors).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from fp16lens.report._model import SATURATED
from fp16lens.watch import _internal
from fp16lens.watch._ops import FACTORY, PASSTHROUGH, is_builtin_leaf, op_name
from fp16lens.watch._options import WatchOptions
from fp16lens.watch._tensorstats import extremes, flat_view, take_sample

INPUT_SITE = -1


@dataclass
class SiteInfo:
    name: str
    kind: str
    op: str
    module: str
    order: int


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
    fp32: set[int] = field(default_factory=set)  # events inside FP32 islands
    saturated: dict[int, tuple[float, int]] = field(default_factory=dict)  # event -> (max |v| below
    # SATURATED, count of saturated values): masking constants do not count as overflow
    finite_max: dict[int, float] = field(default_factory=dict)  # event holding NaN -> max |v|
    # of its finite values: used when the inputs carry NaN/inf (the data's problem)
    internal: list[tuple[int, str, torch.Tensor, dict]] = field(default_factory=list)
    outputs: tuple[int, ...] = ()
    input_shapes: list[list[int]] = field(default_factory=list)


def _float_tensors(obj, out: list) -> list:
    """Float tensors in nested args (one level of lists/tuples, dicts, dataclass fields)."""
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


class Recorder(TorchDispatchMode):
    """Records every op run inside the watched model's forward."""

    def __init__(self, model: torch.nn.Module, options: WatchOptions, on_forward_end):
        super().__init__()
        self.options = options
        self.root = model
        self.names: dict[torch.nn.Module, str] = {}
        for name, m in model.named_modules(remove_duplicate=False):
            self.names.setdefault(m, name)
        self.leaf = {m: is_builtin_leaf(m) for m in self.names}
        self.stack: list[tuple[str, bool, dict[str, int], bool]] = []  # name, leaf, op counts, fp32
        self.sites: list[SiteInfo] = []
        self.site_ids: dict[str, int] = {}
        self.producers: WeakIdKeyDictionary = WeakIdKeyDictionary()
        # event output -> (version counter, min, max): exact while the tensor is unmodified
        self.extremes_of: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.forward: Forward | None = None
        self.forwards = 0
        self.last_site = ""
        self.raised_in = ""  # the innermost module whose forward raised
        self.on_forward_end = on_forward_end
        self.handles: list = []

    # ---- module hooks ------------------------------------------------------------
    def attach(self) -> None:
        for m in self.names:
            self.handles.append(m.register_forward_pre_hook(self._pre, with_kwargs=True))
            self.handles.append(m.register_forward_hook(self._post, always_call=True))

    def detach(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self.stack.clear()

    def _pre(self, module, args, kwargs):
        if not self.stack:  # the model, or one of its modules called on its own
            self._begin_forward(args, kwargs)
        if self.forward is not None:
            # modules that keep themselves in FP32 under .half() (fp16lens.patch's islands)
            # store FP32 values inside: they are recorded but never out of FP16 range
            fp32 = bool(getattr(module, "fp16lens_fp32", False)) or bool(self.stack and self.stack[-1][3])
            self.stack.append((self.names.get(module, "?"), self.leaf.get(module, False), {}, fp32))
        return None

    def _post(self, module, args, output):
        if self.forward is None or not self.stack:
            return None
        if not self.raised_in and sys.exc_info()[1] is not None:  # always_call after a raise
            self.raised_in = self.stack[-1][0]
        self.stack.pop()
        if not self.stack:
            self._end_forward(output)
        return None

    # ---- forward boundaries ------------------------------------------------------
    def _begin_forward(self, args, kwargs) -> None:
        fw = self.forward = Forward(index=self.forwards)
        self.raised_in = ""
        self.forwards += 1
        for t in _float_tensors((args, kwargs), []):
            fw.input_shapes.append(list(t.shape))
            if t.numel():  # an empty input has no range to record
                self._add_event(INPUT_SITE, (), t)

    def _end_forward(self, output) -> None:
        fw, self.forward = self.forward, None
        outs: set[int] = set()
        if output is not None:
            for t in _float_tensors(output, []):
                outs.update(self.producers.get(t, ()))
        fw.outputs = tuple(sorted(outs))
        self.on_forward_end(fw)

    def abort_forward(self) -> None:
        """The forward raised: reduce what ran so far, with no outputs."""
        if self.forward is not None:
            self.stack.clear()
            self._end_forward(None)

    # ---- events --------------------------------------------------------------------
    def _site(self, op: str) -> int:
        module, leaf, counts, _ = self.stack[-1]
        if leaf:
            name, kind, label = module, "module", None
        else:
            n = counts[op] = counts.get(op, 0) + 1
            name, kind, label = f"{module}:{op}" + (f"#{n}" if n > 1 else ""), "op", op
        sid = self.site_ids.get(name)
        if sid is None:
            mod_obj = None
            if label is None:
                mod_obj = next((m for m, nm in self.names.items() if nm == module), None)
            shown = type(mod_obj).__name__ if mod_obj is not None else label
            sid = self.site_ids[name] = len(self.sites)
            self.sites.append(SiteInfo(name, kind, shown or op, module, sid))
        return sid

    def _add_event(self, site: int, inputs: tuple[int, ...], t: torch.Tensor,
                   known: tuple[float, float] | None = None, inplace: bool = False) -> int:
        fw = self.forward
        eid = len(fw.sites)
        flat = flat_view(t.detach())
        fw.sites.append(site)
        fw.inputs.append(inputs)
        fw.samples.append(take_sample(flat, self.options.sample_size))
        fw.numels.append(t.numel())
        fw.shapes.append(list(t.shape))
        if t.device.type != "cpu":  # no host sync per op: extremes are reduced per forward
            fw.extremes.append(extremes(flat))
        else:  # on the CPU a sync is free: keep Python floats, and exact counts
            lo, hi = known if known is not None else (float(v) for v in torch.aminmax(flat))
            fw.extremes.append((lo, hi))
            peak = hi if hi >= -lo else -lo  # NaN when the tensor holds NaN
            if not peak <= self.options.threshold:
                a = t.detach().abs()
                if peak != peak:  # NaN: keep the largest finite value beside it
                    fw.finite_max[eid] = float(torch.where(a.isfinite(), a, 0).max())
                if peak >= SATURATED:
                    huge = a >= SATURATED
                    rest = torch.where(huge, 0, a)
                    fw.saturated[eid] = (float(rest.max()), int(huge.sum()))
                    a = rest
                fw.exact_over[eid] = int((a > self.options.threshold).sum()) + int(a.isnan().sum())
        self.producers[t] = (eid,)
        if t.device.type == "cpu" and not t.is_inference():  # no version counter there
            # an in-place op's version bump happens after this mode returns
            self.extremes_of[t] = (t._version + int(inplace), *fw.extremes[-1])
        return eid

    def _derived(self, func, name: str, args) -> tuple[float, float] | None:
        """Exact extremes of relu(x) from those of x, when x is a recorded op output that
        nothing modified since (its version counter tells): one pass less over the
        largest tensors of a CNN."""
        if name != "relu" or not args or not torch.is_tensor(args[0]):
            return None
        known = self.extremes_of.get(args[0])
        if known is None or args[0].is_inference():
            return None
        version, lo, hi = known
        if args[0]._version != version:  # modified since (bumps land after each in-place op)
            return None
        return (lo if lo > 0 else 0.0 if lo == lo else lo, hi if hi > 0 else 0.0 if hi == hi else hi)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.forward is None or not self.stack:
            return out
        name = op_name(func)
        if name in FACTORY:
            return out
        ins = _float_tensors(args, _float_tensors(kwargs, []))
        prods = tuple(sorted({p for t in ins for p in self.producers.get(t, ())}))
        outs = _float_tensors(out, [])
        if not outs:
            return out
        if (
            name in PASSTHROUGH
            or outs[0].numel() == 0
            or (not self.options.ops and not self.stack[-1][1])
        ):
            for t in outs:
                self.producers[t] = prods
            return out
        site = self._site(name)
        self.last_site = self.sites[site].name
        eid = self._add_event(site, prods, outs[0], self._derived(func, name, args),
                              inplace=func._schema.is_mutable)
        if self.stack[-1][3]:
            self.forward.fp32.add(eid)
        if self.options.internal and not self.stack[-1][3]:
            found = _internal.check(name, func, args, kwargs, outs[0])
            if found is not None:
                self.forward.internal.append((site, *found))
        return out
