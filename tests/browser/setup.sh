#!/usr/bin/env bash
# Installs what the browser test (tests/e2e/test_browser.py) needs; safe to run again (it only adds what is missing):
#   - Debian's chromium and chromium-driver (the browser the test drives; never a downloaded browser build)
#   - node and npm, if missing, and the JS client's npm dependencies (clients/js: npm ci, from the lock file)
# When something cannot be installed it says so and exits 0: the browser test then skips with the reason.
set -uo pipefail
cd "$(dirname "$0")/../.."

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then sudo -n "$@"; else
    echo "browser setup: not root and no passwordless sudo: cannot run $*" >&2; return 1; fi
}

apt_install() {
  command -v apt-get >/dev/null || { echo "browser setup: no apt-get: cannot install $*" >&2; return 1; }
  if [ -z "${_APT_UPDATED:-}" ]; then as_root apt-get update -q >/dev/null && _APT_UPDATED=1 || return 1; fi
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$@" >/dev/null
}

if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then
  echo "browser setup: installing chromium and chromium-driver (Debian packages)"
  apt_install chromium chromium-driver || echo "browser setup: chromium could not be installed" >&2
fi
if ! command -v npm >/dev/null; then
  echo "browser setup: installing nodejs and npm (Debian packages)"
  apt_install nodejs npm || echo "browser setup: npm could not be installed" >&2
fi
if command -v npm >/dev/null; then
  # node_modules/.lock-sha256 records the lock file it was installed from: install again only when it changed
  want=$(sha256sum clients/js/package-lock.json | cut -d' ' -f1)
  if [ "$(cat clients/js/node_modules/.lock-sha256 2>/dev/null)" != "$want" ]; then
    # --ignore-scripts: cbor-x's optional native addon is not needed (the pure JS path is used)
    (cd clients/js && npm ci --no-audit --no-fund --ignore-scripts --loglevel=error \
      && echo "$want" > node_modules/.lock-sha256) || echo "browser setup: npm ci failed in clients/js" >&2
  fi
fi
exit 0
