#!/usr/bin/env bash
# Headless Chromium for tests/report/test_report_html.py (the HTML report in a real browser).
# Installs Debian's `chromium` when no chromium/chromium-browser/google-chrome is on PATH and
# apt-get is usable (root, or sudo without a password); otherwise prints one line and returns
# 0, and the browser tests skip with their reason. On a cold machine the install (Chromium
# 156 and about 120 packages it pulls in) took 30 s on this project's machine (apt's own log,
# 2026-11-25), plus an `apt-get update` when the package lists are missing or stale; with
# Chromium on PATH this returns at once.
set -uo pipefail

for exe in chromium chromium-browser google-chrome; do
  command -v "$exe" >/dev/null 2>&1 && exit 0
done
if ! command -v apt-get >/dev/null 2>&1; then
  echo "Chromium not installed (no apt-get): the browser tests of the HTML report will skip"
  exit 0
fi
if [ "$(id -u)" -eq 0 ]; then
  as_root=()
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
  as_root=(sudo -n)
else
  echo "Chromium not installed (apt-get needs root or sudo): the browser tests of the HTML report will skip"
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
started=$SECONDS
# an install from the lists already there, else after apt-get update
if ! "${as_root[@]}" apt-get install -y -qq chromium >/dev/null 2>&1; then
  "${as_root[@]}" apt-get update -qq >/dev/null 2>&1
  if ! "${as_root[@]}" apt-get install -y -qq chromium >/dev/null 2>&1; then
    echo "Chromium could not be installed (apt-get install -y chromium failed): the browser tests of the HTML report will skip"
    exit 0
  fi
fi
echo "installed Chromium (Debian's chromium) in $((SECONDS - started)) s, for the HTML report's browser test"
