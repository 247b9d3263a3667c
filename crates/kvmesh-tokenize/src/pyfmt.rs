//! Python-compatible text forms of template values.
//!
//! Chat templates were written for Python's jinja2, and the text they produce is what the model
//! saw in training and what vLLM/transformers send to the tokenizer. Three places differ between
//! minijinja's defaults and Python, and each is reproduced here byte for byte:
//!
//! * [`dumps`] — `json.dumps(x, ensure_ascii=False, indent=None, separators=None,
//!   sort_keys=False)`, the `tojson` filter transformers installs (minijinja's own `tojson`
//!   escapes HTML characters and uses compact separators).
//! * [`write_str`] — `str(x)`, what `{{ x }}` prints: `None`, `True`, `1.0`, `['a', 1]`,
//!   `{'k': 'v'}` (minijinja prints `none`, `true`, `["a", 1]`).
//! * [`float_repr`] — Python's `repr(float)`: shortest round-trip digits, `1e+16`, `1e-05`.

use minijinja::value::{Value, ValueKind};
use std::fmt::Write;

/// Options of Python's `json.dumps` that transformers' `tojson` exposes.
#[derive(Debug, Clone)]
pub(crate) struct DumpOptions {
    /// Escape every non-ASCII character as `\uXXXX` (default `false` in transformers' filter).
    pub ensure_ascii: bool,
    /// `None` for one-line output; `Some(s)` puts each item on its own line indented by `s`.
    pub indent: Option<String>,
    /// Item separator (`", "` on one line, `","` when indenting, unless given).
    pub item_sep: String,
    /// Key separator (`": "` unless given).
    pub key_sep: String,
    /// Sort object keys.
    pub sort_keys: bool,
}

impl Default for DumpOptions {
    fn default() -> Self {
        DumpOptions {
            ensure_ascii: false,
            indent: None,
            item_sep: ", ".to_owned(),
            key_sep: ": ".to_owned(),
            sort_keys: false,
        }
    }
}

/// Why a value cannot be serialized (Python raises `TypeError` / `ValueError`).
pub(crate) type DumpError = String;

/// Serialize `value` the way Python's `json.dumps` would.
pub(crate) fn dumps(value: &Value, opts: &DumpOptions) -> Result<String, DumpError> {
    let mut out = String::new();
    dump_value(value, opts, 0, &mut out)?;
    Ok(out)
}

fn newline_indent(opts: &DumpOptions, level: usize, out: &mut String) {
    if let Some(indent) = &opts.indent {
        out.push('\n');
        for _ in 0..level {
            out.push_str(indent);
        }
    }
}

fn dump_value(
    value: &Value,
    opts: &DumpOptions,
    level: usize,
    out: &mut String,
) -> Result<(), DumpError> {
    if level > 256 {
        return Err("tojson: value nested too deeply".to_owned());
    }
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => write_number(value, true, out),
        ValueKind::String => write_json_string(value.as_str().unwrap_or_default(), opts, out),
        ValueKind::Seq | ValueKind::Iterable => {
            let items = value
                .try_iter()
                .map_err(|e| format!("tojson: cannot iterate value: {e}"))?;
            let mut first = true;
            out.push('[');
            for item in items {
                if first {
                    first = false;
                } else {
                    out.push_str(&opts.item_sep);
                }
                newline_indent(opts, level + 1, out);
                dump_value(&item, opts, level + 1, out)?;
            }
            if !first {
                newline_indent(opts, level, out);
            }
            out.push(']');
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = value
                .try_iter()
                .map_err(|e| format!("tojson: cannot iterate mapping: {e}"))?
                .collect();
            if opts.sort_keys {
                keys.sort();
            }
            let mut first = true;
            out.push('{');
            for key in keys {
                let item = value
                    .get_item(&key)
                    .map_err(|e| format!("tojson: cannot read mapping item: {e}"))?;
                if first {
                    first = false;
                } else {
                    out.push_str(&opts.item_sep);
                }
                newline_indent(opts, level + 1, out);
                write_json_key(&key, opts, out)?;
                out.push_str(&opts.key_sep);
                dump_value(&item, opts, level + 1, out)?;
            }
            if !first {
                newline_indent(opts, level, out);
            }
            out.push('}');
        }
        ValueKind::Undefined => {
            return Err("Object of type Undefined is not JSON serializable".to_owned());
        }
        ValueKind::Bytes => return Err("Object of type bytes is not JSON serializable".to_owned()),
        _ => {
            return Err(format!(
                "Object of type {} is not JSON serializable",
                value.kind()
            ));
        }
    }
    Ok(())
}

