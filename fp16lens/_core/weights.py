"""Whether a model holds values to run: tensors on the meta device or lazy parameters not
yet initialized have none (watch, export and the CLI say so in one line instead of
torch's "Cannot copy out of meta tensor")."""

from __future__ import annotations


def missing_weights(model) -> str | None:
    """Why ``model`` has no weights to run (naming a tensor and the fix), or None."""
    from torch.nn.parameter import UninitializedParameter

    tensors = [*model.named_parameters(), *model.named_buffers()]
    lazy = next((n for n, t in tensors if isinstance(t, UninitializedParameter)), None)
    if lazy is not None:
        return (
            f"it has uninitialized lazy parameters ({lazy}); run the model once on an example "
            "input before handing it over"
        )
    meta = next((n for n, t in tensors if t.is_meta), None)
    if meta is not None:
        return (
            f"it has no weights: {meta} (and maybe others) is on the meta device; load real "
            "weights first (model.to_empty(device='cpu') then load_state_dict, or build it "
            "outside torch.device('meta'))"
        )
    return None
