#!/usr/bin/env bash
# The browser that tests/entrypoints/test_web.py drives: Chromium and its chromedriver from the
# system's packages (Debian: chromium, chromium-driver). Installed when missing and when apt-get
# can run (as root); otherwise the browser tests skip and say why. Never fails the leg itself.
set -uo pipefail
if command -v chromedriver >/dev/null 2>&1 && { command -v chromium >/dev/null 2>&1 \
        || command -v chromium-browser >/dev/null 2>&1; }; then
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "install_browser: not root or no apt-get: the browser tests will skip"
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
if apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium \
        chromium-driver >/dev/null; then
    echo "install_browser: $(chromium --version 2>/dev/null)"
else
    echo "install_browser: apt-get could not install chromium: the browser tests will skip"
fi
exit 0
