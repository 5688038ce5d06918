#!/usr/bin/env bash
# The operator page's tests drive the system's headless Chromium through chromedriver
# (Debian packages `chromium` and `chromium-driver`). Quick when both are present.
set -euo pipefail
if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install Chromium and its chromedriver at /usr/bin/chromium and /usr/bin/chromedriver" >&2
    echo "(the browser tests of the operator page need them)" >&2
    exit 1
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq chromium chromium-driver >/dev/null
