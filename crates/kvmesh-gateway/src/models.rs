//! `GET /v1/models` and `GET /v1/models/{model}`: the models routed, each with what its
//! engines' own cards say of it.

use crate::gateway::Gateway;
use crate::registry::ModelRoute;
use http::Response;
use kvmesh_http::{Body, error, json};
use kvmesh_openai::{ApiError, ModelCard, ModelList};

/// `/v1/models`: every model routed.
pub fn list(gw: &Gateway) -> Response<Body> {
    let snap = gw.registry.snapshot();
    let list = ModelList {
        object: "list".into(),
        data: snap
            .routes
            .iter()
            .map(|(id, route)| card(gw, id, route))
            .collect(),
    };
    json(200, serde_json::to_string(&list).unwrap_or_default())
}

/// `/v1/models/{model}` (`rest`: the path after `/v1/models/`, percent-encoded or not: a
/// model's name may hold a `/`): its card, or OpenAI's 404 `model_not_found` (QA31: the
/// OpenAI client's `models.retrieve` met a 404 for every model).
pub fn one(gw: &Gateway, rest: &str) -> Response<Body> {
    let id = percent_decoded(rest);
    let snap = gw.registry.snapshot();
    match id.as_deref().and_then(|id| snap.routes.get_key_value(id)) {
        Some((id, route)) => json(
            200,
            serde_json::to_string(&card(gw, id, route)).unwrap_or_default(),
        ),
        None => error(&ApiError::model_not_found(id.as_deref().unwrap_or(rest))),
    }
}

/// A model's card: for a LoRA adapter its base model and path, from the first engine that
/// listed it. Its context length, when the engines list different ones: the longest on a
/// route that sends each request to an engine that holds it (the cache-aware policies read
/// the prompt's length), else the shortest, which every engine the route may pick holds.
fn card(gw: &Gateway, id: &str, route: &ModelRoute) -> ModelCard {
    let listed = route.engines.iter().find_map(|e| e.card(id));
    let known = route.context.iter().copied().filter(|&l| l != 0);
    ModelCard {
        root: Some(
            listed
                .as_ref()
                .and_then(|c| c.root.clone())
                .unwrap_or_else(|| id.to_string()),
        ),
        id: id.to_string(),
        object: "model".into(),
        created: gw.started_unix,
        owned_by: "kvmesh".into(),
        max_model_len: if route.prefix.is_some() {
            known.max()
        } else {
            known.min()
        },
        parent: listed.and_then(|c| c.parent),
    }
}

/// `s` with its `%XX` escapes decoded, if they are well-formed and the result is UTF-8.
fn percent_decoded(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = b.get(i + 1..i + 3)?;
            if !hex.iter().all(u8::is_ascii_hexdigit) {
                return None;
            }
            let hex = std::str::from_utf8(hex).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::percent_decoded;

    #[test]
    fn names_are_percent_decoded_when_well_formed() {
        assert_eq!(
            percent_decoded("Qwen%2FQwen3-0.6B").as_deref(),
            Some("Qwen/Qwen3-0.6B")
        );
        assert_eq!(percent_decoded("Qwen/Qwen3").as_deref(), Some("Qwen/Qwen3"));
        assert_eq!(percent_decoded("a%20b").as_deref(), Some("a b"));
        assert_eq!(percent_decoded("a%2"), None);
        assert_eq!(percent_decoded("a%zz"), None);
        assert_eq!(percent_decoded("a%+1"), None);
        assert_eq!(percent_decoded("%ff"), None);
    }
}
