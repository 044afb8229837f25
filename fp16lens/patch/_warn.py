"""PatchWarning: patch() never returns silently with something it did not fix or check."""


class PatchWarning(UserWarning):
    """patch() left a problem unresolved (each site named with the way out), or could not
    run a check (the FP32 equivalence check, or real FP16 without batches=). Pass
    ``strict=True`` to raise PatchError for unresolved problems instead."""
