#!/usr/bin/env bash
# Router memory under unique prompts: RSS of `kvmesh serve` (default settings) while it routes
# N unique ~1 KB chat prompts, under `round_robin` (the reference), `precise` (reading the
# engines' KV events) and `cache_aware`, sampled from /proc/PID/status (VmRSS) once a second,
# with the router's own request count and prefix-index size from /metrics; and the router's
# CPU per request over the run (utime + stime from /proc/PID/stat, all threads).
#
#   scripts/memory.sh                         # 300,000 requests per policy, at most 900 s each
#   scripts/memory.sh --requests 20000        # a quick look
#   scripts/memory.sh --help
#
# All on 127.0.0.1: ENGINES `kvmesh sim --profile instant` (zero model time, KV events on),
# one `kvmesh serve --policy P` in front of them, and wrk (closed loop, CONNECTIONS
# connections) running scripts/wrk-unique-chat.lua, which stops after N answers in all (and
# wrk itself after --max-seconds). Writes samples.csv per policy and report.md to the output
# folder (default bench-results/memory-<UTC date-time>/, gitignored). Everything it starts is
# stopped on exit. Numbers are reported, never asserted.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LUA="$ROOT/scripts/wrk-unique-chat.lua"
MODEL="Qwen/Qwen3-8B"
REQUESTS=300000
MAX_SECONDS=900
ENGINES=2
CONNECTIONS=8
THREADS=2
USER_BYTES=900
POLICIES="round_robin precise cache_aware"
BIN=""
BUILD=1
OUT=""
PORT_BASE=18400

log() { printf '[memory] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }
usage() {
  cat <<USAGE
usage: scripts/memory.sh [flags]
  --requests N        unique prompts per policy (default $REQUESTS)
  --max-seconds S     bound on each policy's load, seconds (default $MAX_SECONDS)
  --engines N         simulated engines (default $ENGINES)
  --connections N     wrk connections (default $CONNECTIONS)
  --user-bytes N      bytes of each user message (default $USER_BYTES: ~1 KB bodies)
  --policies "A B"    policies, in order (default "$POLICIES")
  --bin PATH          use this kvmesh binary (no build)
  --no-build          use target/release/kvmesh as it is
  --port-base N       first port tried (default $PORT_BASE)
  --out DIR           output folder (default bench-results/memory-<UTC date-time>)
USAGE
}
ORIG_ARGS=("$@")
while [[ $# -gt 0 ]]; do
  case "$1" in
    --requests) REQUESTS="${2:?}"; shift ;;
    --max-seconds) MAX_SECONDS="${2:?}"; shift ;;
    --engines) ENGINES="${2:?}"; shift ;;
    --connections) CONNECTIONS="${2:?}"; shift ;;
    --user-bytes) USER_BYTES="${2:?}"; shift ;;
    --policies) POLICIES="${2:?}"; shift ;;
    --bin) BIN="${2:?}"; BUILD=0; shift ;;
    --no-build) BUILD=0 ;;
    --port-base) PORT_BASE="${2:?}"; shift ;;
    --out) OUT="${2:?}"; shift ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown flag $1 (see --help)" ;;
  esac
  shift
done
for v in REQUESTS MAX_SECONDS ENGINES CONNECTIONS USER_BYTES PORT_BASE; do
  [[ "${!v}" =~ ^[0-9]+$ ]] || die "${v,,} wants a whole number, got '${!v}'"
done
(( REQUESTS >= CONNECTIONS && MAX_SECONDS >= 1 && ENGINES >= 1 && CONNECTIONS >= THREADS )) \
  || die "need requests >= connections >= $THREADS, max-seconds >= 1, engines >= 1"
COMMAND="scripts/memory.sh"
for a in "${ORIG_ARGS[@]+"${ORIG_ARGS[@]}"}"; do COMMAND+=" $(printf '%q' "$a")"; done
command -v wrk >/dev/null || die "wrk is needed (apt-get install wrk)"
command -v curl >/dev/null || die "curl is needed"

if [[ -z "$BIN" ]]; then
  BIN="${CARGO_TARGET_DIR:-$ROOT/target}/release/kvmesh"
  if [[ $BUILD == 1 ]]; then
    log "cargo build --release -p kvmesh (may wait on the cargo lock)"
    (cd "$ROOT" && cargo build --release -p kvmesh) >&2
  fi
