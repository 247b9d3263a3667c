//! The OpenAI endpoints: parse and validate, render + tokenize, apply faults, admit into the
//! engine, and answer in one piece or as server-sent events.

use crate::engine_thread::{Command, ReqEvent};
use crate::http::{Body, json, read_body};
use crate::state::AppState;
use bytes::Bytes;
use futures::StreamExt;
use http::{Request, Response, header};
use http_body_util::{BodyExt, StreamBody};
use hyper::body::{Frame, Incoming};
use kvmesh_engine::RequestSpec;
use kvmesh_openai::{
    ApiError, ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk,
    ChatCompletionRequest, ChatDelta, ChatMessage, Completion, CompletionChoice, CompletionRequest,
    PromptInput, SSE_DONE, Usage, parse_body, sse_json,
};
use kvmesh_tokenize::ChatRenderRequest;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};

/// Which endpoint a request came through (shapes the answer).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Chat,
    Completion,
}

/// A validated, tokenized request ready for the engine.
struct Prepared {
    kind: Kind,
    prompt: Vec<u32>,
    max_tokens: u32,
    stream: bool,
    include_usage: bool,
    cache_salt: Option<String>,
    /// The LoRA adapter the request names, if any.
    lora: Option<String>,
    /// Completions with `echo`: the prompt text to prepend.
    echo: Option<String>,
}

/// Checks the requested model: the base model (or none), or one of its LoRA adapters, whose
/// name is returned.
fn check_model(st: &AppState, model: Option<&str>) -> Result<Option<String>, ApiError> {
    match model {
        Some(m) if m == st.cfg.model => Ok(None),
        Some(m) if st.cfg.lora_modules.iter().any(|l| l == m) => Ok(Some(m.to_string())),
        Some(m) => Err(ApiError::model_not_found(m)),
        None => Ok(None),
    }
}

/// Resolves the completion length and checks the context window, as vLLM does.
fn resolve_max_tokens(
    st: &AppState,
    prompt_len: usize,
    requested: Option<u32>,
) -> Result<u32, ApiError> {
    let max_len = st.cfg.max_model_len as usize;
    if prompt_len >= max_len {
        return Err(ApiError::bad_request(
            "context_length_exceeded",
            format!(
                "This model's maximum context length is {max_len} tokens. However, your \
                 prompt has {prompt_len} tokens. Please reduce the length of the prompt."
            ),
        ));
    }
    let room = (max_len - prompt_len) as u32;
    match requested {
        None => Ok(st.cfg.default_max_tokens.min(room)),
        Some(n) if n > room => Err(ApiError::bad_request(
            "context_length_exceeded",
            format!(
                "This model's maximum context length is {max_len} tokens. However, you \
                 requested {} tokens ({prompt_len} in the messages, {n} in the completion). \
                 Please reduce the length of the messages or completion.",
                prompt_len as u64 + n as u64
            ),
        )),
        Some(n) => Ok(n),
    }
}

/// The simulator samples from no distribution: a request asking for log probabilities gets
/// a clear error rather than an answer without them.
fn no_logprobs(wanted: bool) -> Result<(), ApiError> {
    if wanted {
        return Err(ApiError::invalid_param(
            "logprobs",
            "logprobs are not produced by kvmesh sim (a simulated engine samples from no distribution): leave logprobs and top_logprobs unset.",
        ));
    }
    Ok(())
}

