//! The minijinja environment that behaves like transformers' chat-template environment
//! (`ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)` plus its `tojson`,
//! `raise_exception` and `strftime_now`), and Python's spelling of values and string methods.

use crate::pyfmt::{self, DumpOptions, py_isspace};
use crate::strftime::{Tm, strftime};
use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{AutoEscape, Environment, Error, ErrorKind, State, UndefinedBehavior};

/// The error `raise_exception(msg)` carries as the source of the minijinja error, so the
/// renderer can hand back exactly `msg`.
#[derive(Debug)]
pub(crate) struct Raised(pub(crate) String);

impl std::fmt::Display for Raised {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Raised {}

/// A fresh environment with transformers' settings, filters and globals.
pub(crate) fn new_environment() -> Environment<'static> {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_keep_trailing_newline(false);
    env.set_auto_escape_callback(|_| AutoEscape::None);
    env.set_undefined_behavior(UndefinedBehavior::Lenient);
    env.set_debug(false);
    // Runaway recursive macros must fail cleanly long before a 2 MiB thread stack runs out.
    env.set_recursion_limit(128);
    env.set_formatter(|out, _state, value| {
        if let Some(s) = value.as_str() {
            out.write_str(s)?;
        } else {
            let mut buf = String::new();
            pyfmt::write_str(value, &mut buf);
            out.write_str(&buf)?;
        }
        Ok(())
    });
    env.set_unknown_method_callback(unknown_method);
    env.add_filter("tojson", tojson);
    env.add_filter("string", string_filter);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    env
}

fn raise_exception(message: Option<Value>) -> Result<Value, Error> {
    let mut text = String::new();
    if let Some(m) = &message {
        pyfmt::write_str(m, &mut text);
    }
    Err(Error::new(ErrorKind::InvalidOperation, "raise_exception called").with_source(Raised(text)))
}

fn strftime_now(format: &str) -> String {
    strftime(&Tm::now(), format)
}

/// `str(x)`: Python spelling (`None`, `True`, `1.0`) instead of minijinja's.
fn string_filter(value: &Value) -> Value {
    if value.kind() == ValueKind::String {
        return value.clone();
    }
    let mut out = String::new();
    pyfmt::write_str(value, &mut out);
    Value::from(out)
}

/// transformers' `tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`,
/// which is `json.dumps` with those arguments.
fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let mut opts = DumpOptions::default();
    if let Some(v) = kwargs.get::<Option<bool>>("ensure_ascii")? {
        opts.ensure_ascii = v;
    }
    if let Some(v) = kwargs.get::<Option<bool>>("sort_keys")? {
        opts.sort_keys = v;
    }
    let indent: Option<Value> = kwargs.get("indent")?;
    if let Some(indent) = indent.filter(|v| !v.is_none() && !v.is_undefined()) {
        let text = if let Some(s) = indent.as_str() {
            s.to_owned()
        } else if let Some(n) = indent.as_i64() {
            " ".repeat(usize::try_from(n).unwrap_or(0))
        } else {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson: indent must be an integer or a string",
            ));
        };
        opts.indent = Some(text);
        opts.item_sep = ",".to_owned();
    }
    let separators: Option<Value> = kwargs.get("separators")?;
    if let Some(seps) = separators.filter(|v| !v.is_none() && !v.is_undefined()) {
        let parts: Vec<Value> = seps
            .try_iter()
            .map_err(|_| {
                Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: separators must be a pair of strings",
                )
            })?
            .collect();
        match parts.as_slice() {
            [item, key] if item.as_str().is_some() && key.as_str().is_some() => {
                opts.item_sep = item.as_str().unwrap_or_default().to_owned();
                opts.key_sep = key.as_str().unwrap_or_default().to_owned();
            }
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: separators must be a pair of strings",
                ));
            }
        }
    }
    kwargs.assert_all_used()?;
    pyfmt::dumps(value, &opts)
        .map(Value::from)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, e))
}