fi
[[ -x "$BIN" ]] || die "no kvmesh binary at $BIN"

STAMP="$(date -u +%Y%m%d-%H%M%S)"
[[ -n "$OUT" ]] || OUT="$ROOT/bench-results/memory-$STAMP"
mkdir -p "$OUT/logs"
OUT="$(cd "$OUT" && pwd)"
TMP="$(mktemp -d "${TMPDIR:-/tmp}/kvmesh-memory.XXXXXX")"
cp "$BIN" "$TMP/kvmesh"
BIN="$TMP/kvmesh"

PIDS=()
stop_all() {
  local pid
  for pid in "${PIDS[@]+"${PIDS[@]}"}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]+"${PIDS[@]}"}"; do
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  PIDS=()
}
cleanup() { local rc=$?; trap - EXIT; stop_all; rm -rf "$TMP"; exit "$rc"; }
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

port_busy() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
TAKEN=" "
pick_port() {
  local p=$PORT_BASE
  while (( p < PORT_BASE + 300 )); do
    if [[ "$TAKEN" != *" $p "* ]] && ! port_busy "$p"; then TAKEN+="$p "; echo "$p"; return; fi
    p=$((p + 1))
  done
  die "no free port in $PORT_BASE..$((PORT_BASE + 299))"
}
wait_http() { # wait_http NAME PID URL [GREP]: bounded wait until URL answers 200 (and matches)
  local name=$1 pid=$2 url=$3 pat=${4:-} body
  for _ in $(seq 300); do
    kill -0 "$pid" 2>/dev/null || die "$name exited during start-up (see $OUT/logs)"
    if body="$(curl -sf --max-time 2 "$url" 2>/dev/null)" && { [[ -z "$pat" ]] || grep -q "$pat" <<<"$body"; }; then
      return 0
    fi
    sleep 0.1
  done
  die "$name did not answer $url within 30 s"
}
rss_kb() { awk '/^VmRSS:/ {print $2}' "/proc/$1/status" 2>/dev/null || echo 0; }
metric() { # metric PAGE NAME: the sum of NAME's samples on the page
  awk -v n="$2" '$1 == n || index($1, n "{") == 1 {s += $NF} END {printf "%d", s}' <<<"$1"
}

REPORT="$OUT/report.md"
{
  echo "# Router memory, $STAMP"
  echo
  echo "\`$COMMAND\`"
  echo
  echo "Machine: $(nproc) cores ($(grep -m1 '^model name' /proc/cpuinfo | sed 's/^model name[[:space:]]*: //')), $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo), kernel $(uname -r); load before: $(cut -d' ' -f1-3 /proc/loadavg)."
  echo "$ENGINES \`kvmesh sim --profile instant\` engines, ~$((USER_BYTES + 200))-byte unique chat bodies, $CONNECTIONS connections; router with default settings."
  echo
} >"$REPORT"

