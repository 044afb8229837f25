"""MODEL arguments: ``demo``, ``package.module:callable`` (or ``file.py:callable``),
a TorchScript file (``.pt``/``.pth``, torch.jit.load) or a torch.export program (``.pt2``).

A callable returns an ``nn.Module``, or ``(module, inputs)`` like the builders in
tests/models.py; ``inputs`` then serve as the default example inputs.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from fp16lens._core import Fp16LensError

if TYPE_CHECKING:  # torch is imported when a model loads, not for `fp16lens --help`
    from torch import nn

MODEL_HELP = (
    "demo, package.module:callable, path/to/file.py:callable, "
    "a TorchScript file (.pt), a torch.export program (.pt2), or for `scan`, `export` and "
    "`verify` an ONNX file (.onnx)"
)


@dataclass(frozen=True)
class LoadedModel:
    model: nn.Module
    source: str
    example_inputs: tuple | None = None
    fp32_modules: tuple[str, ...] = ()  # the FP32 islands a file saved by fp16lens names


def parse_kwargs(text: str | None) -> dict:
    if not text:
        return {}
    try:
        kwargs = json.loads(text)
    except json.JSONDecodeError as exc:
        raise Fp16LensError(
            f"--kwargs is not valid JSON ({exc.msg}); write an object, e.g. '{{\"depth\": 18}}'"
        ) from exc
    if not isinstance(kwargs, dict):
        raise Fp16LensError(f"--kwargs must be a JSON object, got {type(kwargs).__name__}")
    return kwargs


def load_model(spec: str, kwargs: dict | None = None) -> LoadedModel:
    """Load MODEL in eval mode; every failure the user can fix is an Fp16LensError."""
    if spec == "demo":
        from fp16lens.demo import build_demo_model

        demo, demo_inputs = build_demo_model()
        return LoadedModel(demo.eval(), spec, tuple(demo_inputs))
    suffix = Path(spec).suffix.lower()
    if ":" not in spec or suffix in (".pt", ".pth", ".pt2"):
        if kwargs:
            raise Fp16LensError("--kwargs applies to a module:callable MODEL, not to a file")
        model, inputs, islands = _load_file(Path(spec))
        return LoadedModel(model.eval(), spec, inputs, islands)
    return _from_callable(spec, kwargs or {})


def _load_file(path: Path) -> tuple[nn.Module, tuple | None, tuple[str, ...]]:
    """The module, the example inputs stored with it (torch.export programs have them) and
    the FP32 islands its fp16lens metadata names (marked on the module where it has them)."""
    if not path.suffix:
        raise Fp16LensError(f"MODEL {str(path)!r} is not understood; give {MODEL_HELP}")
    if not path.is_file():
        raise Fp16LensError(f"model file {path} does not exist; check the path")
    from fp16lens.patch import ISLANDS_FILE, mark_islands, read_islands

    extra = {ISLANDS_FILE: ""}
    if path.suffix.lower() == ".pt2":
        model, inputs = _load_exported(path, extra)
    elif path.suffix.lower() in (".pt", ".pth"):
        model, inputs = _load_torchscript(path, extra), None
    elif path.suffix.lower() == ".onnx":
        raise Fp16LensError(
            f"{path.name} is an ONNX file: `fp16lens scan`, `patch`, `export` and `verify` read "
            "it, but this needs the PyTorch model; give the model as "
            "package.module:callable, .pt or .pt2"
        )
    else:
        raise Fp16LensError(f"cannot load a model from a {path.suffix} file; give {MODEL_HELP}")
    islands = read_islands(extra[ISLANDS_FILE])
    mark_islands(model, islands)
    return model, inputs, tuple(islands)


def _load_torchscript(path: Path, extra: dict) -> nn.Module:
    import torch

    try:
        return torch.jit.load(str(path), map_location="cpu", _extra_files=extra)
    except RuntimeError as exc:
        raise Fp16LensError(
            f"{path} is not a TorchScript file ({str(exc).splitlines()[0]}); save one with "
            "torch.jit.trace(model, x).save(path), or give MODEL as package.module:callable"
        ) from exc


def _load_exported(path: Path, extra: dict) -> tuple[nn.Module, tuple | None]:
    import zipfile

    import torch

    from fp16lens._core.quiet import quiet

    if not zipfile.is_zipfile(path):
        raise Fp16LensError(
            f"{path} is not a torch.export program (not a zip archive); save one with "
            "torch.export.save(torch.export.export(model, (x,)), path)"
        )
    try:
        with quiet():  # torch logs its own traceback and deprecation notices while loading
            program = torch.export.load(str(path), extra_files=extra)
    except Exception as exc:  # zip/pickle/version errors of torch.export.load
        imported = _import_output_types(path)  # e.g. transformers' ModelOutput pytrees
        try:
            if not imported:
                raise exc
            with quiet():
                program = torch.export.load(str(path), extra_files=extra)
        except Exception as again:
            raise Fp16LensError(
                f"{path} is not a torch.export program fp16lens can load ({type(again).__name__}"
                f"{': ' + ', '.join(imported) + ' imported' if imported else ''}); save one with "
                "torch.export.save(torch.export.export(model, (x,)), path), and install the "
                "packages its inputs and outputs come from"
            ) from exc
    example = program.example_inputs[0] if program.example_inputs else None
    try:  # the module hierarchy back, so that sites keep their qualified names
        with warnings.catch_warnings():  # torch's own deprecation notices (tree specs)
            warnings.simplefilter("ignore", FutureWarning)
            return torch.export.unflatten(program), example
    except Exception:  # unflatten is best effort; the flat module still runs
        return program.module(), example


def _import_output_types(path: Path) -> list[str]:
    """Import the modules that define the classes a program's input/output pytrees name
    (transformers registers each ModelOutput class as it is defined; a .pt2 of a
    transformers model loads only after that). Returns the modules imported."""
    import re
    import zipfile

    names: set[str] = set()
    with zipfile.ZipFile(path) as archive:
        for member in archive.namelist():
            if member.endswith(".json"):
                text = archive.read(member).decode("utf-8", "replace")
                names |= set(re.findall(r"\b([A-Za-z_]\w*(?:\.\w+)+)\.[A-Z]\w*\b", text))
    imported = []
    for module in sorted(names):
        top = module.split(".")[0]
        if top in ("torch", "builtins", "collections") or importlib.util.find_spec(top) is None:
            continue
        try:
            importlib.import_module(module)
        except Exception:  # a module path that is not one, or a package that fails to import
            continue
        imported.append(module)
    return imported


def _import(module_name: str):
    if module_name.endswith(".py"):
        return _import_file(Path(module_name))
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # `fp16lens scan mynet:build` finds ./mynet.py
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            raise Fp16LensError(
                f"cannot import {module_name!r} ({exc}); check the spelling, or run from the "
                "folder that holds it, or add that folder to PYTHONPATH"
            ) from exc
        raise


def _import_file(path: Path):
    if not path.is_file():
        raise Fp16LensError(f"model file {path} does not exist; check the path")
    folder = str(path.resolve().parent)
    if folder not in sys.path:  # as `python file.py` would: the file imports its neighbours
        sys.path.insert(0, folder)
    name = f"_fp16lens_user_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None  # a .py file: a source file loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _from_callable(spec: str, kwargs: dict) -> LoadedModel:
    from torch import nn

    module_name, _, attr = spec.rpartition(":")
    target = getattr(_import(module_name), attr, None)
    if target is None or not callable(target):
        raise Fp16LensError(
            f"{module_name!r} has no callable {attr!r}; MODEL is package.module:callable, "
            "where callable(**kwargs) returns an nn.Module"
        )
    _check_kwargs(target, spec, kwargs)
    result = target(**kwargs)
    inputs = None
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], nn.Module):
        result, inputs = result
        inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    if not isinstance(result, nn.Module):
        raise Fp16LensError(
            f"{spec} returned a {type(result).__name__}, not an nn.Module (or (module, inputs))"
        )
    require_weights(result, spec)
    return LoadedModel(result.eval(), spec, inputs)


def _check_kwargs(target, spec: str, kwargs: dict) -> None:
    """--kwargs the callable does not take: one line naming those it does."""
    import inspect

    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):  # builtins and C callables: let the call say it
        return
    try:
        signature.bind(**kwargs)
    except TypeError as exc:
        takes = [
            n
            for n, p in signature.parameters.items()
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
        raise Fp16LensError(
            f"--kwargs does not fit {spec} ({exc}); it takes "
            f"{', '.join(takes) if takes else 'no keyword arguments'}"
        ) from None


def require_weights(model: nn.Module, source: str) -> None:
    """A model whose tensors are on the meta device (or lazy) has no values to watch or export;
    one whose weights are float16 has FP16's own values (every command takes the FP32 model)."""
    from fp16lens._core.model_dtype import half_model
    from fp16lens._core.weights import missing_weights

    why = missing_weights(model) or half_model(model)
    if why is not None:
        raise Fp16LensError(f"{source}: {why}")
