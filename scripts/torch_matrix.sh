#!/usr/bin/env bash
# The torch matrix: the focused part of the suite (watch, report, patch, the torch verify
# backends, the demo journey) on torch releases other than the pinned one in .venv.
#
#   bash scripts/torch_matrix.sh                 # every release below
#   FP16LENS_TORCH_MATRIX="2.4.1" bash scripts/torch_matrix.sh   # just one
#   bash scripts/torch_matrix.sh -k bn_eps       # extra arguments go to pytest
#   bash scripts/torch_matrix.sh --install-only  # only make the environments ready
#   FP16LENS_MATRIX_JOBS=1 bash scripts/torch_matrix.sh  # one release after another
#
# The test command (scripts/bootstrap.sh test) starts --install-only at once and runs the
# matrix, one lane (FP16LENS_MATRIX_JOBS=1), beside the main suite once the INT8 search
# tests are done: the downloads are network-bound, and the main suite keeps about one of
# the two cores busy, so the matrix adds little to the CI's time even with nothing cached.
#
# Each release gets its own virtual environment, cached between runs and clones under
# ${FP16LENS_CACHE:-$HOME/.cache/fp16lens}/torch-X.Y.Z and reinstalled only when
# setup.cfg, pyproject.toml or this script change. PyPI's builds of these releases are
# CUDA builds (~5 GB with the NVIDIA libraries); they run on the CPU. torchvision 0.N+15
# goes with torch 2.N; where no such release exists the tests that need it skip.
# fp16lens itself is not installed there: the checkout runs from PYTHONPATH.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
releases="${FP16LENS_TORCH_MATRIX:-2.4.1 2.11.0 2.15.0}"
# The floor (torch>=2.4, numpy unpinned in setup.cfg) runs on NumPy 1.x as well, with what
# pip resolves beside it (onnx's ml_dtypes, the newest that still takes numpy 1): users of
# an older torch often have it, and NumPy 2 changed copy and promotion rules.
numpy1_releases="2.4.1"
cache="${FP16LENS_CACHE:-$HOME/.cache/fp16lens}"
PY="${PYTHON:-python3}"

# The focused part: what depends on torch internals (dispatch modes, meta tensors, fx,
# batch-norm kernels, the ONNX exporters the demo uses).
tests=(
  tests/watch
  # the report's rendering is plain data, built by hand in most report tests: only the
  # ones that run torch go on other releases
  tests/report/test_report_fp16.py
  tests/report/test_report_view.py
  tests/patch
  tests/verify/test_verify_emulation.py
  tests/verify/test_verify_parity.py
  # ONNX runners against torch references: outputs of data-dependent length are padded in
  # torch (F.pad), integer outputs included
  tests/verify/test_verify_onnx.py
  tests/verify/test_verify_onnx_in.py
  tests/cli/test_cli_demo.py
  tests/cli/test_demo_model.py
  # batch files: torch.load's weights-only unpickler (NumPy arrays allowed for one load)
  tests/cli/test_cli_inputs.py
  # the INT8 weight grid, its Q/DQ and cache (numpy's rounding, integer casts): seconds
  tests/export/test_int8_exact.py
  tests/export/test_int8_grid.py
  tests/export/test_int8_qdq.py
  # its real-FP16 ground truth needs FP16 nms: torchvision's own CPU kernel has none (the
  # main suite's CPU torch runs it with the plain-PyTorch nms of tests/torchvision_compat)
  --ignore=tests/watch/test_watch_detector.py
)

# Runtime requirements and the onnx and plot extras from setup.cfg, torch left out
# (pinned per release), plus the test runner's own packages.
requirements() {
  "$PY" - <<'EOF'
import configparser
cfg = configparser.ConfigParser()
cfg.read("setup.cfg")
opt, extras = cfg["options"], cfg["options.extras_require"]
wanted = opt["install_requires"].split() + extras["onnx"].split() + extras["plot"].split()
wanted += [r for r in extras["test"].split() if r.split(">")[0] in ("pytest", "hypothesis")]
print("\n".join(r for r in wanted if not r.startswith("torch")))
EOF
}