/// `POST /v1/chat/completions`.
pub async fn chat(st: &Arc<AppState>, req: Request<Incoming>) -> Result<Response<Body>, ApiError> {
    let body = read_body(req, st.cfg.max_body_bytes).await?;
    let r: ChatCompletionRequest = parse_body(&body)?;
    r.validate()?;
    no_logprobs(r.wants_logprobs())?;
    let lora = check_model(st, r.model.as_deref())?;
    let template = st.tokenizer.chat_template().ok_or_else(|| {
        ApiError::bad_request(
            "no_chat_template",
            "the tokenizer has no chat template: use /v1/completions",
        )
    })?;
    let text = template
        .render(&ChatRenderRequest {
            messages: &r.messages,
            tools: r.tools.as_deref(),
            add_generation_prompt: r.add_generation_prompt.unwrap_or(true),
            continue_final_message: r.continue_final_message,
            template_kwargs: r.chat_template_kwargs.as_ref(),
        })
        .map_err(|e| ApiError::bad_request("chat_template_error", e.to_string()))?;
    let prompt = st
        .tokenizer
        .encode(&text, false)
        .map_err(|e| ApiError::bad_request("tokenization_error", e.to_string()))?;
    let max_tokens = resolve_max_tokens(st, prompt.len(), r.max_tokens()?)?;
    run(
        st,
        Prepared {
            kind: Kind::Chat,
            prompt,
            max_tokens,
            stream: r.stream,
            include_usage: r.include_usage(),
            cache_salt: r.cache_salt,
            lora,
            echo: None,
        },
    )
    .await
}

/// `POST /v1/completions`.
pub async fn completions(
    st: &Arc<AppState>,
    req: Request<Incoming>,
) -> Result<Response<Body>, ApiError> {
    let body = read_body(req, st.cfg.max_body_bytes).await?;
    let r: CompletionRequest = parse_body(&body)?;
    r.validate()?;
    no_logprobs(r.wants_logprobs())?;
    let lora = check_model(st, r.model.as_deref())?;
    let inputs = r.prompt.inputs();
    if inputs.len() != 1 {
        return Err(ApiError::invalid_param(
            "prompt",
            format!(
                "batched prompts ({} prompts) are not supported by the simulator: send one \
                 prompt per request",
                inputs.len()
            ),
        ));
    }
    let (prompt, echo_text) = match inputs[0] {
        PromptInput::Text(t) => (
            st.tokenizer
                .encode(t, true)
                .map_err(|e| ApiError::bad_request("tokenization_error", e.to_string()))?,
            t.to_string(),
        ),
        PromptInput::Tokens(ids) => {
            let vocab = st.tokenizer.vocab_size();
            if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
                return Err(ApiError::invalid_param(
                    "prompt",
                    format!("Token id {bad} is out of vocabulary (size {vocab})."),
                ));
            }
            let text = if r.echo {
                st.tokenizer.decode(ids, false).unwrap_or_default()
            } else {
                String::new()
            };
            (ids.to_vec(), text)
        }
    };
    let max_tokens = resolve_max_tokens(
        st,
        prompt.len(),
        kvmesh_openai::check_max_tokens("max_tokens", r.max_tokens)?,
    )?;
    run(
        st,
        Prepared {
            kind: Kind::Completion,
            prompt,
            max_tokens,
            stream: r.stream,
            include_usage: r.include_usage(),
            cache_salt: r.cache_salt,
            lora,
            echo: r.echo.then_some(echo_text),
        },
    )
    .await
}

/// Aborts the engine request when dropped before the request finished (client went away).
struct AbortGuard {
    st: Arc<AppState>,
    id: u64,
    done: bool,
}

impl Drop for AbortGuard {
    fn drop(&mut self) {
        if !self.done {
            self.st.engine.send(Command::Abort(self.id));
        }
    }
}

