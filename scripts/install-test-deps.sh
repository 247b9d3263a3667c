#!/usr/bin/env bash
# Installs what the test suite needs beyond the Rust toolchain: the Python packages of the
# interop tests (official openai client, pyzmq, msgpack, tokenizers, jinja2) and Debian's
# headless Chromium for the status page test (crates/kvmesh/tests/status_page.rs).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --quiet --disable-pip-version-check -r tests/python/requirements.txt
python3 -c "import openai, zmq, msgpack, msgspec, tokenizers, jinja2" \
  || { echo "install-test-deps: Python packages missing after install" >&2; exit 1; }
if ! command -v chromium >/dev/null 2>&1; then
  sudo=""
  if [ "$(id -u)" != 0 ]; then sudo="sudo"; fi
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq chromium >/dev/null
fi
chromium --version >/dev/null 2>&1 \
  || { echo "install-test-deps: chromium missing after install" >&2; exit 1; }
# The chaos suite (scripts/test.sh runs it in quick mode): iproute2 (network namespaces, veth,
# bridge), nftables (partitions and packet loss inside the routers' namespaces), iptables
# (iptables-nft: the NFQUEUE rules of the delay step — the kernel has no nftables `queue`
# statement nor netem) and libfaketime (the clock-skew scenario). Needs root.
FAKETIME_SO=/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1
if ! command -v ip >/dev/null || ! command -v nft >/dev/null || ! command -v iptables >/dev/null \
  || [ ! -e "$FAKETIME_SO" ]; then
  if command -v apt-get >/dev/null; then
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq iproute2 nftables iptables libfaketime >/dev/null
  fi
fi
command -v ip >/dev/null && command -v nft >/dev/null && command -v iptables >/dev/null \
  && [ -e "$FAKETIME_SO" ] \
  || { echo "install-test-deps: iproute2, nftables, iptables and libfaketime are needed by the chaos suite" >&2; exit 1; }
