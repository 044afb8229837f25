"""watch(): where a model's values leave FP16 range, and where they come back."""

from fp16lens.watch._lens import Lens, watch
from fp16lens.watch._options import WatchOptions
from fp16lens.watch._scan import call_model, scan

__all__ = ["Lens", "WatchOptions", "call_model", "scan", "watch"]