/// Python converts non-string keys: `True` -> `"true"`, `None` -> `"null"`, numbers -> their
/// text; anything else is a `TypeError`.
fn write_json_key(key: &Value, opts: &DumpOptions, out: &mut String) -> Result<(), DumpError> {
    match key.kind() {
        ValueKind::String => write_json_string(key.as_str().unwrap_or_default(), opts, out),
        ValueKind::Bool => out.push_str(if key.is_true() {
            "\"true\""
        } else {
            "\"false\""
        }),
        ValueKind::None => out.push_str("\"null\""),
        ValueKind::Number => {
            out.push('"');
            write_number(key, true, out);
            out.push('"');
        }
        other => {
            return Err(format!(
                "keys must be str, int, float, bool or None, not {other}"
            ));
        }
    }
    Ok(())
}

/// Writes an integer in decimal, or a float as Python's `repr` (json spelling of non-finite
/// values when `json` is set: `NaN`, `Infinity`; Python's `nan`, `inf` otherwise).
fn write_number(value: &Value, json: bool, out: &mut String) {
    if value.is_integer() {
        let _ = write!(out, "{value}");
        return;
    }
    match f64::try_from(value.clone()) {
        Ok(f) if f.is_nan() => out.push_str(if json { "NaN" } else { "nan" }),
        Ok(f) if f.is_infinite() => {
            let s = match (json, f > 0.0) {
                (true, true) => "Infinity",
                (true, false) => "-Infinity",
                (false, true) => "inf",
                (false, false) => "-inf",
            };
            out.push_str(s);
        }
        Ok(f) => float_repr(f, out),
        Err(_) => {
            let _ = write!(out, "{value}");
        }
    }
}

/// Python's `repr(float)` for a finite `f`: the shortest digits that round-trip, in positional
/// notation when the decimal exponent is in `-4..16` and in `d.ddde+XX` notation otherwise.
pub(crate) fn float_repr(f: f64, out: &mut String) {
    // Rust's `{:e}` gives the same shortest round-trip digits Python uses, e.g. `1.2345e-5`.
    let sci = format!("{f:e}");
    let (mantissa, exp) = match sci.split_once('e') {
        Some((m, e)) => (m, e.parse::<i32>().unwrap_or(0)),
        None => (sci.as_str(), 0),
    };
    let (negative, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => (true, m),
        None => (false, mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    if negative {
        out.push('-');
    }
    if (-4..16).contains(&exp) {
        if exp >= 0 {
            let int_len = exp as usize + 1;
            if digits.len() <= int_len {
                out.push_str(&digits);
                for _ in digits.len()..int_len {
                    out.push('0');
                }
                out.push_str(".0");
            } else {
                out.push_str(&digits[..int_len]);
                out.push('.');
                out.push_str(&digits[int_len..]);
            }
        } else {
            out.push_str("0.");
            for _ in 0..(-exp - 1) {
                out.push('0');
            }
            out.push_str(&digits);
        }
    } else {
        out.push_str(&digits[..1]);
        if digits.len() > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        let _ = write!(
            out,
            "e{}{:02}",
            if exp < 0 { '-' } else { '+' },
            exp.unsigned_abs()
        );
    }
}

fn write_json_string(s: &str, opts: &DumpOptions, out: &mut String) {
    out.reserve(s.len() + 2);
    out.push('"');
    let mut plain_start = 0;
    for (i, c) in s.char_indices() {
        let needs_escape = matches!(c, '"' | '\\' | '\u{0}'..='\u{1f}')
            || (opts.ensure_ascii && (c as u32) >= 0x7f);
        if !needs_escape {
            continue;
        }
        out.push_str(&s[plain_start..i]);
        plain_start = i + c.len_utf8();
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            _ => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
        }
    }
    out.push_str(&s[plain_start..]);
    out.push('"');
}

/// Python's `str(value)`: what jinja2 prints for `{{ value }}`. Strings print raw, `None` as
/// `None`, booleans as `True`/`False`, floats as `repr`, lists and dicts as their `repr`.
/// Undefined prints nothing.
pub(crate) fn write_str(value: &Value, out: &mut String) {
    match value.kind() {
        ValueKind::String => out.push_str(value.as_str().unwrap_or_default()),
        ValueKind::Undefined => {}
        _ => write_repr(value, 0, out),
    }
}

/// Python's `repr(value)` for the JSON-like values templates handle.
fn write_repr(value: &Value, level: usize, out: &mut String) {
    if level > 256 {
        out.push_str("...");
        return;
    }
    match value.kind() {
        ValueKind::None => out.push_str("None"),
        ValueKind::Undefined => {}
        ValueKind::Bool => out.push_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::Number => write_number(value, false, out),
        ValueKind::String => write_str_repr(value.as_str().unwrap_or_default(), out),
        ValueKind::Seq => {
            out.push('[');
            if let Ok(items) = value.try_iter() {
                for (i, item) in items.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    write_repr(&item, level + 1, out);
                }
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            if let Ok(keys) = value.try_iter() {
                for (i, key) in keys.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    write_repr(&key, level + 1, out);
                    out.push_str(": ");
                    let item = value.get_item(&key).unwrap_or_default();
                    write_repr(&item, level + 1, out);
                }
            }
            out.push('}');
        }
        // Namespaces, loops, macros, iterators...: minijinja's own spelling.
        _ => {
            let _ = write!(out, "{value}");
        }
    }
}

