#!/usr/bin/env bash
# Router overhead: requests/s, added p50/p99 latency, CPU and write calls per request of
# `kvmesh serve` (round_robin over HTTP/1.1 and over HTTP/2 to the engine, and precise
# cache-aware routing) against the engine directly,
# nginx `proxy_pass` and SGLang's gateway `smg` (when installed) in front of the same engine.
#
#   scripts/overhead.sh              # quick: 3 rounds x 10 s per target and variant (~6 min + build)
#   scripts/overhead.sh --full       # 5 rounds x 30 s (~26 min + build)
#   scripts/overhead.sh --help       # every flag
#
# What it does, all on 127.0.0.1:
#   1. installs wrk and nginx (nginx-light, else nginx) from Debian's packages when missing;
#   2. builds `kvmesh` in release (cargo build --release -p kvmesh) unless --bin/--no-build;
#   3. starts one `kvmesh sim --profile instant --time-scale 1 --kv-events ...` (zero model
#      time: what is measured is HTTP overhead), and in front of it: `kvmesh serve --policy
#      round_robin` ("kvmesh"), the same with `--upstream-http2` (h2c to the sim, which serves
#      HTTP/1.1 and h2c on one port: "kvmesh-h2"), `kvmesh serve --policy precise` reading the
#      sim's KV events ("kvmesh-precise"), nginx (generated config in a temp dir, upstream keepalive,
#      unbuffered) and, when the `smg` command is found (pip install smg; or --smg PATH),
#      `smg launch --policy round_robin` ("smg");
#   4. for each round, for each variant (non-streaming, streaming), runs the same closed-loop wrk
#      load (fixed connections, threads, duration; scripts/wrk-completion.lua POSTs a tiny
#      /v1/completions with a text prompt) against every target, in an order rotated every round;
#   5. writes report.md, report.json, the raw wrk outputs, logs and both /metrics snapshots to
#      the output folder (default bench-results/overhead-<UTC date-time>/, gitignored).
# Everything it starts is stopped on exit. Numbers are reported, never asserted.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LUA="$ROOT/scripts/wrk-completion.lua"
MODEL="Qwen/Qwen3-8B"

MODE=quick
DURATION=10
ROUNDS=3
CONNECTIONS=16
THREADS=2
WARMUP=3
STREAM=1
STREAM_MAX_TOKENS=16
BUILD=1
BIN=""
OUT=""
PORT_BASE=18100
POLICY=round_robin
PRECISE=1
H2=1
SMG=""
SMG_WANTED=auto
DURATION_SET=0
ROUNDS_SET=0

usage() {
  cat <<EOF
usage: scripts/overhead.sh [flags]
  --quick                 ${ROUNDS} rounds x ${DURATION} s per target and variant (default)
  --full                  5 rounds x 30 s per target and variant
  --duration S            seconds of load per target, variant and round
  --rounds N              rounds (targets interleaved, order rotated each round)
  --connections N         wrk connections (default ${CONNECTIONS})
  --threads N             wrk threads (default ${THREADS})
  --warmup S              unmeasured load per target before round 1 (default ${WARMUP})
  --no-stream             skip the streaming variant
  --stream-max-tokens N   max_tokens of the streaming variant (default ${STREAM_MAX_TOKENS})
  --policy NAME           routing policy of the "kvmesh" target (default ${POLICY})
  --no-precise            skip the "kvmesh-precise" target (kvmesh serve --policy precise)
  --no-h2                 skip the "kvmesh-h2" target (kvmesh serve --upstream-http2)
  --smg PATH              SGLang's gateway command for the "smg" target (default: smg on PATH)
  --no-smg                skip the "smg" target even when smg is installed
  --bin PATH              use this kvmesh binary (no build)
  --no-build              use target/release/kvmesh as it is
  --port-base N           first port tried for sim, nginx, kvmesh (default ${PORT_BASE})
  --out DIR               output folder (default bench-results/overhead-<UTC date-time>)
EOF
}

die() { echo "overhead.sh: $*" >&2; exit 1; }
log() { echo "[overhead $(date -u +%H:%M:%S)] $*" >&2; }

