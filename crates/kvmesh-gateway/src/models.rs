//! `GET /v1/models` and `GET /v1/models/{model}`: the models routed, each with what its
//! engines' own cards say of it.

use crate::gateway::Gateway;
use crate::registry::ModelRoute;
use http::Response;
use kvmesh_http::{Body, error, json, percent_decode};
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
    let id = percent_decode(rest);
    let snap = gw.registry.snapshot();
    match snap.routes.get_key_value(id.as_str()) {
        Some((id, route)) => json(
            200,
            serde_json::to_string(&card(gw, id, route)).unwrap_or_default(),
        ),
        None => error(&ApiError::model_not_found(&id)),
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
