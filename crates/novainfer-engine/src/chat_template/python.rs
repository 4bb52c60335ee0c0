//! Python's view of template values, which jinja2 output is made of: `str()`/`repr()` for
//! printed values and `json.dumps` for the `tojson` filter (transformers' override).

use std::fmt::Write as _;

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Error, ErrorKind};

/// Python's `str(value)`, which is what jinja2 prints for `{{ value }}`.
pub(super) fn py_str(value: &Value) -> String {
    match value.kind() {
        ValueKind::Undefined => String::new(),
        ValueKind::String => value.as_str().unwrap_or_default().to_owned(),
        _ => py_repr(value),
    }
}

/// Python's `repr(value)` for the types templates see (containers print their items this way).
fn py_repr(value: &Value) -> String {
    match value.kind() {
        ValueKind::Undefined => String::new(),
        ValueKind::None => "None".to_owned(),
        ValueKind::Bool => if value.is_true() { "True" } else { "False" }.to_owned(),
        ValueKind::Number => match as_float(value) {
            Some(f) if f.is_nan() => "nan".to_owned(),
            Some(f) if f.is_infinite() => if f > 0.0 { "inf" } else { "-inf" }.to_owned(),
            Some(f) => py_float(f),
            None => value.to_string(),
        },
        ValueKind::String => py_str_repr(value.as_str().unwrap_or_default()),
        ValueKind::Seq | ValueKind::Iterable => match value.try_iter() {
            Ok(items) => format!(
                "[{}]",
                items.map(|v| py_repr(&v)).collect::<Vec<_>>().join(", ")
            ),
            Err(_) => value.to_string(),
        },
        ValueKind::Map => match value.try_iter() {
            Ok(keys) => {
                let pairs: Vec<String> = keys
                    .map(|k| {
                        let v = value.get_item(&k).unwrap_or_default();
                        format!("{}: {}", py_repr(&k), py_repr(&v))
                    })
                    .collect();
                format!("{{{}}}", pairs.join(", "))
            }
            Err(_) => value.to_string(),
        },
        _ => value.to_string(),
    }
}

/// `repr(str)`: single quotes unless the text has a `'` and no `"`.
fn py_str_repr(s: &str) -> String {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    let mut out = String::with_capacity(s.len() + 2);
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
            c => out.push(c),
        }
    }
    out.push(quote);
    out
}

/// `Some(f)` for float values, `None` for integers.
fn as_float(value: &Value) -> Option<f64> {
    if value.is_integer() {
        return None;
    }
    f64::try_from(value.clone()).ok()
}

/// `repr(float)` for finite values: shortest round-trip digits, exponent form when the decimal
/// point would sit before position -4 or after 16 (CPython's `float_repr_style = 'short'`).
fn py_float(f: f64) -> String {
    if f == 0.0 {
        return if f.is_sign_negative() { "-0.0" } else { "0.0" }.to_owned();
    }
    let sci = format!("{:e}", f.abs());
    let (mantissa, exponent) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exponent: i32 = exponent.parse().unwrap_or(0);
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let sign = if f < 0.0 { "-" } else { "" };
    let point = exponent + 1;
    let num_digits = digits.len() as i32;
    let body = if !(-4 < point && point <= 16) {
        let (first, rest) = digits.split_at(1);
        let fraction = if rest.is_empty() {
            String::new()
        } else {
            format!(".{rest}")
        };
        let exp_sign = if exponent < 0 { '-' } else { '+' };
        format!("{first}{fraction}e{exp_sign}{:02}", exponent.abs())
    } else if point <= 0 {
        format!("0.{}{digits}", "0".repeat((-point) as usize))
    } else if point >= num_digits {
        format!("{digits}{}.0", "0".repeat((point - num_digits) as usize))
    } else {
        let (int_part, frac_part) = digits.split_at(point as usize);
        format!("{int_part}.{frac_part}")
    };
    format!("{sign}{body}")
}

/// How `json.dumps` lays out its output.
struct JsonStyle {
    indent: Option<String>,
    item_separator: String,
    key_separator: String,
    ensure_ascii: bool,
    sort_keys: bool,
}

