"""Input specs and batch files of the CLI."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fp16lens._core import Fp16LensError
from fp16lens.cli._batchfile import load_batches, split_batch
from fp16lens.cli._inputs import InputSpec, parse_dtypes, parse_range, parse_shape


def test_parse_shape():
    assert parse_shape("1x3x224x224") == (1, 3, 224, 224)
    assert parse_shape("8") == (8,)
    assert parse_shape("2X5") == (2, 5)
    for bad in ("", "1x", "1x0x3", "ax3", "1,3", "-1x3"):
        with pytest.raises(Fp16LensError, match="bad input shape"):
            parse_shape(bad)


def test_parse_range_and_dtypes():
    assert parse_range("0,255") == (0.0, 255.0)
    assert parse_range("-1.5,1") == (-1.5, 1.0)
    for bad in ("1", "2,1", "a,b", "0,inf", "0,1,2"):
        with pytest.raises(Fp16LensError, match="LOW,HIGH"):
            parse_range(bad)
    assert parse_dtypes("int64", 2) == [torch.int64, torch.int64]
    assert parse_dtypes("float32,int64", 2) == [torch.float32, torch.int64]
    with pytest.raises(Fp16LensError, match="unknown dtype 'float64x'"):
        parse_dtypes("float64x", 1)
    with pytest.raises(Fp16LensError, match="2 dtypes for 3 inputs"):
        parse_dtypes("float32,int64", 3)


def test_input_spec_makes_seeded_batches_in_range():
    spec = InputSpec(((2, 3), (4,)), (torch.float32, torch.int64), 0.0, 255.0, batches=3, seed=1)
    batches = spec.make()
    assert len(batches) == 3 and all(len(b) == 2 for b in batches)
    x, ids = batches[0]
    assert x.shape == (2, 3) and x.dtype == torch.float32
    assert ids.shape == (4,) and ids.dtype == torch.int64
    assert x.min() >= 0 and x.max() < 255 and ids.min() >= 0 and ids.max() <= 255
    assert not torch.equal(batches[0][0], batches[1][0])  # batches differ
    again = spec.make()
    assert all(torch.equal(a, b) for a, b in zip(batches[2], again[2]))  # same seed, same data
    with pytest.raises(ValueError, match="batches must be an int >= 1"):
        InputSpec(((1,),), (torch.float32,), batches=0)


def test_pt_files_hold_one_batch_or_a_list(tmp_path):
    t = torch.arange(6.0).view(3, 2)
    torch.save(t, tmp_path / "one.pt")
    torch.save((t, t + 1), tmp_path / "two_inputs.pt")
    torch.save([t, t * 2], tmp_path / "list.pt")
    assert [b[0].tolist() for b in load_batches(tmp_path / "one.pt")] == [t.tolist()]
    ((_a, b),) = load_batches(tmp_path / "two_inputs.pt")
    assert torch.equal(b, t + 1)
    assert [
        torch.equal(b[0], e) for b, e in zip(load_batches(tmp_path / "list.pt"), (t, t * 2))
    ] == [True, True]
    split = load_batches(tmp_path / "one.pt", batch_size=2)
    assert [b[0].shape[0] for b in split] == [2, 1]


def test_a_dict_of_tensors_is_one_batch_by_input_name(tmp_path):
    """An ONNX graph's inputs or a module's forward keywords, by name: a dict is one batch,
    a list of dicts several, and --batch-size splits a dict into dicts of the same names."""
    x, scale = torch.arange(8.0).reshape(4, 2), torch.ones(4, 1)
    torch.save({"x": x, "scale": scale}, tmp_path / "one.pt")
    (batch,) = load_batches(tmp_path / "one.pt")
    assert list(batch) == ["x", "scale"] and torch.equal(batch["x"], x)
    torch.save([{"x": x}, {"x": x * 2}], tmp_path / "list.pt")
    assert [b["x"][1, 1].item() for b in load_batches(tmp_path / "list.pt")] == [3.0, 6.0]
    parts = load_batches(tmp_path / "one.pt", batch_size=3)
    assert [list(p) for p in parts] == [["x", "scale"]] * 2
    assert [p["x"].shape[0] for p in parts] == [3, 1] and torch.equal(parts[1]["x"], x[3:])


def test_npz_arrays_are_the_positional_inputs(tmp_path):
    np.savez(tmp_path / "x.npz", image=np.ones((4, 3), np.float32), ids=np.arange(4))
    ((image, ids),) = load_batches(tmp_path / "x.npz")
    assert image.shape == (4, 3) and ids.tolist() == [0, 1, 2, 3]
    assert len(load_batches(tmp_path / "x.npz", batch_size=1)) == 4
    # a 0-d array (a sample rate) stays 0-d, and a Fortran-ordered one keeps its values
    np.savez(tmp_path / "y.npz", x=np.asfortranarray(np.arange(6.0).reshape(2, 3)), sr=np.array(8))
    ((x, sr),) = load_batches(tmp_path / "y.npz")
    assert sr.shape == () and sr.item() == 8 and x.tolist() == [[0, 1, 2], [3, 4, 5]]
    np.save(tmp_path / "sr.npy", np.array(16000.0, np.float32))
    assert load_batches(tmp_path / "sr.npy")[0][0].shape == ()


def test_an_npy_array_is_one_batch_of_one_input(tmp_path, capsys):
    """numpy.save's .npy, the commonest array file, is one input: loaded as it is, split
    by --batch-size, and a scan from the terminal reads it."""
    from fp16lens.cli import main

    np.save(tmp_path / "x.npy", np.arange(12, dtype=np.float32).reshape(4, 3))
    ((x,),) = load_batches(tmp_path / "x.npy")
    assert x.dtype == torch.float32 and x.tolist()[1] == [3.0, 4.0, 5.0]
    assert [b[0].shape[0] for b in load_batches(tmp_path / "x.npy", batch_size=3)] == [3, 1]
    (tmp_path / "m.py").write_text(
        "import torch\n\ndef build():\n    return torch.nn.Linear(3, 2)\n"
    )
    model = f"{tmp_path / 'm.py'}:build"
    assert main(["scan", model, "--input", str(tmp_path / "x.npy"), "--no-progress"]) == 0
    assert "FP16-safe" in capsys.readouterr().out
    (tmp_path / "junk.npy").write_bytes(b"not numpy")
    with pytest.raises(Fp16LensError, match=r"cannot read .* as \.npy.*numpy\.save"):
        load_batches(tmp_path / "junk.npy")


def test_bad_batch_files_are_user_errors(tmp_path):
    with pytest.raises(Fp16LensError, match="does not exist"):
        load_batches(tmp_path / "missing.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a torch file")
    with pytest.raises(Fp16LensError, match="cannot read input batches"):
        load_batches(tmp_path / "junk.pt")
    torch.save({"x": 1.0}, tmp_path / "dict.pt")  # not tensors by name
    with pytest.raises(Fp16LensError, match="holds a dict, not batches"):
        load_batches(tmp_path / "dict.pt")
    torch.save([{"x": torch.ones(1)}, {1: torch.ones(1)}], tmp_path / "dicts.pt")
    with pytest.raises(Fp16LensError, match=r"a batch is a dict; .* a dict of tensors by input"):
        load_batches(tmp_path / "dicts.pt")
    with pytest.raises(Fp16LensError, match="first \\(batch\\) axis"):
        split_batch((torch.ones(2, 1), torch.ones(3, 1)), 1)


class _Stranger:  # a class a weights-only load must never construct
    def __init__(self):
        self.x = 1


def test_a_pt_file_of_numpy_arrays_is_read_as_tensors(tmp_path, capsys):
    """Batches made with NumPy (an ONNX model's usually are: Silero VAD's chunk, its state
    and the sample rate as a 0-d int64 array) and saved with torch.save load as tensors of
    the same values and dtypes, the weights-only load allowing NumPy's array reconstruction
    for that load alone. Before, the file was refused with torch's first line, escape
    codes and all. Any other object is still refused, never constructed, in one line that
    names it."""
    from fp16lens.cli import main

    chunk = np.linspace(-1, 1, 512, dtype=np.float32)[None]
    batches = [
        {"input": chunk * k, "state": np.zeros((2, 1, 128), np.float32), "sr": np.array(16000)}
        for k in (1, 2)
    ]
    torch.save(batches, tmp_path / "vad.pt")
    before = torch.serialization.get_safe_globals()
    got = load_batches(tmp_path / "vad.pt")
    assert set(torch.serialization.get_safe_globals()) == set(before)  # for that load alone
    assert [list(b) for b in got] == [["input", "state", "sr"]] * 2
    assert got[1]["input"].dtype == torch.float32 and torch.equal(
        got[1]["input"], torch.from_numpy(chunk * 2)
    )
    assert got[0]["sr"].dtype == torch.int64 and got[0]["sr"].shape == () and got[0]["sr"] == 16000
    torch.save((np.ones((2, 3), np.float16), torch.ones(2)), tmp_path / "mixed.pt")
    ((half, ones),) = load_batches(tmp_path / "mixed.pt")
    assert half.dtype == torch.float16 and torch.equal(ones, torch.ones(2))
    (tmp_path / "m.py").write_text(
        "import torch\n\ndef build():\n    return torch.nn.Linear(3, 2)\n"
    )
    torch.save([np.ones((4, 3), np.float32)], tmp_path / "x.pt")
    model = f"{tmp_path / 'm.py'}:build"
    assert main(["scan", model, "--input", str(tmp_path / "x.pt"), "--no-progress"]) == 0
    assert "FP16-safe" in capsys.readouterr().out
    torch.save([_Stranger()], tmp_path / "object.pt")
    with pytest.raises(Fp16LensError) as refused:
        load_batches(tmp_path / "object.pt")
    line = str(refused.value)
    assert "\n" not in line and "\x1b" not in line, line
    assert f"it holds {__name__}._Stranger, which a weights-only load does not run" in line
    torch.save([np.array([_Stranger()], dtype=object)], tmp_path / "objects.pt")
    with pytest.raises(Fp16LensError, match=r"cannot read input batches .* which a weights-only"):
        load_batches(tmp_path / "objects.pt")