ORIG_ARGS=("$@")
while [[ $# -gt 0 ]]; do
  case "$1" in
    --quick) MODE=quick ;;
    --full) MODE=full ;;
    --duration) DURATION="${2:?}"; DURATION_SET=1; shift ;;
    --rounds) ROUNDS="${2:?}"; ROUNDS_SET=1; shift ;;
    --connections) CONNECTIONS="${2:?}"; shift ;;
    --threads) THREADS="${2:?}"; shift ;;
    --warmup) WARMUP="${2:?}"; shift ;;
    --no-stream) STREAM=0 ;;
    --stream-max-tokens) STREAM_MAX_TOKENS="${2:?}"; shift ;;
    --policy) POLICY="${2:?}"; shift ;;
    --no-precise) PRECISE=0 ;;
    --no-h2) H2=0 ;;
    --smg) SMG="${2:?}"; SMG_WANTED=yes; shift ;;
    --no-smg) SMG_WANTED=no ;;
    --bin) BIN="${2:?}"; BUILD=0; shift ;;
    --no-build) BUILD=0 ;;
    --port-base) PORT_BASE="${2:?}"; shift ;;
    --out) OUT="${2:?}"; shift ;;
    -h|--help) usage; exit 0 ;;
    *) usage >&2; die "unknown flag: $1" ;;
  esac
  shift
done
if [[ "$MODE" == full ]]; then
  [[ $DURATION_SET == 1 ]] || DURATION=30
  [[ $ROUNDS_SET == 1 ]] || ROUNDS=5
fi
for v in DURATION ROUNDS CONNECTIONS THREADS WARMUP STREAM_MAX_TOKENS PORT_BASE; do
  [[ "${!v}" =~ ^[0-9]+$ ]] || die "--$(tr 'A-Z_' 'a-z-' <<<"$v") wants a whole number, got '${!v}'"
done
(( DURATION >= 1 && ROUNDS >= 1 && THREADS >= 1 && CONNECTIONS >= THREADS )) \
  || die "need duration >= 1, rounds >= 1, threads >= 1, connections >= threads"

COMMAND="scripts/overhead.sh"
for a in "${ORIG_ARGS[@]+"${ORIG_ARGS[@]}"}"; do COMMAND+=" $(printf '%q' "$a")"; done

# ---------------------------------------------------------------- tools (Debian packages)
as_root() {
  if [[ $EUID -eq 0 ]]; then "$@"
  elif command -v sudo >/dev/null; then sudo "$@"
  else die "need root (or sudo) to install: $*"; fi
}
APT_UPDATED=0
apt_install() { # apt_install PKG... (first that installs wins is up to the caller)
  if [[ $APT_UPDATED == 0 ]]; then
    log "apt-get update"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
    APT_UPDATED=1
  fi
  log "apt-get install -y $*"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >&2
}
find_nginx() {
  command -v nginx 2>/dev/null || { [[ -x /usr/sbin/nginx ]] && echo /usr/sbin/nginx; } || true
}

command -v curl >/dev/null || apt_install curl
command -v python3 >/dev/null || die "python3 is needed to aggregate the results (see README requirements)"
command -v wrk >/dev/null || apt_install wrk
command -v wrk >/dev/null || die "wrk is not installable here"
NGINX="$(find_nginx)"
if [[ -z "$NGINX" ]]; then
  # Debian's postinst may start the packaged nginx service (port 80) where policy-rc.d allows
  # it; this script never uses that one, only its own instance below.
  apt_install nginx-light || apt_install nginx
  NGINX="$(find_nginx)"
fi
[[ -n "$NGINX" ]] || die "nginx is not installable here"
case "$SMG_WANTED" in
  auto) SMG="$(command -v smg 2>/dev/null || true)" ;;
  yes) [[ -x "$SMG" ]] || SMG="$(command -v "$SMG" 2>/dev/null || true)"
       [[ -n "$SMG" ]] || die "--smg: no such command" ;;
  no) SMG="" ;;
esac

# ---------------------------------------------------------------- kvmesh binary
if [[ -z "$BIN" ]]; then
  BIN="${CARGO_TARGET_DIR:-$ROOT/target}/release/kvmesh"
  if [[ $BUILD == 1 ]]; then
    log "cargo build --release -p kvmesh (may wait on the cargo lock)"
    (cd "$ROOT" && cargo build --release -p kvmesh) >&2
  fi
fi
[[ -x "$BIN" ]] || die "no kvmesh binary at $BIN"

# ---------------------------------------------------------------- output folder, temp dir
STAMP="$(date -u +%Y%m%d-%H%M%S)"
[[ -n "$OUT" ]] || OUT="$ROOT/bench-results/overhead-$STAMP"
mkdir -p "$OUT/raw" "$OUT/logs"
OUT="$(cd "$OUT" && pwd)"
TMP="$(mktemp -d "${TMPDIR:-/tmp}/kvmesh-overhead.XXXXXX")"
chmod 755 "$TMP"   # nginx workers (nobody when started as root) read it