async fn run(st: &Arc<AppState>, p: Prepared) -> Result<Response<Body>, ApiError> {
    let (latency_ms, injected) = st.request_faults();
    if latency_ms > 0 {
        tokio::time::sleep(Duration::from_millis(latency_ms)).await;
    }
    if let Some(status) = injected {
        st.metrics.injected_error();
        return Err(ApiError::with_status(
            status,
            format!("injected fault: status {status}"),
        ));
    }
    let id = st.next_request_id();
    let prompt_len = p.prompt.len() as u32;
    let (tx, rx) = mpsc::unbounded_channel();
    let (atx, arx) = oneshot::channel();
    let spec = RequestSpec {
        id,
        prompt: p.prompt,
        max_tokens: p.max_tokens,
        lora_name: p.lora.clone(),
        cache_salt: p.cache_salt,
    };
    let sent = st.engine.send(Command::Add {
        spec,
        sent_at: Instant::now(),
        events: tx,
        admitted: atx,
    });
    if !sent {
        return Err(ApiError::unavailable("the engine is not running"));
    }
    match arx.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => {
            return Err(ApiError::bad_request("invalid_request", e.to_string()));
        }
        Err(_) => return Err(ApiError::unavailable("the engine is not running")),
    }
    let guard = AbortGuard {
        st: st.clone(),
        id,
        done: false,
    };
    let ctx = Ctx {
        rid: format!(
            "{}-{id:016x}{:08x}",
            if p.kind == Kind::Chat {
                "chatcmpl"
            } else {
                "cmpl"
            },
            st.cfg.seed as u32
        ),
        created: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        model: p.lora.clone().unwrap_or_else(|| st.cfg.model.clone()),
        kind: p.kind,
        prompt_len,
    };
    if p.stream {
        Ok(stream_response(st, ctx, rx, guard, p.include_usage, p.echo))
    } else {
        whole_response(st, ctx, rx, guard, p.echo).await
    }
}

struct Ctx {
    rid: String,
    created: u64,
    model: String,
    kind: Kind,
    prompt_len: u32,
}

async fn whole_response(
    st: &AppState,
    ctx: Ctx,
    mut rx: mpsc::UnboundedReceiver<ReqEvent>,
    mut guard: AbortGuard,
    echo: Option<String>,
) -> Result<Response<Body>, ApiError> {
    let mut ids = Vec::new();
    let finished = loop {
        match rx.recv().await {
            Some(ReqEvent::Token { token }) => ids.push(token),
            Some(ReqEvent::Done(f)) => break f,
            Some(ReqEvent::Failed(m)) => {
                guard.done = true;
                return Err(ApiError::internal(m));
            }
            None => {
                guard.done = true;
                return Err(ApiError::internal("the engine dropped the request"));
            }
        }
    };
    guard.done = true;
    let mut text = st
        .tokenizer
        .decode(&ids, true)
        .map_err(|e| ApiError::internal(e.to_string()))?;
    if let Some(e) = echo {
        text.insert_str(0, &e);
    }
    let usage = Usage::new(ctx.prompt_len, ids.len() as u32, finished.cached_tokens);
    let body = match ctx.kind {
        Kind::Chat => serde_json::to_string(&ChatCompletion {
            id: &ctx.rid,
            object: "chat.completion",
            created: ctx.created,
            model: &ctx.model,
            choices: vec![ChatChoice {
                index: 0,
                message: ChatMessage {
                    role: "assistant",
                    content: &text,
                },
                finish_reason: "length",
                logprobs: None,
            }],
            usage,
        }),
        Kind::Completion => serde_json::to_string(&Completion {
            id: &ctx.rid,
            object: "text_completion",
            created: ctx.created,
            model: &ctx.model,
            choices: vec![CompletionChoice {
                index: 0,
                text: &text,
                finish_reason: Some("length"),
                logprobs: None,
            }],
            usage: Some(usage),
        }),
    }
    .map_err(|e| ApiError::internal(e.to_string()))?;
    Ok(json(200, body))
}

/// One SSE event for a text delta (or the final, empty, finish chunk).
fn chunk(ctx: &Ctx, delta: &str, first: bool, finish: Option<&'static str>) -> String {
    match ctx.kind {
        Kind::Chat => sse_json(&ChatCompletionChunk {
            id: &ctx.rid,
            object: "chat.completion.chunk",
            created: ctx.created,
            model: &ctx.model,
            choices: vec![ChatChunkChoice {
                index: 0,
                delta: ChatDelta {
                    role: first.then_some("assistant"),
                    content: (first || !delta.is_empty()).then_some(delta),
                },
                finish_reason: finish,
                logprobs: None,
            }],
            usage: None,
        }),
        Kind::Completion => sse_json(&Completion {
            id: &ctx.rid,
            object: "text_completion",
            created: ctx.created,
            model: &ctx.model,
            choices: vec![CompletionChoice {
                index: 0,
                text: delta,
                finish_reason: finish,
                logprobs: None,
            }],
            usage: None,
        }),
    }
}

