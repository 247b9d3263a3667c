#!/usr/bin/env bash
# Installs what the test suite needs beyond the Rust toolchain: the Python packages of the
# interop tests (official openai client, pyzmq, msgpack, tokenizers, jinja2).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --quiet --disable-pip-version-check -r tests/python/requirements.txt
python3 -c "import openai, zmq, msgpack, msgspec, tokenizers, jinja2" \
  || { echo "install-test-deps: Python packages missing after install" >&2; exit 1; }
