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
