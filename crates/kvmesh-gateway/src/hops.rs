//! Routing loops. An engine's address may be a router's: this router's own (an admin call or
//! a peer's record naming it), or another router's that routes back here. Every request and
//! probe this router sends carries its mark, a random token per process, in `x-kvmesh-via`
//! (appended to what the request carried); a request that arrives with this router's mark, or
//! with more marks than any sane chain of routers adds, is refused with a 508 instead of being
//! routed again: one request no longer snowballs into thousands (QA: a router given its own
//! address as an engine turned one request into about 10,000, until its file descriptors ran
//! out). Its probes of itself fail the same way, so such an engine never serves a model.

use http::{HeaderMap, HeaderName, HeaderValue};
use kvmesh_openai::ApiError;
use std::hash::{BuildHasher, Hasher};

/// The header of the routers' marks.
pub const VIA: HeaderName = HeaderName::from_static("x-kvmesh-via");

/// More marks than this on one request: a loop through routers of other processes whose marks
/// this one cannot recognise (a router in front of routers is one or two hops).
pub const MAX_HOPS: usize = 8;

/// A new router's mark: `kvmesh-` and 16 hex digits from the process's random hasher keys.
pub fn new_via() -> HeaderValue {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    let v = format!("kvmesh-{:016x}", h.finish());
    HeaderValue::from_str(&v).unwrap_or_else(|_| HeaderValue::from_static("kvmesh"))
}

/// The error for a request that came back (`via`: this router's mark), or `None`.
pub fn looped(via: &HeaderValue, headers: &HeaderMap) -> Option<ApiError> {
    let mut hops = 0;
    for value in headers.get_all(VIA) {
        let marks = value.as_bytes().split(|&b| b == b',');
        for m in marks {
            hops += 1;
            if m.trim_ascii() == via.as_bytes() {
                return Some(ApiError::loop_detected(
                    "routing loop: this request already passed through this router (an engine's address is this router's own, or a router's that routes back to it)",
                ));
            }
        }
    }
    (hops > MAX_HOPS).then(|| {
        ApiError::loop_detected(format!(
            "routing loop: this request passed through {hops} routers (at most {MAX_HOPS} are followed)"
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_carrying_this_routers_mark_or_too_many_is_refused() {
        let me = new_via();
        let other = new_via();
        assert_ne!(me, other, "each router its own mark");
        let mut h = HeaderMap::new();
        assert!(looped(&me, &h).is_none(), "a client's request");
        h.append(VIA, other.clone());
        assert!(looped(&me, &h).is_none(), "through another router");
        h.append(VIA, me.clone());
        let e = looped(&me, &h).expect("came back");
        assert_eq!((e.status, e.code), (508, "loop_detected"));
        // Marks merged into one line by an intermediary.
        let mut h = HeaderMap::new();
        let merged = format!("{}, {}", other.to_str().unwrap(), me.to_str().unwrap());
        h.insert(VIA, HeaderValue::from_str(&merged).unwrap());
        assert!(looped(&me, &h).is_some());
        // Too many marks of routers unknown here.
        let mut h = HeaderMap::new();
        for _ in 0..MAX_HOPS {
            h.append(VIA, new_via());
        }
        assert!(looped(&me, &h).is_none(), "{MAX_HOPS} hops are followed");
        h.append(VIA, new_via());
        assert!(looped(&me, &h).unwrap().message.contains("9 routers"));
    }
}
