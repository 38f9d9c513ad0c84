//! JSON as Python's `json.dumps` writes it. Chat templates render tool schemas and tool-call
//! arguments with HF's `tojson` (`json.dumps(..., ensure_ascii=False)`), and vLLM returns a tool
//! call's arguments through `json.dumps` too, so the prompt a model sees and the arguments a client
//! gets must match Python byte for byte: its separators (`", "`, `": "`), indentation, and the
//! key order of the input (minijinja is built with `preserve_order`; JSON parsed straight into a
//! [`Value`] keeps the client's order, where `serde_json::Map` would sort it).

use std::io;

use minijinja::value::Kwargs;
use minijinja::{Error, ErrorKind, Value};
use serde::Serialize;

/// `json.dumps(value, ensure_ascii=False)`: the default layout.
pub fn dumps(value: &Value) -> Result<String, Error> {
    write(value, PyJsonFormatter::new(None, b", ".to_vec(), b": ".to_vec(), false))
}

/// Parses JSON text into a template value, keeping the key order of the text.
pub fn parse(text: &str) -> Result<Value, serde_json::Error> {
    serde_json::from_str(text)
}

fn write(value: &Value, formatter: PyJsonFormatter) -> Result<String, Error> {
    let mut out = Vec::new();
    let mut ser = serde_json::Serializer::with_formatter(&mut out, formatter);
    value.serialize(&mut ser).map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    String::from_utf8(out).map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))
}

/// HF's `tojson` is `json.dumps(x, ensure_ascii=False, indent=indent, separators=separators,
/// sort_keys=sort_keys)`. minijinja's own `tojson` writes compact JSON with HTML escaping, so
/// tool schemas rendered into prompts would differ from what the model was trained on.
pub fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let separators: Option<Value> = kwargs.get("separators")?;
    // Accepted for compatibility; maps keep the order they were built in (see the module header).
    let _sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;

    let indent: Option<String> = match indent {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => {
            if let Some(n) = v.as_i64() {
                Some(" ".repeat(usize::try_from(n).unwrap_or(0)))
            } else if let Some(s) = v.as_str() {
                Some(s.to_owned())
            } else {
                return Err(Error::new(ErrorKind::InvalidOperation, "tojson: indent must be an integer or a string"));
            }
        }
    };
    let (item_sep, key_sep) = match separators {
        Some(v) if !(v.is_none() || v.is_undefined()) => {
            let parts: Vec<Value> = v.try_iter()?.collect();
            match (parts.first().and_then(Value::as_str), parts.get(1).and_then(Value::as_str), parts.len()) {
                (Some(a), Some(b), 2) => (a.to_owned(), b.to_owned()),
                _ => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be a pair of strings",
                    ));
                }
            }
        }
        // Python's defaults depend on whether an indent is given.
        _ => (if indent.is_some() { ",".to_owned() } else { ", ".to_owned() }, ": ".to_owned()),
    };

    let formatter = PyJsonFormatter::new(indent.map(String::into_bytes), item_sep.into_bytes(), key_sep.into_bytes(), ensure_ascii.unwrap_or(false));
    write(value, formatter).map(Value::from_safe_string)
}

/// serde_json formatter reproducing Python's `json.dumps` layout (separators, indentation,
/// optional `ensure_ascii` escaping with lowercase hex and surrogate pairs).
struct PyJsonFormatter {
    indent: Option<Vec<u8>>,
    item_sep: Vec<u8>,
    key_sep: Vec<u8>,
    ensure_ascii: bool,
    depth: usize,
    has_value: bool,
}

impl PyJsonFormatter {
    fn new(indent: Option<Vec<u8>>, item_sep: Vec<u8>, key_sep: Vec<u8>, ensure_ascii: bool) -> Self {
        Self { indent, item_sep, key_sep, ensure_ascii, depth: 0, has_value: false }
    }

    fn newline_indent<W: ?Sized + io::Write>(&self, w: &mut W) -> io::Result<()> {
        if let Some(indent) = &self.indent {
            w.write_all(b"\n")?;
            for _ in 0..self.depth {
                w.write_all(indent)?;
            }
        }
        Ok(())
    }

    fn open<W: ?Sized + io::Write>(&mut self, w: &mut W, bracket: &[u8]) -> io::Result<()> {
        self.depth += 1;
        self.has_value = false;
        w.write_all(bracket)
    }

    fn close<W: ?Sized + io::Write>(&mut self, w: &mut W, bracket: &[u8]) -> io::Result<()> {
        self.depth = self.depth.saturating_sub(1);
        if self.has_value {
            self.newline_indent(w)?;
        }
        // The enclosing container, if any, has at least this value.
        self.has_value = true;
        w.write_all(bracket)
    }

    fn element<W: ?Sized + io::Write>(&mut self, w: &mut W, first: bool) -> io::Result<()> {
        if !first {
            w.write_all(&self.item_sep)?;
        }
        self.newline_indent(w)
    }
}

impl serde_json::ser::Formatter for PyJsonFormatter {
    fn begin_array<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.open(w, b"[")
    }
    fn end_array<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.close(w, b"]")
    }
    fn begin_array_value<W: ?Sized + io::Write>(&mut self, w: &mut W, first: bool) -> io::Result<()> {
        self.element(w, first)
    }
    fn end_array_value<W: ?Sized + io::Write>(&mut self, _w: &mut W) -> io::Result<()> {
        self.has_value = true;
        Ok(())
    }
    fn begin_object<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.open(w, b"{")
    }
    fn end_object<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.close(w, b"}")
    }
    fn begin_object_key<W: ?Sized + io::Write>(&mut self, w: &mut W, first: bool) -> io::Result<()> {
        self.element(w, first)
    }
    fn begin_object_value<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        w.write_all(&self.key_sep)
    }
    fn end_object_value<W: ?Sized + io::Write>(&mut self, _w: &mut W) -> io::Result<()> {
        self.has_value = true;
        Ok(())
    }
    fn write_string_fragment<W: ?Sized + io::Write>(&mut self, w: &mut W, fragment: &str) -> io::Result<()> {
        if !self.ensure_ascii || fragment.is_ascii() {
            return w.write_all(fragment.as_bytes());
        }
        let mut units = [0u16; 2];
        for c in fragment.chars() {
            if c.is_ascii() {
                w.write_all(&[c as u8])?;
            } else {
                for unit in c.encode_utf16(&mut units) {
                    write!(w, "\\u{unit:04x}")?;
                }
            }
        }
        Ok(())
    }
}