install() {  # $1 = release, $2 = environment
  local v=$1 env=$2 minor
  minor=$(echo "$v" | cut -d. -f2)
  [ -x "$env/bin/python" ] || "$PY" -m venv "$env"  # kept: pip skips what is there
  printf 'torch==%s\n' "$v" > "$env/constraints.txt"
  case " $numpy1_releases " in *" $v "*) printf 'numpy<2\n' >> "$env/constraints.txt" ;; esac
  # Our constraints replace any pip-wide ones (a machine may cap torch below this release).
  export PIP_CONSTRAINT="$env/constraints.txt"
  "$env/bin/python" -m pip install --quiet --upgrade pip
  "$env/bin/python" -m pip install --quiet "torch==$v"
  "$env/bin/python" -m pip install --quiet "torchvision==0.$((minor + 15)).*" \
    || echo "torch $v: no torchvision 0.$((minor + 15)) to install; tests that need it skip"
  # shellcheck disable=SC2046
  "$env/bin/python" -m pip install --quiet $(requirements)
  unset PIP_CONSTRAINT
}

key="$(cat setup.cfg pyproject.toml "$0" | sha256sum | cut -d' ' -f1)"
ready() {  # $1 = release: its environment installed for this key (installed now if not)
  local v=$1 env="$cache/torch-$1"
  if [ ! -f "$env/fp16lens-matrix.stamp" ] || [ "$(cat "$env/fp16lens-matrix.stamp")" != "$key" ]; then
    echo "== torch $v: installing into $env"
    install "$v" "$env"
    echo "$key" > "$env/fp16lens-matrix.stamp"
  fi
}
if [ "${1-}" = --install-only ]; then
  for v in $releases; do ready "$v"; done
  exit 0
fi
# Releases run side by side, one torch thread each: these tests are bound by Python, not
# by torch's kernels (one release took 64 s with one thread, 68 s with two), so two lanes
# on a 2-core machine take about half the time of one after another.
jobs="${FP16LENS_MATRIX_JOBS:-$(nproc 2>/dev/null || echo 1)}"
logs="$cache/matrix-logs"
mkdir -p "$logs"
run_release() {  # $1 = release: its tests, output to its log, its summary line to .result
  local v=$1 env="$cache/torch-$1" t0 t1 result
  t0=$SECONDS
  ready "$v"
  t1=$SECONDS
  echo "== torch $v: $("$env/bin/python" -c 'import numpy, torch; print(torch.__version__, "numpy", numpy.__version__)')"
  case " $numpy1_releases " in *" $v "*)
    if ! "$env/bin/python" -c 'import numpy, sys; sys.exit(not numpy.__version__.startswith("1."))'; then
      echo "torch $v: FAILED (numpy 1.x expected, pip installed another)" > "$logs/$v.result"
      return
    fi ;;
  esac
  # slow tests (real Inductor compiles, property sweeps, timm models) run in the main
  # suite only: three releases of them would take CI past its budget
  if PYTHONPATH="$repo" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" \
    MKL_NUM_THREADS="${MKL_NUM_THREADS:-1}" \
    "$env/bin/python" -m pytest -q -m "not slow" "${tests[@]}" "${@:2}"; then
    result=passed
  else
    result=FAILED
  fi
  echo "torch $v: $result (install $((t1 - t0)) s, tests $((SECONDS - t1)) s)" > "$logs/$v.result"
}
running=0
for v in $releases; do
  rm -f "$logs/$v.result"
  if [ "$jobs" -le 1 ]; then
    run_release "$v" "$@" 2>&1 | tee "$logs/$v.log"
    continue
  fi
  if [ "$running" -ge "$jobs" ]; then
    wait -n || true
    running=$((running - 1))
  fi
  run_release "$v" "$@" > "$logs/$v.log" 2>&1 &
  running=$((running + 1))
done
wait || true
failed=()
summary=()
for v in $releases; do
  [ "$jobs" -le 1 ] || cat "$logs/$v.log"
  line=$(cat "$logs/$v.result" 2>/dev/null || echo "torch $v: FAILED (no result)")
  summary+=("$line")
  case "$line" in *FAILED*) failed+=("$v") ;; esac
done
printf '%s\n' "== torch matrix" "${summary[@]}"
[ ${#failed[@]} -eq 0 ] || { echo "torch matrix failed on: ${failed[*]}" >&2; exit 1; }