PIDS=()
WRK_PID=""
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  local i pid
  [[ -z "$WRK_PID" ]] || kill -TERM "$WRK_PID" 2>/dev/null || true
  for (( i=${#PIDS[@]}-1; i>=0; i-- )); do
    pid="${PIDS[$i]}"
    kill -TERM "$pid" 2>/dev/null || true
  done
  for pid in "${PIDS[@]+"${PIDS[@]}"}"; do
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then
      log "pid $pid still running after 5 s: SIGKILL"
      kill -KILL "$pid" 2>/dev/null || true
    fi
    wait "$pid" 2>/dev/null || true
  done
  rm -rf "$TMP"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# Run a private copy: a concurrent rebuild of target/ cannot swap the binary mid-run.
cp "$BIN" "$TMP/kvmesh"
BIN_SRC="$BIN"
BIN="$TMP/kvmesh"

# ---------------------------------------------------------------- ports
port_busy() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
TAKEN=" "
pick_port() {
  local p=$PORT_BASE
  while (( p < PORT_BASE + 200 )); do
    if [[ "$TAKEN" != *" $p "* ]] && ! port_busy "$p"; then TAKEN+="$p "; echo "$p"; return; fi
    p=$((p + 1))
  done
  die "no free port in $PORT_BASE..$((PORT_BASE + 199))"
}
SIM_PORT="$(pick_port)"; TAKEN+="$SIM_PORT "
NGINX_PORT="$(pick_port)"; TAKEN+="$NGINX_PORT "
KVMESH_PORT="$(pick_port)"; TAKEN+="$KVMESH_PORT "
EVENTS_PORT="$(pick_port)"; TAKEN+="$EVENTS_PORT "
PRECISE_PORT="$(pick_port)"; TAKEN+="$PRECISE_PORT "
SMG_PORT="$(pick_port)"; TAKEN+="$SMG_PORT "
H2_PORT="$(pick_port)"; TAKEN+="$H2_PORT "
SMG_PROM_PORT="$(pick_port)"; TAKEN+="$SMG_PROM_PORT "

wait_http() { # wait_http NAME PID URL [GREP]: bounded wait until URL answers 200 (and matches)
  local name=$1 pid=$2 url=$3 pat=${4:-} body
  for _ in $(seq 300); do
    kill -0 "$pid" 2>/dev/null || die "$name exited during start-up (see $OUT/logs)"
    if body="$(curl -sf --max-time 2 "$url" 2>/dev/null)" && { [[ -z "$pat" ]] || grep -q "$pat" <<<"$body"; }; then
      return 0
    fi
    sleep 0.1
  done
  die "$name did not answer $url within 30 s (see $OUT/logs)"
}

# ---------------------------------------------------------------- start the servers
log "kvmesh sim on 127.0.0.1:$SIM_PORT (profile instant, KV events on tcp://127.0.0.1:$EVENTS_PORT)"
"$BIN" sim --listen "127.0.0.1:$SIM_PORT" --profile instant --time-scale 1 \
  --kv-events "tcp://127.0.0.1:$EVENTS_PORT" >"$OUT/logs/sim.log" 2>&1 &
SIM_PID=$!; PIDS+=("$SIM_PID")
wait_http sim "$SIM_PID" "http://127.0.0.1:$SIM_PORT/health"

log "kvmesh serve on 127.0.0.1:$KVMESH_PORT (policy $POLICY)"
"$BIN" serve --listen "127.0.0.1:$KVMESH_PORT" --engine "http://127.0.0.1:$SIM_PORT" \
  --policy "$POLICY" >"$OUT/logs/kvmesh.log" 2>&1 &
KVMESH_PID=$!; PIDS+=("$KVMESH_PID")
wait_http kvmesh "$KVMESH_PID" "http://127.0.0.1:$KVMESH_PORT/v1/models" "$MODEL"

PRECISE_PID=""
if [[ $PRECISE == 1 ]]; then
  log "kvmesh serve on 127.0.0.1:$PRECISE_PORT (policy precise, reading the sim's KV events)"
  "$BIN" serve --listen "127.0.0.1:$PRECISE_PORT" \
    --engine "url=http://127.0.0.1:$SIM_PORT,kv_events=tcp://127.0.0.1:$EVENTS_PORT" \
    --policy precise >"$OUT/logs/kvmesh-precise.log" 2>&1 &
  PRECISE_PID=$!; PIDS+=("$PRECISE_PID")
  wait_http kvmesh-precise "$PRECISE_PID" "http://127.0.0.1:$PRECISE_PORT/v1/models" "$MODEL"
fi

H2_PID=""
if [[ $H2 == 1 ]]; then
  log "kvmesh serve on 127.0.0.1:$H2_PORT (policy $POLICY, HTTP/2 to the engine)"
  "$BIN" serve --listen "127.0.0.1:$H2_PORT" --engine "http://127.0.0.1:$SIM_PORT" \
    --policy "$POLICY" --upstream-http2 >"$OUT/logs/kvmesh-h2.log" 2>&1 &
  H2_PID=$!; PIDS+=("$H2_PID")
  wait_http kvmesh-h2 "$H2_PID" "http://127.0.0.1:$H2_PORT/v1/models" "$MODEL"
fi

SMG_PID=""
if [[ -n "$SMG" ]]; then
  log "smg on 127.0.0.1:$SMG_PORT ($("$SMG" --version 2>/dev/null | head -1 || echo smg), policy round_robin)"
  "$SMG" launch --host 127.0.0.1 --port "$SMG_PORT" --prometheus-host 127.0.0.1 \
    --prometheus-port "$SMG_PROM_PORT" --worker-urls "http://127.0.0.1:$SIM_PORT" \
    --policy round_robin --log-level warn >"$OUT/logs/smg.log" 2>&1 &
  SMG_PID=$!; PIDS+=("$SMG_PID")
  wait_http smg "$SMG_PID" "http://127.0.0.1:$SMG_PORT/v1/models" "$MODEL"
fi

NGINX_USER=""
if [[ $EUID -eq 0 ]]; then
  NGINX_USER="user nobody $(getent group nogroup >/dev/null && echo nogroup || echo nobody);"
fi
TEMP_PATHS=""
NGINX_BUILD="$("$NGINX" -V 2>&1 || true)"
for t in client_body proxy fastcgi uwsgi scgi; do
  if [[ $t == client_body || $t == proxy || "$NGINX_BUILD" != *"--without-http_${t}_module"* ]]; then
    TEMP_PATHS+="  ${t}_temp_path $TMP/${t}_temp;"$'\n'
  fi
done
cat >"$TMP/nginx.conf" <<EOF
# Generated by scripts/overhead.sh: nginx as a plain reverse proxy in front of the same sim.
$NGINX_USER
daemon off;
worker_processes auto;
pid $TMP/nginx.pid;
error_log $OUT/logs/nginx-error.log warn;
events { worker_connections 4096; }
http {
  access_log off;
$TEMP_PATHS
  keepalive_timeout 75s;
  keepalive_requests 1000000;
  upstream engine {
    server 127.0.0.1:$SIM_PORT;
    keepalive 256;
    keepalive_requests 1000000;
    keepalive_timeout 60s;
  }
  server {
    listen 127.0.0.1:$NGINX_PORT;
    location / {
      proxy_pass http://engine;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_request_buffering off;
      proxy_read_timeout 300s;
    }
  }
}
EOF
cp "$TMP/nginx.conf" "$OUT/nginx.conf"
"$NGINX" -t -q -p "$TMP/" -e "$OUT/logs/nginx-error.log" -c "$TMP/nginx.conf" \
  2>"$OUT/logs/nginx-test.log" || die "nginx rejected the generated config: $(cat "$OUT/logs/nginx-test.log")"
log "nginx on 127.0.0.1:$NGINX_PORT ($("$NGINX" -v 2>&1 | sed 's/.*: //'))"
"$NGINX" -p "$TMP/" -e "$OUT/logs/nginx-error.log" -c "$TMP/nginx.conf" >"$OUT/logs/nginx-stdout.log" 2>&1 &
NGINX_PID=$!; PIDS+=("$NGINX_PID")
wait_http nginx "$NGINX_PID" "http://127.0.0.1:$NGINX_PORT/v1/models" "$MODEL"

declare -A URL=(
  [direct]="http://127.0.0.1:$SIM_PORT"
  [nginx]="http://127.0.0.1:$NGINX_PORT"
  [kvmesh]="http://127.0.0.1:$KVMESH_PORT"
  [kvmesh-h2]="http://127.0.0.1:$H2_PORT"
  [kvmesh-precise]="http://127.0.0.1:$PRECISE_PORT"
  [smg]="http://127.0.0.1:$SMG_PORT"
)
declare -A PROXY_PID=([direct]="" [nginx]="$NGINX_PID" [kvmesh]="$KVMESH_PID"
  [kvmesh-h2]="$H2_PID" [kvmesh-precise]="$PRECISE_PID" [smg]="$SMG_PID")
TARGETS=(direct nginx kvmesh)
[[ -z "$H2_PID" ]] || TARGETS+=(kvmesh-h2)
[[ -z "$PRECISE_PID" ]] || TARGETS+=(kvmesh-precise)
[[ -z "$SMG_PID" ]] || TARGETS+=(smg)

declare -A BODY=(
  [completion]="{\"model\":\"$MODEL\",\"prompt\":\"hi\",\"max_tokens\":1}"
  [stream]="{\"model\":\"$MODEL\",\"prompt\":\"hi\",\"max_tokens\":$STREAM_MAX_TOKENS,\"stream\":true}"
)
VARIANTS=(completion)
[[ $STREAM == 1 ]] && VARIANTS+=(stream)
body_of() { echo "${BODY[$1]}"; }

# ---------------------------------------------------------------- sanity: one request each
for v in "${VARIANTS[@]}"; do
  for t in "${TARGETS[@]}"; do
    resp="$(curl -s --max-time 10 -D "$TMP/h" -H 'content-type: application/json' \
      -d "$(body_of "$v")" "${URL[$t]}/v1/completions")" || die "$t: request failed"
    head -1 "$TMP/h" | grep -q ' 200' || die "$t ($v): $(head -1 "$TMP/h") $resp"
    if [[ $v == stream ]]; then
      grep -q 'data: \[DONE\]' <<<"$resp" || die "$t ($v): no [DONE] in the stream: $resp"
    else
      grep -q '"choices"' <<<"$resp" || die "$t ($v): no choices: $resp"
    fi
    if [[ $t == kvmesh* ]]; then
      grep -qi '^x-kvmesh-engine:' "$TMP/h" || die "$t ($v): no x-kvmesh-engine header"
    fi
  done
done

# ---------------------------------------------------------------- load
cpu_ticks() { # cpu_ticks PID: utime+stime of the process (all threads) and its children processes
  local pid=$1 total=0 p
  [[ -n "$pid" ]] || { echo 0; return; }
  for p in "$pid" $(ps -o pid= --ppid "$pid" 2>/dev/null); do
    if [[ -r /proc/$p/stat ]]; then
      total=$(( total + $(sed 's/.*) //' "/proc/$p/stat" | awk '{print $12 + $13}') ))
    fi
  done
  echo "$total"
}
write_calls() { # write_calls PID: write/writev syscalls (/proc/PID/io syscw) of it and its children
  local pid=$1 total=0 p n
  [[ -n "$pid" ]] || { echo null; return; }
  for p in "$pid" $(ps -o pid= --ppid "$pid" 2>/dev/null); do
    n="$(awk '/^syscw:/ {print $2}' "/proc/$p/io" 2>/dev/null)" || { echo null; return; }
    [[ -n "$n" ]] || { echo null; return; }
    total=$(( total + n ))
  done
  echo "$total"
}
CLK_TCK="$(getconf CLK_TCK)"

RUNS="$OUT/runs.jsonl"
: >"$RUNS"
run_wrk() { # run_wrk TARGET VARIANT DURATION OUTFILE
  local t=$1 v=$2 d=$3 f=$4
  # In the background + wait, so that a signal to this script is handled at once.
  WRK_BODY="$(body_of "$v")" WRK_PATH=/v1/completions \
    timeout --kill-after=5 $(( d + 30 )) \
    wrk -t "$THREADS" -c "$CONNECTIONS" -d "${d}s" --timeout 10s --latency -s "$LUA" \
    "${URL[$t]}" >"$f" 2>&1 &
  WRK_PID=$!
  wait "$WRK_PID" || die "wrk failed against $t ($v): $(tail -3 "$f")"
  WRK_PID=""
}

n_runs=$(( ROUNDS * ${#VARIANTS[@]} * ${#TARGETS[@]} ))
log "load: $ROUNDS rounds x ${#VARIANTS[@]} variants x ${#TARGETS[@]} targets x ${DURATION}s = ${n_runs} runs, ~$(( (n_runs * DURATION + ${#VARIANTS[@]} * ${#TARGETS[@]} * WARMUP) / 60 + 1 )) min"
LOAD_BEFORE="$(cut -d' ' -f1-3 /proc/loadavg)"
if (( WARMUP > 0 )); then
  for v in "${VARIANTS[@]}"; do
    for t in "${TARGETS[@]}"; do run_wrk "$t" "$v" "$WARMUP" "$OUT/raw/warmup-$v-$t.txt"; done
  done
fi
for (( r=1; r<=ROUNDS; r++ )); do
  for v in "${VARIANTS[@]}"; do
    for (( k=0; k<${#TARGETS[@]}; k++ )); do
      t="${TARGETS[$(( (k + r - 1) % ${#TARGETS[@]} ))]}"
      f="$OUT/raw/$v-$t-r$r.txt"
      sim0=$(cpu_ticks "$SIM_PID"); px0=$(cpu_ticks "${PROXY_PID[$t]}")
      wc0=$(write_calls "${PROXY_PID[$t]}")
      run_wrk "$t" "$v" "$DURATION" "$f"
      sim1=$(cpu_ticks "$SIM_PID"); px1=$(cpu_ticks "${PROXY_PID[$t]}")
      wc1=$(write_calls "${PROXY_PID[$t]}")
      wcalls=null
      [[ $wc0 == null || $wc1 == null ]] || wcalls=$(( wc1 - wc0 ))
      line="$(grep '^OVERHEAD_JSON ' "$f" | sed 's/^OVERHEAD_JSON //')" \
        || die "no summary in $f"
      non2xx="$(sed -n 's/.*Non-2xx or 3xx responses: *\([0-9]*\).*/\1/p' "$f")"
      printf '{"round":%d,"variant":"%s","target":"%s","non2xx":%d,"proxy_write_calls":%s,"sim_cpu_s":%s,"proxy_cpu_s":%s,"wrk":%s}\n' \
        "$r" "$v" "$t" "${non2xx:-0}" "$wcalls" \
        "$(awk -v a="$sim0" -v b="$sim1" -v h="$CLK_TCK" 'BEGIN{printf "%.2f", (b-a)/h}')" \
        "$(awk -v a="$px0" -v b="$px1" -v h="$CLK_TCK" 'BEGIN{printf "%.2f", (b-a)/h}')" \
        "$line" >>"$RUNS"
      log "round $r $v $t: $(python3 -c 'import json,sys; d=json.loads(sys.argv[1]); print("%.0f req/s, p50 %d us, p99 %d us, errors %d" % (d["requests"]*1e6/d["duration_us"], d["latency_us"]["p50"], d["latency_us"]["p99"], sum(d["errors"].values())))' "$line")"
    done
  done
done
LOAD_AFTER="$(cut -d' ' -f1-3 /proc/loadavg)"

curl -sf --max-time 5 "${URL[kvmesh]}/metrics" >"$OUT/kvmesh-metrics.txt" || true
curl -sf --max-time 5 "${URL[direct]}/metrics" >"$OUT/sim-metrics.txt" || true
H2_REQUESTS="$(awk '/^kvmesh_sim_http2_requests_total/ {print $2}' "$OUT/sim-metrics.txt" 2>/dev/null)"
H2_REQUESTS="${H2_REQUESTS:-0}"
if [[ -n "$H2_PID" && "$H2_REQUESTS" == 0 ]]; then
  die "kvmesh-h2: the sim received no request over HTTP/2"
fi
for t in "${TARGETS[@]}"; do
  [[ -z "${PROXY_PID[$t]}" ]] || kill -0 "${PROXY_PID[$t]}" 2>/dev/null || die "$t died during the load"
done
kill -0 "$SIM_PID" 2>/dev/null || die "the sim died during the load"

# ---------------------------------------------------------------- report
SMG_VERSION=""
[[ -z "$SMG" ]] || SMG_VERSION="$( ("$SMG" --version 2>&1 || true) | head -1)"
TARGET_LIST="${TARGETS[*]}"
export OUT COMMAND MODE DURATION ROUNDS CONNECTIONS THREADS WARMUP STREAM_MAX_TOKENS POLICY \
  LOAD_BEFORE LOAD_AFTER BIN_SRC MODEL SMG_VERSION TARGET_LIST H2_REQUESTS
COMMIT="$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)"
DIRTY="$(git -C "$ROOT" status --porcelain --untracked-files=no 2>/dev/null | wc -l | tr -d ' ')" || DIRTY=0
NPROC="$(nproc)"
CPU_MODEL="$(grep -m1 '^model name' /proc/cpuinfo | sed 's/^model name[[:space:]]*: //')" || CPU_MODEL=unknown
KERNEL="$(uname -r)"
MEM="$(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo)"
WRK_VERSION="$( (wrk -v 2>&1 || true) | head -1 | awk '{print $1, $2}')"
NGINX_VERSION="$( ("$NGINX" -v 2>&1 || true) | sed 's/.*: //')"
RUSTC="$(rustc --version 2>/dev/null || echo unknown)"
DATE_UTC="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
export COMMIT DIRTY NPROC CPU_MODEL KERNEL MEM WRK_VERSION NGINX_VERSION RUSTC DATE_UTC

python3 - <<'PY'
import json, os, re, statistics

E = os.environ
out = E["OUT"]
runs = [json.loads(l) for l in open(os.path.join(out, "runs.jsonl")) if l.strip()]
targets = E["TARGET_LIST"].split()
variants = [v for v in ["completion", "stream"] if any(r["variant"] == v for r in runs)]

def rps(r): return r["wrk"]["requests"] * 1e6 / r["wrk"]["duration_us"]
def p(r, q): return r["wrk"]["latency_us"][q]
def errs(r): return sum(r["wrk"]["errors"].values()) + r["non2xx"]
def mmm(xs):
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs)} if xs else None

result = {}
for v in variants:
    rv = [r for r in runs if r["variant"] == v]
    by = {t: sorted((r for r in rv if r["target"] == t), key=lambda r: r["round"]) for t in targets}
    direct = {r["round"]: r for r in by["direct"]}
    res = {}
    for t in targets:
        rs = by[t]
        row = {
            "runs": len(rs),
            "requests_per_s": mmm([rps(r) for r in rs]),
            "p50_us": mmm([p(r, "p50") for r in rs]),
            "p99_us": mmm([p(r, "p99") for r in rs]),
            "errors": sum(errs(r) for r in rs),
            "requests": sum(r["wrk"]["requests"] for r in rs),
            "sim_cpu_us_per_request": mmm([r["sim_cpu_s"] * 1e6 / r["wrk"]["requests"] for r in rs]),
        }
        if t != "direct":
            paired = [(r, direct[r["round"]]) for r in rs if r["round"] in direct]
            row["added_p50_us"] = mmm([p(a, "p50") - p(b, "p50") for a, b in paired])
            row["added_p99_us"] = mmm([p(a, "p99") - p(b, "p99") for a, b in paired])
            row["rps_vs_direct"] = mmm([rps(a) / rps(b) for a, b in paired])
            row["proxy_cpu_us_per_request"] = mmm(
                [r["proxy_cpu_s"] * 1e6 / r["wrk"]["requests"] for r in rs])
            row["proxy_write_calls_per_request"] = mmm(
                [r["proxy_write_calls"] / r["wrk"]["requests"] for r in rs
                 if r.get("proxy_write_calls") is not None])
        res[t] = row
    result[v] = res

# A few router-side counters from its /metrics after the run.
router = {}
try:
    text = open(os.path.join(out, "kvmesh-metrics.txt")).read()
    def val(name):
        m = re.search(r"^" + re.escape(name) + r"(?:\{[^}]*\})? (\S+)$", text, re.M)
        return float(m.group(1)) if m else None
    router = {
        "kvmesh_requests_total": val("kvmesh_requests_total"),
        "kvmesh_retries_total": val("kvmesh_retries_total"),
        "kvmesh_error_responses_total": sum(float(x) for x in re.findall(
            r"^kvmesh_error_responses_total\{[^}]*\} (\S+)$", text, re.M)),
        "kvmesh_routing_decision_seconds_sum": val("kvmesh_routing_decision_seconds_sum"),
        "kvmesh_routing_decision_seconds_count": val("kvmesh_routing_decision_seconds_count"),
    }
except OSError:
    pass

machine = {"nproc": int(E["NPROC"]), "cpu_model": E["CPU_MODEL"], "kernel": E["KERNEL"],
           "memory": E["MEM"], "loadavg_before": E["LOAD_BEFORE"], "loadavg_after": E["LOAD_AFTER"]}
setup = {"mode": E["MODE"], "duration_s": int(E["DURATION"]), "rounds": int(E["ROUNDS"]),
         "connections": int(E["CONNECTIONS"]), "threads": int(E["THREADS"]),
         "warmup_s": int(E["WARMUP"]), "policy": E["POLICY"], "model": E["MODEL"],
         "stream_max_tokens": int(E["STREAM_MAX_TOKENS"]),
         "wrk": E["WRK_VERSION"], "nginx": E["NGINX_VERSION"], "rustc": E["RUSTC"]}
report = {"date_utc": E["DATE_UTC"], "commit": E["COMMIT"],
          "uncommitted_tracked_changes": int(E["DIRTY"]), "command": E["COMMAND"],
          "machine": machine, "setup": setup, "results": result, "router_metrics": router,
          "runs": runs}
json.dump(report, open(os.path.join(out, "report.json"), "w"), indent=2)

def f0(x): return f"{x:,.0f}"
def rng(m, f=f0, signed=False):
    if m is None: return "–"
    g = (lambda x: ("+" if x >= 0 else "") + f(x)) if signed else f
    return f"{g(m['median'])} ({g(m['min'])} – {g(m['max'])})"

L = []
L.append(f"# Router overhead — {E['DATE_UTC']}")
L.append("")
L.append(f"- command: `{E['COMMAND']}`")
dirty = f" (+{E['DIRTY']} uncommitted tracked changes)" if E["DIRTY"] != "0" else ""
L.append(f"- commit: `{E['COMMIT']}`{dirty}")
L.append(f"- machine: {E['NPROC']} cores, {E['CPU_MODEL']}, {E['MEM']}, kernel {E['KERNEL']}; "
         f"load average before/after: {E['LOAD_BEFORE']} / {E['LOAD_AFTER']}")
L.append(f"- load: wrk ({E['WRK_VERSION']}) {E['THREADS']} threads, {E['CONNECTIONS']} connections, "
         f"{E['DURATION']} s per run, {E['ROUNDS']} rounds, targets interleaved (order rotated each "
         f"round), {E['WARMUP']} s warm-up per target; closed loop, keep-alive")
smg = f"; smg: `{E['SMG_VERSION'] or 'smg'} launch --policy round_robin`" if "smg" in targets else ""
precise = ("; kvmesh-precise: `kvmesh serve --policy precise` reading the sim's KV events"
           if "kvmesh-precise" in targets else "")
if "kvmesh-h2" in targets:
    precise = (f"; kvmesh-h2: `kvmesh serve --policy {E['POLICY']} --upstream-http2` (h2c to the "
               f"sim: {int(float(E['H2_REQUESTS'])):,} requests reached it over HTTP/2)") + precise
L.append(f"- engine: `kvmesh sim --profile instant --time-scale 1 --kv-events ...` (zero model time); "
         f"kvmesh: `kvmesh serve --policy {E['POLICY']}`{precise}; nginx {E['NGINX_VERSION']} `proxy_pass` "
         f"(upstream keepalive, `proxy_buffering off`, config in nginx.conf){smg}; all on 127.0.0.1, "
         f"sharing the cores with the load generator")
L.append("")
L.append("Cells: median (min – max) over rounds. \"added\" = target minus direct in the same round. "
         "Proxy CPU = the proxy's CPU time during the run (all threads and child processes; nginx master and workers) "
         "/ requests; proxy writes = its write/writev system calls (/proc/PID/io syscw) / requests.")
titles = {"completion": f"Non-streaming `/v1/completions`, `max_tokens` 1",
          "stream": f"Streaming `/v1/completions` (`\"stream\": true`), `max_tokens` {E['STREAM_MAX_TOKENS']}"}
for v in variants:
    L.append("")
    L.append(f"## {titles[v]}")
    L.append("")
    L.append("| target | req/s | vs direct | p50 µs | p99 µs | added p50 µs | added p99 µs | proxy CPU µs/req | proxy writes/req | errors |")
    L.append("|---|---|---|---|---|---|---|---|---|---|")
    for t in targets:
        row = result[v][t]
        L.append("| " + " | ".join([
            t,
            rng(row["requests_per_s"]),
            rng(row.get("rps_vs_direct"), lambda x: f"{x:.2f}×") if t != "direct" else "1",
            rng(row["p50_us"]),
            rng(row["p99_us"]),
            rng(row.get("added_p50_us"), signed=True) if t != "direct" else "–",
            rng(row.get("added_p99_us"), signed=True) if t != "direct" else "–",
            rng(row.get("proxy_cpu_us_per_request"), lambda x: f"{x:.0f}") if t != "direct" else "–",
            rng(row.get("proxy_write_calls_per_request"), lambda x: f"{x:.1f}") if t != "direct" else "–",
            f"{row['errors']} / {row['requests']:,}",
        ]) + " |")
if router:
    L.append("")
    n = router.get("kvmesh_routing_decision_seconds_count") or 0
    s = router.get("kvmesh_routing_decision_seconds_sum") or 0
    mean = f"{s / n * 1e6:.2f} µs" if n else "–"
    L.append(f"Router counters after the run (warm-up and checks included): "
             f"{router.get('kvmesh_requests_total') or 0:,.0f} requests, "
             f"{router.get('kvmesh_retries_total') or 0:,.0f} retries, "
             f"{router.get('kvmesh_error_responses_total') or 0:,.0f} error answers, "
             f"mean routing decision {mean}.")
L.append("")
L.append("## Runs")
L.append("")
L.append("| round | variant | target | req/s | p50 µs | p99 µs | max µs | errors | proxy CPU s | sim CPU s |")
L.append("|---|---|---|---|---|---|---|---|---|---|")
for r in runs:
    L.append(f"| {r['round']} | {r['variant']} | {r['target']} | {rps(r):,.0f} | {p(r, 'p50'):,} | "
             f"{p(r, 'p99'):,} | {r['wrk']['latency_us']['max']:,} | {errs(r)} | "
             f"{r['proxy_cpu_s'] if r['target'] != 'direct' else '–'} | {r['sim_cpu_s']} |")
open(os.path.join(out, "report.md"), "w").write("\n".join(L) + "\n")
PY

log "report: $OUT/report.md (and report.json, raw/, logs/)"
cat "$OUT/report.md"