/// Python string methods that minijinja-contrib's `pycompat` lacks or spells differently, then
/// `pycompat` for the rest (`upper`, `split`, `startswith`, `items`, `get`, ...).
fn unknown_method(
    state: &State,
    value: &Value,
    method: &str,
    args: &[Value],
) -> Result<Value, Error> {
    if let Some(s) = value.as_str()
        && let Some(rv) = string_method(s, method, args)?
    {
        return Ok(rv);
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
}

fn bad_args(method: &str) -> Error {
    Error::new(
        ErrorKind::InvalidOperation,
        format!("str.{method}: unsupported arguments"),
    )
}

fn opt_str<'a>(method: &str, v: Option<&'a Value>) -> Result<Option<&'a str>, Error> {
    match v {
        None => Ok(None),
        Some(v) if v.is_none() => Ok(None),
        Some(v) => v.as_str().map(Some).ok_or_else(|| bad_args(method)),
    }
}

fn opt_int(method: &str, v: Option<&Value>) -> Result<i64, Error> {
    match v {
        None => Ok(-1),
        Some(v) => v.as_i64().ok_or_else(|| bad_args(method)),
    }
}

/// `Ok(None)` means "not handled here, ask pycompat".
fn string_method(s: &str, method: &str, args: &[Value]) -> Result<Option<Value>, Error> {
    Ok(Some(match method {
        "strip" | "lstrip" | "rstrip" if args.len() <= 1 => {
            let chars = opt_str(method, args.first())?;
            let is_strip = |c: char| match chars {
                Some(set) => set.contains(c),
                None => py_isspace(c),
            };
            Value::from(match method {
                "strip" => s.trim_matches(is_strip),
                "lstrip" => s.trim_start_matches(is_strip),
                _ => s.trim_end_matches(is_strip),
            })
        }
        // Python counts characters, not bytes.
        "find" | "rfind" | "index" | "rindex" if args.len() == 1 => {
            let needle = opt_str(method, args.first())?.ok_or_else(|| bad_args(method))?;
            let at = if method.starts_with('r') {
                s.rfind(needle)
            } else {
                s.find(needle)
            };
            match at {
                Some(byte) => Value::from(s[..byte].chars().count() as i64),
                None if method.ends_with("index") => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "substring not found",
                    ));
                }
                None => Value::from(-1),
            }
        }
        "splitlines" if args.len() <= 1 => {
            let keepends = args.first().is_some_and(Value::is_true);
            Value::from(py_splitlines(s, keepends))
        }
        "rsplit" if args.len() <= 2 => {
            let sep = opt_str(method, args.first())?;
            let max = opt_int(method, args.get(1))?;
            Value::from(py_rsplit(s, sep, max).map_err(|e| bad_args_msg(method, e))?)
        }
        "removeprefix" if args.len() == 1 => {
            let p = opt_str(method, args.first())?.ok_or_else(|| bad_args(method))?;
            Value::from(s.strip_prefix(p).unwrap_or(s))
        }
        "removesuffix" if args.len() == 1 => {
            let p = opt_str(method, args.first())?.ok_or_else(|| bad_args(method))?;
            Value::from(s.strip_suffix(p).unwrap_or(s))
        }
        _ => return Ok(None),
    }))
}

fn bad_args_msg(method: &str, why: &str) -> Error {
    Error::new(ErrorKind::InvalidOperation, format!("str.{method}: {why}"))
}

fn is_line_break(c: char) -> bool {
    matches!(
        c,
        '\n' | '\r'
            | '\u{0b}'
            | '\u{0c}'
            | '\u{1c}'
            | '\u{1d}'
            | '\u{1e}'
            | '\u{85}'
            | '\u{2028}'
            | '\u{2029}'
    )
}

/// Python's `str.splitlines`.
fn py_splitlines(s: &str, keepends: bool) -> Vec<Value> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut iter = s.char_indices().peekable();
    while let Some((i, c)) = iter.next() {
        if !is_line_break(c) {
            continue;
        }
        let mut end = i + c.len_utf8();
        if c == '\r'
            && let Some(&(j, '\n')) = iter.peek()
        {
            iter.next();
            end = j + 1;
        }
        out.push(Value::from(if keepends {
            &s[start..end]
        } else {
            &s[start..i]
        }));
        start = end;
    }
    if start < s.len() {
        out.push(Value::from(&s[start..]));
    }
    out
}