for POLICY in $POLICIES; do
  log "policy $POLICY: $ENGINES engines, $REQUESTS unique prompts (at most $MAX_SECONDS s)"
  ENGINE_ARGS=()
  for (( e=0; e<ENGINES; e++ )); do
    sp="$(pick_port)"; TAKEN+="$sp "; ep="$(pick_port)"; TAKEN+="$ep "
    "$BIN" sim --listen "127.0.0.1:$sp" --profile instant --time-scale 1 --seed "$e" \
      --kv-events "tcp://127.0.0.1:$ep" >"$OUT/logs/sim-$POLICY-$e.log" 2>&1 &
    PIDS+=("$!")
    wait_http "sim $e" "$!" "http://127.0.0.1:$sp/health"
    if [[ $POLICY == precise || $POLICY == scored ]]; then
      ENGINE_ARGS+=(--engine "url=http://127.0.0.1:$sp,kv_events=tcp://127.0.0.1:$ep")
    else
      ENGINE_ARGS+=(--engine "http://127.0.0.1:$sp")
    fi
  done
  RP="$(pick_port)"; TAKEN+="$RP "
  "$BIN" serve --listen "127.0.0.1:$RP" "${ENGINE_ARGS[@]}" --policy "$POLICY" \
    >"$OUT/logs/kvmesh-$POLICY.log" 2>&1 &
  ROUTER=$!; PIDS+=("$ROUTER")
  wait_http kvmesh "$ROUTER" "http://127.0.0.1:$RP/v1/models" "$MODEL"
  CSV="$OUT/samples-$POLICY.csv"
  echo "seconds,requests,rss_kb,index_entries,index_memory_bytes" >"$CSV"
  per_thread=$(( (REQUESTS + THREADS - 1) / THREADS ))
  START=$(date +%s)
  # Each wrk thread stops after its share of answers; -d bounds the run in time.
  wrk -t"$THREADS" -c"$CONNECTIONS" -d"${MAX_SECONDS}s" --timeout 30s -s "$LUA" \
    "http://127.0.0.1:$RP" -- "$per_thread" "$USER_BYTES" "$MODEL" >"$OUT/wrk-$POLICY.txt" 2>&1 &
  WRK=$!
  while kill -0 "$WRK" 2>/dev/null; do
    page="$(curl -sf --max-time 2 "http://127.0.0.1:$RP/metrics" || true)"
    served="$(metric "$page" kvmesh_requests_total)"
    echo "$(( $(date +%s) - START )),$served,$(rss_kb "$ROUTER"),$(metric "$page" kvmesh_prefix_index_entries),$(metric "$page" kvmesh_prefix_index_memory_bytes)" >>"$CSV"
    # wrk's threads stop at their share, but wrk itself waits out -d: SIGINT ends it (it
    # still prints its summary) once every request has been answered.
    if (( served >= REQUESTS )); then kill -INT "$WRK" 2>/dev/null || true; fi
    sleep 1
  done
  wait "$WRK" || true
  CPU_TICKS="$(sed 's/.*) //' "/proc/$ROUTER/stat" | awk '{print $12 + $13}')"
  sleep 2   # let the last KV events land
  page="$(curl -sf --max-time 2 "http://127.0.0.1:$RP/metrics" || true)"
  echo "$(( $(date +%s) - START )),$(metric "$page" kvmesh_requests_total),$(rss_kb "$ROUTER"),$(metric "$page" kvmesh_prefix_index_entries),$(metric "$page" kvmesh_prefix_index_memory_bytes)" >>"$CSV"
  cp <(printf '%s\n' "$page") "$OUT/metrics-$POLICY.txt"
  log "$(grep MEMORY_JSON "$OUT/wrk-$POLICY.txt" || echo "wrk: no summary, see $OUT/wrk-$POLICY.txt")"
  python3 - "$CSV" "$POLICY" "$REQUESTS" "$CPU_TICKS" "$(getconf CLK_TCK)" >>"$REPORT" <<'PY'
import csv, sys
path, policy, total = sys.argv[1], sys.argv[2], int(sys.argv[3])
cpu_s = int(sys.argv[4]) / int(sys.argv[5])
rows = [r for r in csv.DictReader(open(path)) if int(r["rss_kb"]) > 0]
print(f"## {policy}\n")
print("| requests served | RSS MB | index entries | index MB |")
print("|---|---|---|---|")
marks = [0] + [total * k // 10 for k in range(1, 11)]
shown = set()
for m in marks:
    r = next((r for r in rows if int(r["requests"]) >= m), None)
    if r is None or r["seconds"] in shown:
        continue
    shown.add(r["seconds"])
    print(f"| {int(r['requests']):,} | {int(r['rss_kb'])/1024:.1f} | {int(r['index_entries']):,} | {int(r['index_memory_bytes'])/1e6:.1f} |")
peak = max(rows, key=lambda r: int(r["rss_kb"]))
last = rows[-1]
half = [r for r in rows if int(r["requests"]) >= int(last["requests"]) // 2]
print(f"\nPeak RSS {int(peak['rss_kb'])/1024:.1f} MB (at {int(peak['requests']):,} requests); "
      f"final {int(last['rss_kb'])/1024:.1f} MB after {int(last['requests']):,} requests "
      f"in {last['seconds']} s; over the second half RSS ranged "
      f"{min(int(r['rss_kb']) for r in half)/1024:.1f}–{max(int(r['rss_kb']) for r in half)/1024:.1f} MB. "
      f"Router CPU: {cpu_s:.1f} s, {cpu_s * 1e6 / max(1, int(last['requests'])):.1f} µs per request.\n")
PY
  stop_all
done
cat "$REPORT"
log "report: $REPORT"
