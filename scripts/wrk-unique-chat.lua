-- wrk script for scripts/memory.sh: POSTs /v1/chat/completions whose prompts are all different
-- (a shared system prompt, then a user message of about USER_BYTES bytes that starts with
-- the thread's number and a per-thread counter), and stops each thread after LIMIT answers.
--
--   wrk ... -s scripts/wrk-unique-chat.lua -- LIMIT [USER_BYTES] [MODEL]
--
-- Prints "MEMORY_JSON {...}" with requests, errors and duration at the end.

local counter = 0
local limit = 0
local user_bytes = 900
local model = "Qwen/Qwen3-8B"
local id = 0
local filler = string.rep("Large language model inference is dominated by the prefill of long prompts. ", 20)

local threads = {}
function setup(thread)
  thread:set("id", #threads)
  table.insert(threads, thread)
end

function init(args)
  limit = tonumber(args[1]) or 1000
  user_bytes = tonumber(args[2]) or user_bytes
  model = args[3] or model
  wrk.method = "POST"
  wrk.path = "/v1/chat/completions"
  wrk.headers["Content-Type"] = "application/json"
end

function request()
  counter = counter + 1
  local head = string.format("Request %d of thread %d. ", counter, id)
  local user = head .. string.sub(filler, 1, user_bytes - #head)
  local body = string.format(
    '{"model":"%s","max_tokens":1,"messages":[' ..
    '{"role":"system","content":"You are a helpful assistant. Answer briefly."},' ..
    '{"role":"user","content":"%s"}]}', model, user)
  return wrk.format(nil, nil, nil, body)
end

local answered = 0
function response(status, headers, body)
  answered = answered + 1
  if answered >= limit then
    wrk.thread:stop()
  end
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'MEMORY_JSON {"requests":%d,"duration_us":%d,"errors":{"connect":%d,"read":%d,' ..
    '"write":%d,"status":%d,"timeout":%d},"p50_us":%d}\n',
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50)))
end
