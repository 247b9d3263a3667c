//! OpenAI `/v1/chat/completions` messages to template values, normalized the way vLLM and
//! transformers prepare them before the template sees them.
//!
//! Applied in order to each message (all other keys are passed through untouched, in the order
//! the client sent them):
//!
//! 1. **content** (vLLM `parse_chat_messages`, "string" content format, the one text-only
//!    templates such as Qwen3's use): a string is kept; a list of parts becomes the `text` of its
//!    text parts joined with `"\n"` (`{"type": "text", "text": ..}`, a bare string, or
//!    `{"text": ..}` without a type; `input_text` and `refusal` parts count as text too); `null`
//!    or a missing content becomes `""`. Any other part type (`image_url`, `input_audio`, ...) is
//!    a [`TokenizeError::Template`](crate::TokenizeError::Template): this renderer is text-only.
//! 2. **tool call arguments** (vLLM `_postprocess_messages`): in an assistant message's
//!    `tool_calls`, a `function.arguments` JSON string is parsed into its value (so templates that
//!    `tojson` it re-serialize it in Python's spelling), and an empty or missing one becomes `{}`.
//! 3. **`null`s dropped** (transformers 5 `apply_chat_template`): keys whose value is `null` are
//!    removed, so templates see them as undefined.
//! 4. **reasoning aliases** (transformers 5 `_alias_reasoning_fields`): the first non-null of
//!    `reasoning_content`, `thinking`, `reasoning` is copied to both `thinking` (put first) and
//!    `reasoning_content` (put last, unless it was already there).

use crate::error::TokenizeError;
use minijinja::value::Value;
use serde_json::Value as Json;

/// Convert a JSON value to a template value, keeping object key order.
pub(crate) fn json_to_value(v: &Json) -> Value {
    match v {
        Json::Null => Value::from(()),
        Json::Bool(b) => Value::from(*b),
        Json::Number(n) => {
            if let Some(u) = n.as_u64() {
                Value::from(u)
            } else if let Some(i) = n.as_i64() {
                Value::from(i)
            } else {
                Value::from(n.as_f64().unwrap_or(f64::NAN))
            }
        }
        Json::String(s) => Value::from(s.as_str()),
        Json::Array(items) => Value::from(items.iter().map(json_to_value).collect::<Vec<_>>()),
        Json::Object(map) => map_value(map.iter().map(|(k, v)| (k.as_str(), json_to_value(v)))),
    }
}

fn map_value<K: Into<Value>>(pairs: impl IntoIterator<Item = (K, Value)>) -> Value {
    pairs
        .into_iter()
        .map(|(k, v)| (k.into(), v))
        .collect::<Value>()
}

const REASONING_FIELDS: [&str; 3] = ["reasoning_content", "thinking", "reasoning"];

/// Normalize one message (see the module docs). `index` is only used in error messages.
pub(crate) fn convert_message(index: usize, msg: &Json) -> Result<Value, TokenizeError> {
    let Some(obj) = msg.as_object() else {
        return Err(TokenizeError::Template(format!(
            "messages[{index}] must be an object, found {}",
            json_kind(msg)
        )));
    };
    let role = obj.get("role").and_then(Json::as_str);
    if role.is_none() {
        return Err(TokenizeError::Template(format!(
            "messages[{index}] has no string 'role'"
        )));
    }
    let is_assistant = role == Some("assistant");

    let content = flatten_content(index, obj.get("content"))?;
    let reasoning = REASONING_FIELDS
        .iter()
        .find_map(|k| obj.get(*k).filter(|v| !v.is_null()));

    let mut pairs: Vec<(&str, Value)> = Vec::with_capacity(obj.len() + 3);
    if let Some(r) = reasoning {
        pairs.push(("thinking", json_to_value(r)));
    }
    let mut saw_content = false;
    let mut saw_reasoning_content = false;
    for (key, value) in obj {
        let key = key.as_str();
        match key {
            "content" => {
                saw_content = true;
                pairs.push(("content", Value::from(content.as_str())));
            }
            "thinking" if reasoning.is_some() => {
                // Already placed first, with the aliased value.
                if let Some(slot) = pairs.iter_mut().find(|(k, _)| *k == "thinking") {
                    // Python's dict keeps the first insertion position but the last value.
                    slot.1 = json_to_value(reasoning.unwrap_or(value));
                }
            }
            "reasoning_content" if reasoning.is_some() => {
                saw_reasoning_content = true;
                pairs.push((key, json_to_value(reasoning.unwrap_or(value))));
            }
            _ if value.is_null() => {}
            "tool_calls" if is_assistant => pairs.push((key, convert_tool_calls(index, value)?)),
            _ => pairs.push((key, json_to_value(value))),
        }
    }
    if !saw_content {
        // vLLM turns a missing content into "" too; keep the role first like it does.
        let at = pairs
            .iter()
            .position(|(k, _)| *k == "role")
            .map_or(0, |i| i + 1);
        pairs.insert(at, ("content", Value::from(content.as_str())));
    }
    if let Some(r) = reasoning
        && !saw_reasoning_content
    {
        pairs.push(("reasoning_content", json_to_value(r)));
    }
    Ok(map_value(pairs))
}

