#!/usr/bin/env bash
# The whole test suite: every crate's unit, property and integration tests, including the
# interop tests that drive the simulator with Python's official openai client and pyzmq.
# Run scripts/install-test-deps.sh once first (CI does).
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR="${CARGO_TERM_COLOR:-never}"
cargo build --locked --workspace --bins
cargo test --locked --workspace -- --test-threads="${KVMESH_TEST_THREADS:-2}"
# The chaos suite in quick mode (chaos/README.md): real routers and engines in network
# namespaces, partitions, loss, delay, kills, gray engines; fails when an invariant breaks. Root
# (namespaces, nftables, iptables for delay) is required; logs and reports in target/chaos/.
target/debug/kvmesh chaos run --quick chaos/*.toml
