//! Chat templates: compiled once, rendered per request exactly like transformers'
//! `apply_chat_template(..., tokenize=False)` as vLLM calls it.

use crate::error::TokenizeError;
use crate::jinja_env::{Raised, new_environment, rewrite_generation_tags};
use crate::messages::{append_to_content, convert_message, json_to_value};
use crate::pyfmt::py_isspace;
use minijinja::Environment;
use minijinja::value::Value;
use serde_json::Value as Json;

/// One `/v1/chat/completions` request, as far as rendering the prompt is concerned.
#[derive(Debug, Clone, Copy)]
pub struct ChatRenderRequest<'a> {
    /// OpenAI messages as received. `content` may be a string, `null`, or a list of
    /// `{"type": "text", "text": ..}` parts (flattened to one string joined with `"\n"`, as vLLM
    /// does for text-only models). See the crate docs for the full normalization.
    pub messages: &'a [Json],
    /// The request's `tools`, passed to the template as `tools` (`None` renders as `none`).
    pub tools: Option<&'a [Json]>,
    /// Append the header that starts the assistant's turn (vLLM's default for chat is `true`).
    pub add_generation_prompt: bool,
    /// Leave the final (assistant) message open so the model continues it. Incompatible with
    /// `add_generation_prompt`.
    pub continue_final_message: bool,
    /// The request's `chat_template_kwargs` (e.g. `{"enable_thinking": false}`): extra template
    /// variables, which override the special-token variables. Keys named `messages`, `tools`,
    /// `documents` or `add_generation_prompt` are ignored (the fields above set those).
    pub template_kwargs: Option<&'a serde_json::Map<String, Json>>,
}

impl<'a> ChatRenderRequest<'a> {
    /// A request for `messages` with vLLM's defaults: `add_generation_prompt = true`, no tools,
    /// no `continue_final_message`, no kwargs.
    pub fn new(messages: &'a [Json]) -> Self {
        ChatRenderRequest {
            messages,
            tools: None,
            add_generation_prompt: true,
            continue_final_message: false,
            template_kwargs: None,
        }
    }
}

/// What transformers appends to the final message to find where it ends in the output.
const CONTINUE_TAG: &str = "CONTINUE_FINAL_MESSAGE_TAG ";

const RESERVED_VARIABLES: [&str; 4] = ["messages", "tools", "documents", "add_generation_prompt"];

struct Named {
    name: String,
    /// `"content"` appears in the source (transformers' check for continue_final_message).
    mentions_content: bool,
}

/// A compiled chat template (or the named set of templates a `tokenizer_config.json` may hold),
/// with the tokenizer's special tokens bound as variables. Compiled once; rendering is
/// thread-safe (`Send + Sync`).
pub struct ChatTemplate {
    env: Environment<'static>,
    templates: Vec<Named>,
    /// Index into `templates` used when the request has no tools.
    default: Option<usize>,
    /// Index used when the request has tools (`"tool_use"`, else `default`).
    tool_use: Option<usize>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field(
                "templates",
                &self.templates.iter().map(|t| &t.name).collect::<Vec<_>>(),
            )
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Compile a single template source with no special-token variables bound. Prefer
    /// [`crate::Tokenizer::with_chat_template`], which binds the tokenizer's `bos_token`,
    /// `eos_token`, ... as transformers does.
    pub fn from_source(source: &str) -> Result<ChatTemplate, TokenizeError> {
        Self::compile(vec![("default".to_owned(), source.to_owned())], &[])
    }

    /// Compile named templates. `templates` is `[(name, source)]`; a single unnamed template is
    /// passed as `[("default", source)]`. `variables` are bound as template globals (the
    /// special tokens: `("eos_token", "<|im_end|>")`, ...).
    pub(crate) fn compile(
        templates: Vec<(String, String)>,
        variables: &[(String, String)],
    ) -> Result<ChatTemplate, TokenizeError> {
        let mut env = new_environment();
        for (name, value) in variables {
            env.add_global(name.clone(), Value::from(value.as_str()));
        }
        let mut named = Vec::with_capacity(templates.len());
        for (name, source) in templates {
            let mentions_content = source.contains("content");
            let source = rewrite_generation_tags(&source).into_owned();
            env.add_template_owned(name.clone(), source).map_err(|e| {
                TokenizeError::Template(format!("chat template {name:?} does not compile: {e}"))
            })?;
            named.push(Named {
                name,
                mentions_content,
            });
        }
        let find = |n: &str| named.iter().position(|t| t.name == n);
        let default = find("default");
        let tool_use = find("tool_use").or(default);
        Ok(ChatTemplate {
            env,
            templates: named,
            default,
            tool_use,
        })
    }