fn usage_chunk(ctx: &Ctx, usage: Usage) -> String {
    match ctx.kind {
        Kind::Chat => sse_json(&ChatCompletionChunk {
            id: &ctx.rid,
            object: "chat.completion.chunk",
            created: ctx.created,
            model: &ctx.model,
            choices: vec![],
            usage: Some(usage),
        }),
        Kind::Completion => sse_json(&Completion {
            id: &ctx.rid,
            object: "text_completion",
            created: ctx.created,
            model: &ctx.model,
            choices: vec![],
            usage: Some(usage),
        }),
    }
}

struct StreamState {
    ctx: Ctx,
    rx: mpsc::UnboundedReceiver<ReqEvent>,
    guard: AbortGuard,
    decoder: kvmesh_tokenize::StreamDecoder,
    include_usage: bool,
    first: bool,
    tokens: u32,
    pending_echo: Option<String>,
    /// The engine's event read before the opening chunk was sent: handled next.
    held: Option<ReqEvent>,
    finished: bool,
}

fn stream_response(
    st: &Arc<AppState>,
    ctx: Ctx,
    rx: mpsc::UnboundedReceiver<ReqEvent>,
    guard: AbortGuard,
    include_usage: bool,
    echo: Option<String>,
) -> Response<Body> {
    let state = StreamState {
        ctx,
        rx,
        guard,
        decoder: st.tokenizer.stream_decoder(true),
        include_usage,
        first: true,
        tokens: 0,
        pending_echo: echo,
        held: None,
        finished: false,
    };
    // Each engine event becomes one SSE frame, sent as soon as it exists (no buffering).
    let frames = futures::stream::unfold(state, |mut s| async move {
        if s.finished {
            return None;
        }
        let out = loop {
            let event = match s.held.take() {
                Some(e) => Some(e),
                None => s.rx.recv().await,
            };
            // Chat streams open with the role, completions with echo with the prompt, once
            // the engine's first output exists (vLLM sends them in the first iteration over
            // its outputs): the first byte comes at the first token, and an engine that
            // never steps sends nothing but the head.
            if s.first && s.ctx.kind == Kind::Chat {
                s.first = false;
                s.held = event;
                break chunk(&s.ctx, "", true, None);
            }
            if let Some(e) = s.pending_echo.take() {
                s.held = event;
                break chunk(&s.ctx, &e, false, None);
            }
            match event {
                Some(ReqEvent::Token { token }) => {
                    s.tokens += 1;
                    match s.decoder.push(token) {
                        Ok(Some(delta)) if !delta.is_empty() => {
                            break chunk(&s.ctx, &delta, false, None);
                        }
                        _ => continue,
                    }
                }
                Some(ReqEvent::Done(f)) => {
                    s.guard.done = true;
                    s.finished = true;
                    // Text the decoder held back (an incomplete character) goes out with the
                    // final chunk.
                    let rest = s.decoder.finish().ok().flatten().unwrap_or_default();
                    let mut out = chunk(&s.ctx, &rest, false, Some("length"));
                    if s.include_usage {
                        let u = Usage::new(s.ctx.prompt_len, s.tokens, f.cached_tokens);
                        out.push_str(&usage_chunk(&s.ctx, u));
                    }
                    out.push_str(SSE_DONE);
                    break out;
                }
                // An error event, then the terminator, as vLLM's stream generators end on
                // an exception (serving_chat.py: `yield f"data: {data}\n\n"` then
                // `yield "data: [DONE]\n\n"`).
                Some(ReqEvent::Failed(m)) => {
                    s.guard.done = true;
                    s.finished = true;
                    break ApiError::internal(m).to_sse() + SSE_DONE;
                }
                None => {
                    s.guard.done = true;
                    s.finished = true;
                    break ApiError::internal("the engine dropped the request").to_sse() + SSE_DONE;
                }
            }
        };
        Some((Ok::<_, Infallible>(Frame::data(Bytes::from(out))), s))
    });
    let mut r = Response::new(
        StreamBody::new(frames.boxed())
            .map_err(|e: Infallible| match e {})
            .boxed_unsync(),
    );
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    h.insert(
        header::CACHE_CONTROL,
        header::HeaderValue::from_static("no-cache"),
    );
    r
}

