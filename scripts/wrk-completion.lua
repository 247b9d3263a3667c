-- wrk script for scripts/overhead.sh: POSTs one small OpenAI completion request, over and over,
-- on each connection (keep-alive), and prints a machine-readable summary at the end.
--
--   WRK_BODY   the JSON body (default: a one-token non-streaming completion)
--   WRK_PATH   the request path (default: /v1/completions)
--
-- The summary line starts with "OVERHEAD_JSON " and holds requests, duration (µs), bytes,
-- errors (connect, read, write, status >= 400, timeout) and latency percentiles (µs).

wrk.method = "POST"
wrk.path = os.getenv("WRK_PATH") or "/v1/completions"
wrk.body = os.getenv("WRK_BODY")
    or '{"model":"Qwen/Qwen3-8B","prompt":"hi","max_tokens":1}'
wrk.headers["Content-Type"] = "application/json"

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'OVERHEAD_JSON {"requests":%d,"duration_us":%d,"bytes":%d,' ..
    '"errors":{"connect":%d,"read":%d,"write":%d,"status":%d,"timeout":%d},' ..
    '"latency_us":{"min":%d,"mean":%.1f,"max":%d,"stdev":%.1f,' ..
    '"p50":%d,"p90":%d,"p99":%d,"p999":%d}}\n',
    summary.requests, summary.duration, summary.bytes,
    e.connect, e.read, e.write, e.status, e.timeout,
    latency.min, latency.mean, latency.max, latency.stdev,
    latency:percentile(50), latency:percentile(90),
    latency:percentile(99), latency:percentile(99.9)))
end