    /// The template names (`["default"]` for a plain single template).
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.templates.iter().map(|t| t.name.as_str())
    }

    /// Render `req` to the prompt text, byte-exact to transformers' `apply_chat_template`
    /// (`tokenize=False`) on the messages vLLM would hand it.
    ///
    /// Errors are [`TokenizeError::Template`]: the template's `raise_exception` message, a
    /// template runtime error, an empty conversation, malformed messages, or
    /// `continue_final_message` together with `add_generation_prompt`.
    pub fn render(&self, req: &ChatRenderRequest<'_>) -> Result<String, TokenizeError> {
        let which = if req.tools.is_some() {
            self.tool_use
        } else {
            self.default
        };
        let Some(which) = which else {
            return Err(TokenizeError::Template(
                "This model has multiple chat templates with no default specified!".to_owned(),
            ));
        };
        if req.messages.is_empty() {
            return Err(TokenizeError::Template(
                "Cannot apply chat template to an empty conversation. Provide at least one message."
                    .to_owned(),
            ));
        }
        if req.continue_final_message && req.add_generation_prompt {
            return Err(TokenizeError::Template(
                "continue_final_message and add_generation_prompt are not compatible. Use \
                 continue_final_message when you want the model to continue the final message, \
                 and add_generation_prompt when you want to add a header that will prompt it to \
                 start a new assistant message instead."
                    .to_owned(),
            ));
        }
        let mut messages = req
            .messages
            .iter()
            .enumerate()
            .map(|(i, m)| convert_message(i, m))
            .collect::<Result<Vec<Value>, _>>()?;

        let mut final_content = None;
        if req.continue_final_message {
            if !self.templates[which].mentions_content {
                return Err(TokenizeError::Template(
                    "continue_final_message is set to \"content\" but this is not an accepted \
                     field in the chat_template"
                        .to_owned(),
                ));
            }
            if let Some(last) = messages.last_mut() {
                let content = last
                    .get_attr("content")
                    .ok()
                    .and_then(|c| c.as_str().map(str::to_owned))
                    .unwrap_or_default();
                *last = append_to_content(last, CONTINUE_TAG);
                final_content = Some(content);
            }
        }

        let tools = match req.tools {
            Some(tools) => Value::from(tools.iter().map(json_to_value).collect::<Vec<_>>()),
            None => Value::from(()),
        };
        let kwargs = req.template_kwargs.into_iter().flatten();
        let ctx: Value = kwargs
            .filter(|(k, _)| !RESERVED_VARIABLES.contains(&k.as_str()))
            .map(|(k, v)| (Value::from(k.as_str()), json_to_value(v)))
            .chain([
                (Value::from("messages"), Value::from(messages)),
                (Value::from("tools"), tools),
                (Value::from("documents"), Value::from(())),
                (
                    Value::from("add_generation_prompt"),
                    Value::from(req.add_generation_prompt),
                ),
            ])
            .collect();

        let template = self
            .env
            .get_template(&self.templates[which].name)
            .map_err(|e| TokenizeError::Template(e.to_string()))?;
        let mut rendered = template.render(ctx).map_err(template_error)?;

        if let Some(final_content) = final_content {
            cut_at_continue_tag(&mut rendered, &final_content)?;
        }
        Ok(rendered)
    }
}

/// transformers' continue_final_message post-processing: cut the output where the tag
/// appended to the final message landed.
fn cut_at_continue_tag(rendered: &mut String, final_content: &str) -> Result<(), TokenizeError> {
    let tag = CONTINUE_TAG.trim_end();
    let final_stripped = final_content.trim_matches(py_isspace);
    let Some(at) = rendered
        .contains(final_stripped)
        .then(|| rendered.rfind(tag))
        .flatten()
    else {
        return Err(TokenizeError::Template(
            "continue_final_message is set but the final message does not appear in the chat \
             after applying the chat template! This can happen if the chat template deletes \
             portions of the final message."
                .to_owned(),
        ));
    };
    let exact = rendered[at..].starts_with(CONTINUE_TAG);
    rendered.truncate(at);
    if !exact {
        let keep = rendered.trim_end_matches(py_isspace).len();
        rendered.truncate(keep);
    }
    Ok(())
}

/// A minijinja error as a [`TokenizeError::Template`]: exactly the message for
/// `raise_exception`, a short description otherwise.
fn template_error(err: minijinja::Error) -> TokenizeError {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&err);
    while let Some(e) = source {
        if let Some(raised) = e.downcast_ref::<Raised>() {
            return TokenizeError::Template(raised.0.clone());
        }
        source = e.source();
    }
    TokenizeError::Template(format!("chat template error: {err}"))
}