/// The final message's `content` with `tag` appended, for `continue_final_message`.
pub(crate) fn append_to_content(message: &Value, tag: &str) -> Value {
    let Ok(keys) = message.try_iter() else {
        return message.clone();
    };
    map_value(keys.map(|k| {
        let v = message.get_item(&k).unwrap_or_default();
        let v = if k.as_str() == Some("content") {
            Value::from(format!("{}{tag}", v.as_str().unwrap_or_default()))
        } else {
            v
        };
        (k, v)
    }))
}

fn json_kind(v: &Json) -> &'static str {
    match v {
        Json::Null => "null",
        Json::Bool(_) => "a boolean",
        Json::Number(_) => "a number",
        Json::String(_) => "a string",
        Json::Array(_) => "an array",
        Json::Object(_) => "an object",
    }
}

/// vLLM's "string" content format: text parts joined with a newline.
fn flatten_content(index: usize, content: Option<&Json>) -> Result<String, TokenizeError> {
    match content {
        None | Some(Json::Null) => Ok(String::new()),
        Some(Json::String(s)) => Ok(s.clone()),
        Some(Json::Array(parts)) => {
            let mut out = String::new();
            for (p, part) in parts.iter().enumerate() {
                let text = part_text(part).map_err(|why| {
                    TokenizeError::Template(format!("messages[{index}].content[{p}]: {why}"))
                })?;
                if p > 0 {
                    out.push('\n');
                }
                out.push_str(text);
            }
            Ok(out)
        }
        Some(other) => Err(TokenizeError::Template(format!(
            "messages[{index}].content must be a string or a list of content parts, found {}",
            json_kind(other)
        ))),
    }
}

fn part_text(part: &Json) -> Result<&str, String> {
    match part {
        Json::String(s) => Ok(s),
        Json::Object(obj) => {
            let kind = obj.get("type").and_then(Json::as_str);
            let field = match kind {
                Some("text") | Some("input_text") | None => "text",
                Some("refusal") => "refusal",
                Some(other) => {
                    return Err(format!(
                        "content part type '{other}' is not supported by this text-only model"
                    ));
                }
            };
            obj.get(field).and_then(Json::as_str).ok_or_else(|| {
                format!(
                    "a {} content part needs a string '{field}'",
                    kind.unwrap_or("text")
                )
            })
        }
        other => Err(format!(
            "a content part must be an object, found {}",
            json_kind(other)
        )),
    }
}

/// vLLM parses each `function.arguments` JSON string into a value (templates expect a mapping)
/// and replaces an empty one by `{}`.
fn convert_tool_calls(index: usize, calls: &Json) -> Result<Value, TokenizeError> {
    let Json::Array(items) = calls else {
        return Ok(json_to_value(calls));
    };
    let mut out = Vec::with_capacity(items.len());
    for (c, call) in items.iter().enumerate() {
        let Some(function) = call.get("function").and_then(Json::as_object) else {
            out.push(json_to_value(call));
            continue;
        };
        let args = match function.get("arguments") {
            Some(Json::String(s)) if !s.is_empty() => {
                let parsed: Json = serde_json::from_str(s).map_err(|e| {
                    TokenizeError::Template(format!(
                        "messages[{index}].tool_calls[{c}].function.arguments is not valid JSON: {e}"
                    ))
                })?;
                json_to_value(&parsed)
            }
            Some(v) if truthy(v) => json_to_value(v),
            _ => map_value(std::iter::empty::<(Value, Value)>()),
        };
        let function = map_value(
            function
                .iter()
                .map(|(k, v)| {
                    if k == "arguments" {
                        (k.as_str(), args.clone())
                    } else {
                        (k.as_str(), json_to_value(v))
                    }
                })
                .chain((!function.contains_key("arguments")).then(|| ("arguments", args.clone()))),
        );
        let Some(call_obj) = call.as_object() else {
            continue;
        };
        out.push(map_value(call_obj.iter().map(|(k, v)| {
            if k == "function" {
                (k.as_str(), function.clone())
            } else {
                (k.as_str(), json_to_value(v))
            }
        })));
    }
    Ok(Value::from(out))
}

/// Python truthiness of a JSON value.
fn truthy(v: &Json) -> bool {
    match v {
        Json::Null => false,
        Json::Bool(b) => *b,
        Json::Number(n) => n.as_f64().is_some_and(|f| f != 0.0),
        Json::String(s) => !s.is_empty(),
        Json::Array(a) => !a.is_empty(),
        Json::Object(o) => !o.is_empty(),
    }
}
