//! The parts of a Hugging Face model directory besides `tokenizer.json` that matter for
//! serving: `tokenizer_config.json` (chat template, special tokens, `model_max_length`),
//! `chat_template.jinja`, `special_tokens_map.json` and `generation_config.json`.

use serde_json::Value as Json;

/// The named special tokens transformers passes to chat templates (`special_tokens_map`).
pub(crate) const SPECIAL_TOKEN_NAMES: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// transformers writes `int(1e30)` when a model has no length limit.
const NO_LIMIT: f64 = 1e18;

/// What we read from the files next to `tokenizer.json`.
#[derive(Debug, Default, Clone)]
pub(crate) struct HfConfig {
    /// `(name, token)` for every named special token that is set, e.g. `("eos_token", "<|im_end|>")`.
    pub special_tokens: Vec<(String, String)>,
    /// `[(name, source)]`; a plain string template is named `"default"`.
    pub chat_templates: Vec<(String, String)>,
    /// `model_max_length`, unless absent or transformers' "no limit" sentinel.
    pub model_max_length: Option<usize>,
    /// `eos_token_id` from `generation_config.json` (a number or a list).
    pub generation_eos_ids: Vec<u32>,
}

impl HfConfig {
    /// The token text of a named special token (`"eos_token"`, ...).
    pub(crate) fn special_token(&self, name: &str) -> Option<&str> {
        self.special_tokens
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, t)| t.as_str())
    }

    /// Read `tokenizer_config.json` text.
    pub(crate) fn parse_tokenizer_config(&mut self, text: &str) -> Result<(), String> {
        let json: Json = serde_json::from_str(text)
            .map_err(|e| format!("tokenizer_config.json is not valid JSON: {e}"))?;
        let obj = json
            .as_object()
            .ok_or("tokenizer_config.json must hold a JSON object")?;
        for name in SPECIAL_TOKEN_NAMES {
            if let Some(token) = obj.get(name).and_then(token_text) {
                self.set_special_token(name, token);
            }
        }
        match obj.get("chat_template") {
            None | Some(Json::Null) => {}
            Some(Json::String(s)) => {
                self.chat_templates = vec![("default".to_owned(), s.clone())];
            }
            Some(Json::Array(items)) => {
                let mut templates = Vec::with_capacity(items.len());
                for item in items {
                    let name = item.get("name").and_then(Json::as_str);
                    let template = item.get("template").and_then(Json::as_str);
                    match (name, template) {
                        (Some(n), Some(t)) => templates.push((n.to_owned(), t.to_owned())),
                        _ => {
                            return Err("chat_template list entries must be {\"name\": string, \
                                        \"template\": string}"
                                .to_owned());
                        }
                    }
                }
                self.chat_templates = templates;
            }
            Some(_) => {
                return Err("chat_template must be a string or a list of {name, template}".into());
            }
        }
        self.model_max_length = match obj.get("model_max_length") {
            Some(Json::Number(n)) => match n.as_u64() {
                Some(v) if (v as f64) < NO_LIMIT => usize::try_from(v).ok(),
                Some(_) => None,
                None => n
                    .as_f64()
                    .filter(|f| f.is_finite() && *f >= 0.0 && *f < NO_LIMIT && f.fract() == 0.0)
                    .map(|f| f as usize),
            },
            _ => None,
        };
        Ok(())
    }

    /// Read `special_tokens_map.json` text: fills named tokens `tokenizer_config.json` left unset.
    pub(crate) fn parse_special_tokens_map(&mut self, text: &str) -> Result<(), String> {
        let json: Json = serde_json::from_str(text)
            .map_err(|e| format!("special_tokens_map.json is not valid JSON: {e}"))?;
        for name in SPECIAL_TOKEN_NAMES {
            if self.special_token(name).is_none()
                && let Some(token) = json.get(name).and_then(token_text)
            {
                self.set_special_token(name, token);
            }
        }
        Ok(())
    }

    /// Read `generation_config.json` text (only `eos_token_id`).
    pub(crate) fn parse_generation_config(&mut self, text: &str) -> Result<(), String> {
        let json: Json = serde_json::from_str(text)
            .map_err(|e| format!("generation_config.json is not valid JSON: {e}"))?;
        let ids = match json.get("eos_token_id") {
            Some(Json::Number(n)) => n.as_u64().into_iter().collect(),
            Some(Json::Array(a)) => a.iter().filter_map(Json::as_u64).collect(),
            _ => Vec::new(),
        };
        self.generation_eos_ids = ids
            .into_iter()
            .filter_map(|v| u32::try_from(v).ok())
            .collect();
        Ok(())
    }

    fn set_special_token(&mut self, name: &str, token: String) {
        match self.special_tokens.iter_mut().find(|(n, _)| n == name) {
            Some(slot) => slot.1 = token,
            None => self.special_tokens.push((name.to_owned(), token)),
        }
    }
}

/// A special token is spelled as a string or as a serialized `AddedToken` object.
fn token_text(v: &Json) -> Option<String> {
    match v {
        Json::String(s) => Some(s.clone()),
        Json::Object(o) => o.get("content").and_then(Json::as_str).map(str::to_owned),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_tokens_templates_and_limits() {
        let mut c = HfConfig::default();
        c.parse_tokenizer_config(
            r#"{"bos_token": null, "eos_token": {"content": "</s>", "__type": "AddedToken"},
                "pad_token": "<pad>", "model_max_length": 1000000000000000019884624838656,
                "chat_template": [{"name": "default", "template": "a"},
                                  {"name": "tool_use", "template": "b"}]}"#,
        )
        .unwrap();
        assert_eq!(c.special_token("eos_token"), Some("</s>"));
        assert_eq!(c.special_token("bos_token"), None);
        assert_eq!(c.special_token("pad_token"), Some("<pad>"));
        assert_eq!(c.model_max_length, None);
        assert_eq!(c.chat_templates.len(), 2);
        c.parse_tokenizer_config(r#"{"model_max_length": 4096, "chat_template": "x"}"#)
            .unwrap();
        assert_eq!(c.model_max_length, Some(4096));
        assert_eq!(c.chat_templates, vec![("default".into(), "x".into())]);
        c.parse_generation_config(r#"{"eos_token_id": [1, 2]}"#)
            .unwrap();
        assert_eq!(c.generation_eos_ids, vec![1, 2]);
        assert!(c.parse_tokenizer_config("[1]").is_err());
        assert!(c.parse_tokenizer_config(r#"{"chat_template": 5}"#).is_err());
    }
}