/// `POST /tokenize` (vLLM's): `{"prompt": "..."}` or `{"messages": [...]}` →
/// `{"count", "max_model_len", "tokens"}`.
pub async fn tokenize(
    st: &Arc<AppState>,
    req: Request<Incoming>,
) -> Result<Response<Body>, ApiError> {
    #[derive(serde::Deserialize)]
    struct Tok {
        model: Option<String>,
        prompt: Option<String>,
        messages: Option<Vec<serde_json::Value>>,
        #[serde(default = "yes")]
        add_special_tokens: bool,
        #[serde(default = "yes")]
        add_generation_prompt: bool,
        chat_template_kwargs: Option<serde_json::Map<String, serde_json::Value>>,
    }
    fn yes() -> bool {
        true
    }
    let body = read_body(req, st.cfg.max_body_bytes).await?;
    let t: Tok = parse_body(&body)?;
    check_model(st, t.model.as_deref())?;
    let tokens = match (t.prompt, t.messages) {
        (Some(p), None) => st.tokenizer.encode(&p, t.add_special_tokens),
        (None, Some(m)) => {
            let tpl = st.tokenizer.chat_template().ok_or_else(|| {
                ApiError::bad_request("no_chat_template", "the tokenizer has no chat template")
            })?;
            let text = tpl
                .render(&ChatRenderRequest {
                    messages: &m,
                    tools: None,
                    add_generation_prompt: t.add_generation_prompt,
                    continue_final_message: false,
                    template_kwargs: t.chat_template_kwargs.as_ref(),
                })
                .map_err(|e| ApiError::bad_request("chat_template_error", e.to_string()))?;
            st.tokenizer.encode(&text, false)
        }
        _ => {
            return Err(ApiError::bad_request(
                "invalid_request",
                "give exactly one of `prompt` or `messages`",
            ));
        }
    }
    .map_err(|e| ApiError::bad_request("tokenization_error", e.to_string()))?;
    let v = serde_json::json!({
        "count": tokens.len(),
        "max_model_len": st.cfg.max_model_len,
        "tokens": tokens,
    });
    Ok(json(200, v.to_string()))
}

/// `POST /detokenize`: `{"tokens": [...]}` → `{"prompt": "..."}`.
pub async fn detokenize(
    st: &Arc<AppState>,
    req: Request<Incoming>,
) -> Result<Response<Body>, ApiError> {
    #[derive(serde::Deserialize)]
    struct Detok {
        model: Option<String>,
        tokens: Vec<u32>,
    }
    let body = read_body(req, st.cfg.max_body_bytes).await?;
    let d: Detok = parse_body(&body)?;
    check_model(st, d.model.as_deref())?;
    let vocab = st.tokenizer.vocab_size();
    if let Some(bad) = d.tokens.iter().find(|&&id| id as usize >= vocab) {
        return Err(ApiError::invalid_param(
            "tokens",
            format!("Token id {bad} is out of vocabulary (size {vocab})."),
        ));
    }
    let text = st
        .tokenizer
        .decode(&d.tokens, false)
        .map_err(|e| ApiError::bad_request("detokenization_error", e.to_string()))?;
    Ok(json(200, serde_json::json!({ "prompt": text }).to_string()))
}