/// Python's `repr(str)`: single quotes unless the text has a `'` and no `"`.
fn write_str_repr(s: &str, out: &mut String) {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c if (0x80..0xa0).contains(&(c as u32)) => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

/// Python's `str.isspace` for one character (Unicode White_Space plus the ASCII separators
/// `\x1c`..`\x1f`, which Python also counts).
pub(crate) fn py_isspace(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn repr(f: f64) -> String {
        let mut s = String::new();
        float_repr(f, &mut s);
        s
    }

    #[test]
    fn float_repr_matches_python() {
        // Expected values are Python 3.11's repr().
        let cases = [
            (0.0, "0.0"),
            (-0.0, "-0.0"),
            (1.0, "1.0"),
            (0.1, "0.1"),
            (1.5, "1.5"),
            (-2.25, "-2.25"),
            (100.0, "100.0"),
            (123456789.125, "123456789.125"),
            (1e15, "1000000000000000.0"),
            (1e16, "1e+16"),
            (1.234e17, "1.234e+17"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (1.5e-7, "1.5e-07"),
            (1e100, "1e+100"),
            (1.7976931348623157e308, "1.7976931348623157e+308"),
            (5e-324, "5e-324"),
            (std::f64::consts::PI, "3.141592653589793"),
            (1.0 / 3.0, "0.3333333333333333"),
            (9999999999999998.0, "9999999999999998.0"),
        ];
        for (f, want) in cases {
            assert_eq!(repr(f), want, "repr({f:?})");
        }
    }

    #[test]
    fn json_string_escapes_like_python() {
        let opts = DumpOptions::default();
        let v = Value::from("a\"b\\c\n\t\u{1}\u{7f}é😀<>&'");
        assert_eq!(
            dumps(&v, &opts).unwrap(),
            "\"a\\\"b\\\\c\\n\\t\\u0001\u{7f}é😀<>&'\""
        );
        let ascii = DumpOptions {
            ensure_ascii: true,
            ..DumpOptions::default()
        };
        assert_eq!(
            dumps(&Value::from("é😀\u{7f}"), &ascii).unwrap(),
            "\"\\u00e9\\ud83d\\ude00\\u007f\""
        );
    }

    #[test]
    fn str_forms_like_python() {
        let mut s = String::new();
        write_str(&Value::from(()), &mut s);
        s.push('|');
        write_str(&Value::from(true), &mut s);
        s.push('|');
        write_str(
            &Value::from(vec![
                Value::from("it's"),
                Value::from(1),
                Value::from(2.5),
                Value::from(()),
            ]),
            &mut s,
        );
        assert_eq!(s, "None|True|[\"it's\", 1, 2.5, None]");
    }
}