/// transformers' `tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`.
pub(super) fn tojson(value: &Value, kwargs: Kwargs) -> Result<String, Error> {
    let indent = match kwargs.get::<Option<Value>>("indent")? {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match (v.as_i64(), v.as_str()) {
            (Some(n), _) => Some(" ".repeat(usize::try_from(n).unwrap_or(0))),
            (None, Some(s)) => Some(s.to_owned()),
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: indent must be an int or str",
                ))
            }
        },
    };
    let default_item_separator = if indent.is_some() { "," } else { ", " };
    let (item_separator, key_separator) = match kwargs.get::<Option<Vec<String>>>("separators")? {
        Some(pair) if pair.len() == 2 => (pair[0].clone(), pair[1].clone()),
        Some(_) => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators must be a pair",
            ))
        }
        None => (default_item_separator.to_owned(), ": ".to_owned()),
    };
    let style = JsonStyle {
        indent,
        item_separator,
        key_separator,
        ensure_ascii: kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false),
        sort_keys: kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false),
    };
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write_json(&mut out, value, &style, 0)?;
    Ok(out)
}

fn write_json(
    out: &mut String,
    value: &Value,
    style: &JsonStyle,
    depth: usize,
) -> Result<(), Error> {
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => match as_float(value) {
            Some(f) if f.is_nan() => out.push_str("NaN"),
            Some(f) if f.is_infinite() => {
                out.push_str(if f > 0.0 { "Infinity" } else { "-Infinity" })
            }
            Some(f) => out.push_str(&py_float(f)),
            None => out.push_str(&value.to_string()),
        },
        ValueKind::String => {
            write_json_str(out, value.as_str().unwrap_or_default(), style.ensure_ascii)
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            write_json_container(out, ('[', ']'), &items, style, depth, |out, item, depth| {
                write_json(out, item, style, depth)
            })?;
        }
        ValueKind::Map => {
            let mut entries: Vec<(String, Value)> = value
                .try_iter()?
                .map(|key| Ok((json_key(&key)?, value.get_item(&key)?)))
                .collect::<Result<_, Error>>()?;
            if style.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            write_json_container(
                out,
                ('{', '}'),
                &entries,
                style,
                depth,
                |out, (key, item), depth| {
                    write_json_str(out, key, style.ensure_ascii);
                    out.push_str(&style.key_separator);
                    write_json(out, item, style, depth)
                },
            )?;
        }
        kind => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: a value of type {kind} is not JSON serializable"),
            ))
        }
    }
    Ok(())
}

fn write_json_container<T>(
    out: &mut String,
    (open, close): (char, char),
    items: &[T],
    style: &JsonStyle,
    depth: usize,
    mut write_item: impl FnMut(&mut String, &T, usize) -> Result<(), Error>,
) -> Result<(), Error> {
    out.push(open);
    if items.is_empty() {
        out.push(close);
        return Ok(());
    }
    let newline = |out: &mut String, level: usize| {
        if let Some(indent) = &style.indent {
            out.push('\n');
            out.push_str(&indent.repeat(level));
        }
    };
    for (i, item) in items.iter().enumerate() {
        if i > 0 {
            out.push_str(&style.item_separator);
        }
        newline(out, depth + 1);
        write_item(out, item, depth + 1)?;
    }
    newline(out, depth);
    out.push(close);
    Ok(())
}

/// Python turns non-string dict keys into strings: `1` → `"1"`, `True` → `"true"`, `None` → `"null"`.
fn json_key(key: &Value) -> Result<String, Error> {
    match key.kind() {
        ValueKind::String => Ok(key.as_str().unwrap_or_default().to_owned()),
        ValueKind::None | ValueKind::Bool | ValueKind::Number => {
            let mut text = String::new();
            write_json(&mut text, key, &COMPACT, 0)?;
            Ok(text)
        }
        kind => Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("tojson: keys must be str, not {kind}"),
        )),
    }
}

const COMPACT: JsonStyle = JsonStyle {
    indent: None,
    item_separator: String::new(),
    key_separator: String::new(),
    ensure_ascii: false,
    sort_keys: false,
};

fn write_json_str(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ensure_ascii && !(' '..='~').contains(&c)) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_float_repr() {
        let cases = [
            (0.1, "0.1"),
            (1.0, "1.0"),
            (-2.5, "-2.5"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (123.456, "123.456"),
            (1.5e-7, "1.5e-07"),
            (-0.0, "-0.0"),
            (1.7976931348623157e308, "1.7976931348623157e+308"),
            (5e-324, "5e-324"),
        ];
        for (value, expected) in cases {
            assert_eq!(py_float(value), expected, "{value:e}");
        }
    }
}