/// Python's `str.rsplit(sep=None, maxsplit=-1)`.
fn py_rsplit(s: &str, sep: Option<&str>, max: i64) -> Result<Vec<Value>, &'static str> {
    let mut parts: Vec<&str> = match sep {
        Some("") => return Err("empty separator"),
        Some(sep) if max < 0 => s.split(sep).collect(),
        Some(sep) => {
            let mut v: Vec<&str> = s.rsplitn(max as usize + 1, sep).collect();
            v.reverse();
            v
        }
        None => {
            let mut rest = s.trim_end_matches(py_isspace);
            let mut v = Vec::new();
            let mut splits = 0i64;
            while !rest.is_empty() {
                if max >= 0 && splits >= max {
                    v.push(rest);
                    break;
                }
                match rest.rfind(py_isspace) {
                    Some(at) => {
                        let ws_len = rest[at..].chars().next().map_or(1, char::len_utf8);
                        v.push(&rest[at + ws_len..]);
                        rest = rest[..at].trim_end_matches(py_isspace);
                        splits += 1;
                    }
                    None => {
                        v.push(rest);
                        break;
                    }
                }
            }
            v.reverse();
            v
        }
    };
    if sep.is_none() {
        parts.retain(|p| !p.is_empty());
    }
    Ok(parts.into_iter().map(Value::from).collect())
}

/// Rewrites transformers' `{% generation %}` / `{% endgeneration %}` block tags (its
/// assistant-mask extension, a no-op when no mask is asked for) to `{% if true %}` /
/// `{% endif %}`, which minijinja knows and which trim the same whitespace.
pub(crate) fn rewrite_generation_tags(source: &str) -> std::borrow::Cow<'_, str> {
    if !source.contains("generation") {
        return std::borrow::Cow::Borrowed(source);
    }
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(open) = rest.find("{%") {
        out.push_str(&rest[..open]);
        let tag = &rest[open..];
        let Some(close) = tag.find("%}") else {
            break;
        };
        let inner = &tag[2..close];
        let (lead, body) = match inner.strip_prefix(['-', '+']) {
            Some(b) => (&inner[..1], b),
            None => ("", inner),
        };
        let (body, trail) = match body.strip_suffix(['-', '+']) {
            Some(b) => (b, &body[b.len()..]),
            None => (body, ""),
        };
        let replacement = match body.trim() {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        match replacement {
            Some(r) => {
                out.push_str("{%");
                out.push_str(lead);
                out.push(' ');
                out.push_str(r);
                out.push(' ');
                out.push_str(trail);
                out.push_str("%}");
            }
            None => out.push_str(&tag[..close + 2]),
        }
        rest = &tag[close + 2..];
    }
    out.push_str(rest);
    std::borrow::Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generation_tags_are_rewritten() {
        let src = "a{%- generation -%}b{% endgeneration %}c{{ x }}{% if y %}{% endif %}";
        assert_eq!(
            rewrite_generation_tags(src),
            "a{%- if true -%}b{% endif %}c{{ x }}{% if y %}{% endif %}"
        );
        assert_eq!(rewrite_generation_tags("plain {{ x }}"), "plain {{ x }}");
    }

    #[test]
    fn rsplit_like_python() {
        let f = |s, sep, max| {
            py_rsplit(s, sep, max)
                .unwrap()
                .into_iter()
                .map(|v| v.as_str().unwrap().to_owned())
                .collect::<Vec<_>>()
        };
        assert_eq!(f("a,b,c", Some(","), 1), ["a,b", "c"]);
        assert_eq!(f("a,b,c", Some(","), -1), ["a", "b", "c"]);
        assert_eq!(f("  a  b c  ", None, -1), ["a", "b", "c"]);
        assert_eq!(f("  a  b c  ", None, 1), ["  a  b", "c"]);
    }
}
