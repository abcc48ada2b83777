//! A position-keeping reader for JSON and RON.
//!
//! Workflow diagnostics must point at the line and column of the node or
//! input at fault, which serde's value types forget. This reader builds a
//! small tree where every value and key carries its [`Pos`]. One grammar
//! covers both formats: JSON is read as it is, and RON adds comments,
//! trailing commas, bare identifiers, named structs `Name(field: v)`,
//! tuples `(a, b)`, `Some(v)` and `None`. It never panics: any byte string
//! gives a tree or a [`SyntaxError`] with a position.

use std::fmt;

/// A 1-based line and column (columns count characters, not bytes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Pos {
    pub line: u32,
    pub col: u32,
}

impl fmt::Display for Pos {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.line, self.col)
    }
}

/// A value with the position where it starts.
#[derive(Clone, Debug, PartialEq)]
pub struct Node {
    pub pos: Pos,
    pub value: Value,
}

/// A key of a map or struct field, with its position.
#[derive(Clone, Debug, PartialEq)]
pub struct Key {
    pub pos: Pos,
    pub name: String,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    Null,
    Bool(bool),
    /// Integers keep full range: ComfyUI seeds reach 2^64 - 1.
    Int(i128),
    Float(f64),
    Str(String),
    /// `[a, b]` in JSON and RON.
    List(Vec<Node>),
    /// `{"k": v}` in JSON and RON.
    Map(Vec<(Key, Node)>),
    /// RON `Name(field: v, ...)` or `(field: v)`; the name is optional.
    Struct {
        name: Option<String>,
        fields: Vec<(Key, Node)>,
    },
    /// RON `(a, b)` or `Name(a, b)`; `Some(v)` is read as `v`.
    Tuple {
        name: Option<String>,
        items: Vec<Node>,
    },
    /// A bare RON identifier such as an enum unit variant.
    Ident(String),
}

impl Value {
    /// A word for the kind of value, for error messages.
    pub fn kind(&self) -> &'static str {
        match self {
            Value::Null => "null",
            Value::Bool(_) => "boolean",
            Value::Int(_) => "integer",
            Value::Float(_) => "number",
            Value::Str(_) => "string",
            Value::List(_) => "list",
            Value::Map(_) => "map",
            Value::Struct { .. } => "struct",
            Value::Tuple { .. } => "tuple",
            Value::Ident(_) => "identifier",
        }
    }

    /// Entries of a map or a struct, which workflow formats treat alike.
    pub fn entries(&self) -> Option<&[(Key, Node)]> {
        match self {
            Value::Map(e) => Some(e),
            Value::Struct { fields, .. } => Some(fields),
            _ => None,
        }
    }

    pub fn get(&self, key: &str) -> Option<&Node> {
        self.entries()?
            .iter()
            .find(|(k, _)| k.name == key)
            .map(|(_, v)| v)
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    /// Converts to JSON. Structs become objects (their name is dropped),
    /// tuples become arrays, identifiers become strings.
    pub fn to_json(&self) -> serde_json::Value {
        use serde_json::Value as J;
        match self {
            Value::Null => J::Null,
            Value::Bool(b) => J::Bool(*b),
            Value::Int(i) => int_to_json(*i),
            Value::Float(f) => serde_json::Number::from_f64(*f).map_or(J::Null, J::Number),
            Value::Str(s) | Value::Ident(s) => J::String(s.clone()),
            Value::List(items) | Value::Tuple { items, .. } => {
                J::Array(items.iter().map(|n| n.value.to_json()).collect())
            }
            Value::Map(e) | Value::Struct { fields: e, .. } => J::Object(
                e.iter()
                    .map(|(k, v)| (k.name.clone(), v.value.to_json()))
                    .collect(),
            ),
        }
    }
}

/// JSON numbers hold i64 or u64; larger integers fall back to floats.
pub fn int_to_json(i: i128) -> serde_json::Value {
    if let Ok(v) = i64::try_from(i) {
        serde_json::Value::from(v)
    } else if let Ok(v) = u64::try_from(i) {
        serde_json::Value::from(v)
    } else {
        serde_json::Number::from_f64(i as f64).map_or(serde_json::Value::Null, Into::into)
    }
}

/// Builds a positionless tree from JSON (for workflows that arrive as data,
/// e.g. over HTTP).
pub fn from_json(v: &serde_json::Value) -> Node {
    use serde_json::Value as J;
    let value = match v {
        J::Null => Value::Null,
        J::Bool(b) => Value::Bool(*b),
        J::Number(n) => {
            if let Some(i) = n.as_i64() {
                Value::Int(i as i128)
            } else if let Some(u) = n.as_u64() {
                Value::Int(u as i128)
            } else {
                Value::Float(n.as_f64().unwrap_or(f64::NAN))
            }
        }
        J::String(s) => Value::Str(s.clone()),
        J::Array(a) => Value::List(a.iter().map(from_json).collect()),
        J::Object(o) => Value::Map(
            o.iter()
                .map(|(k, v)| {
                    (
                        Key {
                            pos: Pos::default(),
                            name: k.clone(),
                        },
                        from_json(v),
                    )
                })
                .collect(),
        ),
    };
    Node {
        pos: Pos::default(),
        value,
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SyntaxError {
    pub pos: Pos,
    pub message: String,
}

impl fmt::Display for SyntaxError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.pos, self.message)
    }
}

impl std::error::Error for SyntaxError {}

/// Deep nesting is refused rather than risking the stack.
const MAX_DEPTH: usize = 128;

/// Parses one JSON or RON document.
pub fn parse(text: &str) -> Result<Node, SyntaxError> {
    let mut p = Parser {
        chars: text.chars().collect(),
        i: 0,
        line: 1,
        col: 1,
        depth: 0,
    };
    // A UTF-8 byte order mark is legal at the start of JSON files written
    // by some Windows editors.
    if p.peek() == Some('\u{feff}') {
        p.bump();
    }
    p.skip_ws()?;
    let node = p.value()?;
    p.skip_ws()?;
    if let Some(c) = p.peek() {
        return Err(p.error(format!("unexpected `{c}` after the end of the document")));
    }
    Ok(node)
}

struct Parser {
    chars: Vec<char>,
    i: usize,
    line: u32,
    col: u32,
    depth: usize,
}

impl Parser {
    fn pos(&self) -> Pos {
        Pos {
            line: self.line,
            col: self.col,
        }
    }

    fn error(&self, message: impl Into<String>) -> SyntaxError {
        SyntaxError {
            pos: self.pos(),
            message: message.into(),
        }
    }

    fn peek(&self) -> Option<char> {
        self.chars.get(self.i).copied()
    }

    fn peek_at(&self, n: usize) -> Option<char> {
        self.chars.get(self.i + n).copied()
    }

    fn bump(&mut self) -> Option<char> {
        let c = self.peek()?;
        self.i += 1;
        if c == '\n' {
            self.line += 1;
            self.col = 1;
        } else {
            self.col += 1;
        }
        Some(c)
    }

    fn skip_ws(&mut self) -> Result<(), SyntaxError> {
        loop {
            match (self.peek(), self.peek_at(1)) {
                (Some(c), _) if c.is_whitespace() => {
                    self.bump();
                }
                (Some('/'), Some('/')) => {
                    while let Some(c) = self.peek() {
                        if c == '\n' {
                            break;
                        }
                        self.bump();
                    }
                }
                (Some('/'), Some('*')) => {
                    let start = self.pos();
                    self.bump();
                    self.bump();
                    // RON block comments nest.
                    let mut level = 1;
                    while level > 0 {
                        match (self.peek(), self.peek_at(1)) {
                            (None, _) => {
                                return Err(SyntaxError {
                                    pos: start,
                                    message: "unterminated block comment".into(),
                                })
                            }
                            (Some('*'), Some('/')) => {
                                self.bump();
                                self.bump();
                                level -= 1;
                            }
                            (Some('/'), Some('*')) => {
                                self.bump();
                                self.bump();
                                level += 1;
                            }
                            _ => {
                                self.bump();
                            }
                        }
                    }
                }
                _ => return Ok(()),
            }
        }
    }

    fn expect(&mut self, want: char) -> Result<(), SyntaxError> {
        match self.peek() {
            Some(c) if c == want => {
                self.bump();
                Ok(())
            }
            Some(c) => Err(self.error(format!("expected `{want}`, found `{c}`"))),
            None => Err(self.error(format!("expected `{want}`, found end of file"))),
        }
    }

    fn value(&mut self) -> Result<Node, SyntaxError> {
        if self.depth >= MAX_DEPTH {
            return Err(self.error("nesting is too deep"));
        }
        self.depth += 1;
        let r = self.value_inner();
        self.depth -= 1;
        r
    }

    fn value_inner(&mut self) -> Result<Node, SyntaxError> {
        let pos = self.pos();
        let value = match self.peek() {
            None => return Err(self.error("expected a value, found end of file")),
            Some('{') => Value::Map(self.map()?),
            Some('[') => Value::List(self.list()?),
            Some('(') => self.paren(None)?,
            Some('"') => Value::Str(self.string('"')?),
            Some('\'') => Value::Str(self.string('\'')?),
            Some(c) if c == '-' || c == '+' || c == '.' || c.is_ascii_digit() => self.number()?,
            Some(c) if is_ident_start(c) => {
                let word = self.ident();
                self.skip_ws()?;
                match word.as_str() {
                    "true" => Value::Bool(true),
                    "false" => Value::Bool(false),
                    "null" | "None" => Value::Null,
                    "inf" => Value::Float(f64::INFINITY),
                    "NaN" => Value::Float(f64::NAN),
                    _ if self.peek() == Some('(') => {
                        let v = self.paren(Some(word.clone()))?;
                        match v {
                            // `Some(x)` is just `x` for workflow purposes.
                            Value::Tuple { name, mut items }
                                if name.as_deref() == Some("Some") && items.len() == 1 =>
                            {
                                return Ok(items.remove(0));
                            }
                            other => other,
                        }
                    }
                    _ => Value::Ident(word),
                }
            }
            Some(c) => return Err(self.error(format!("unexpected `{c}`"))),
        };
        Ok(Node { pos, value })
    }

    fn ident(&mut self) -> String {
        let mut s = String::new();
        while let Some(c) = self.peek() {
            if is_ident_continue(c) {
                s.push(c);
                self.bump();
            } else {
                break;
            }
        }
        s
    }

    fn key(&mut self) -> Result<Key, SyntaxError> {
        let pos = self.pos();
        let name = match self.peek() {
            Some('"') => self.string('"')?,
            Some('\'') => self.string('\'')?,
            Some(c) if is_ident_start(c) || c.is_ascii_digit() => self.ident(),
            Some(c) => return Err(self.error(format!("expected a key, found `{c}`"))),
            None => return Err(self.error("expected a key, found end of file")),
        };
        Ok(Key { pos, name })
    }

    fn map(&mut self) -> Result<Vec<(Key, Node)>, SyntaxError> {
        let open = self.pos();
        self.expect('{')?;
        let mut entries = Vec::new();
        loop {
            self.skip_ws()?;
            if self.peek() == Some('}') {
                self.bump();
                return Ok(entries);
            }
            self.check_unclosed('{', open)?;
            let key = self.key()?;
            self.skip_ws()?;
            self.expect(':')?;
            self.skip_ws()?;
            let v = self.value()?;
            entries.push((key, v));
            self.skip_ws()?;
            match self.peek() {
                Some(',') => {
                    self.bump();
                }
                Some('}') => {}
                Some(c) => return Err(self.error(format!("expected `,` or `}}`, found `{c}`"))),
                None => return Err(self.error("unclosed `{`: expected `}`")),
            }
        }
    }

    fn list(&mut self) -> Result<Vec<Node>, SyntaxError> {
        let open = self.pos();
        self.expect('[')?;
        let mut items = Vec::new();
        loop {
            self.skip_ws()?;
            if self.peek() == Some(']') {
                self.bump();
                return Ok(items);
            }
            self.check_unclosed('[', open)?;
            items.push(self.value()?);
            self.skip_ws()?;
            match self.peek() {
                Some(',') => {
                    self.bump();
                }
                Some(']') => {}
                Some(c) => return Err(self.error(format!("expected `,` or `]`, found `{c}`"))),
                None => return Err(self.error("unclosed `[`: expected `]`")),
            }
        }
    }

    /// `( ... )`: a struct when the first item is `ident:`, else a tuple.
    fn paren(&mut self, name: Option<String>) -> Result<Value, SyntaxError> {
        let open = self.pos();
        self.expect('(')?;
        self.skip_ws()?;
        if self.peek() == Some(')') {
            self.bump();
            return Ok(Value::Struct {
                name,
                fields: Vec::new(),
            });
        }
        if self.looks_like_field() {
            let mut fields = Vec::new();
            loop {
                self.skip_ws()?;
                if self.peek() == Some(')') {
                    self.bump();
                    return Ok(Value::Struct { name, fields });
                }
                self.check_unclosed('(', open)?;
                let key = self.key()?;
                self.skip_ws()?;
                self.expect(':')?;
                self.skip_ws()?;
                let v = self.value()?;
                fields.push((key, v));
                self.skip_ws()?;
                match self.peek() {
                    Some(',') => {
                        self.bump();
                    }
                    Some(')') => {}
                    Some(c) => return Err(self.error(format!("expected `,` or `)`, found `{c}`"))),
                    None => return Err(self.error("unclosed `(`: expected `)`")),
                }
            }
        }
        let mut items = Vec::new();
        loop {
            self.skip_ws()?;
            if self.peek() == Some(')') {
                self.bump();
                return Ok(Value::Tuple { name, items });
            }
            self.check_unclosed('(', open)?;
            items.push(self.value()?);
            self.skip_ws()?;
            match self.peek() {
                Some(',') => {
                    self.bump();
                }
                Some(')') => {}
                Some(c) => return Err(self.error(format!("expected `,` or `)`, found `{c}`"))),
                None => return Err(self.error("unclosed `(`: expected `)`")),
            }
        }
    }

    /// A closing bracket of the wrong kind, or the end of the file, where
    /// an item was expected means the bracket opened at `open` was never
    /// closed; say so, pointing at both places.
    fn check_unclosed(&self, opener: char, open: Pos) -> Result<(), SyntaxError> {
        let closer = match opener {
            '(' => ')',
            '[' => ']',
            _ => '}',
        };
        match self.peek() {
            Some(c @ (')' | ']' | '}')) if c != closer => Err(self.error(format!(
                "found `{c}`, but the `{opener}` opened at {open} is not closed: add `{closer}` before it"
            ))),
            None => Err(SyntaxError {
                pos: open,
                message: format!("`{opener}` is never closed: expected `{closer}`"),
            }),
            _ => Ok(()),
        }
    }

    /// Looks ahead for `ident :` without consuming input.
    fn looks_like_field(&self) -> bool {
        let mut j = self.i;
        match self.chars.get(j) {
            Some(&c) if is_ident_start(c) => {}
            _ => return false,
        }
        while matches!(self.chars.get(j), Some(&c) if is_ident_continue(c)) {
            j += 1;
        }
        while matches!(self.chars.get(j), Some(c) if c.is_whitespace()) {
            j += 1;
        }
        self.chars.get(j) == Some(&':')
    }

    fn string(&mut self, quote: char) -> Result<String, SyntaxError> {
        let start = self.pos();
        self.bump();
        let mut s = String::new();
        loop {
            let Some(c) = self.bump() else {
                return Err(SyntaxError {
                    pos: start,
                    message: "unterminated string".into(),
                });
            };
            if c == quote {
                return Ok(s);
            }
            if c != '\\' {
                s.push(c);
                continue;
            }
            let esc_pos = self.pos();
            match self.bump() {
                Some('"') => s.push('"'),
                Some('\'') => s.push('\''),
                Some('\\') => s.push('\\'),
                Some('/') => s.push('/'),
                Some('b') => s.push('\u{8}'),
                Some('f') => s.push('\u{c}'),
                Some('n') => s.push('\n'),
                Some('r') => s.push('\r'),
                Some('t') => s.push('\t'),
                Some('0') => s.push('\0'),
                Some('u') => s.push(self.unicode_escape(esc_pos)?),
                Some(c) => {
                    return Err(SyntaxError {
                        pos: esc_pos,
                        message: format!("unknown escape `\\{c}`"),
                    })
                }
                None => {
                    return Err(SyntaxError {
                        pos: start,
                        message: "unterminated string".into(),
                    })
                }
            }
        }
    }

    fn hex4(&mut self, pos: Pos) -> Result<u32, SyntaxError> {
        let mut v = 0u32;
        for _ in 0..4 {
            let d = self
                .bump()
                .and_then(|c| c.to_digit(16))
                .ok_or(SyntaxError {
                    pos,
                    message: "bad \\u escape: expected 4 hex digits".into(),
                })?;
            v = v * 16 + d;
        }
        Ok(v)
    }

    fn unicode_escape(&mut self, pos: Pos) -> Result<char, SyntaxError> {
        // RON's `\u{1F600}` form.
        if self.peek() == Some('{') {
            self.bump();
            let mut v = 0u32;
            let mut n = 0;
            while let Some(c) = self.peek() {
                if c == '}' {
                    break;
                }
                let d = c.to_digit(16).ok_or(SyntaxError {
                    pos,
                    message: "bad \\u{...} escape".into(),
                })?;
                v = v.saturating_mul(16).saturating_add(d);
                n += 1;
                self.bump();
            }
            self.expect('}')?;
            if n == 0 {
                return Err(SyntaxError {
                    pos,
                    message: "empty \\u{} escape".into(),
                });
            }
            return char::from_u32(v).ok_or(SyntaxError {
                pos,
                message: "\\u escape is not a valid character".into(),
            });
        }
        let hi = self.hex4(pos)?;
        // JSON spells astral characters as a UTF-16 surrogate pair.
        if (0xD800..0xDC00).contains(&hi) {
            if self.peek() == Some('\\') && self.peek_at(1) == Some('u') {
                self.bump();
                self.bump();
                let lo = self.hex4(pos)?;
                if (0xDC00..0xE000).contains(&lo) {
                    let c = 0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00);
                    if let Some(ch) = char::from_u32(c) {
                        return Ok(ch);
                    }
                }
            }
            return Err(SyntaxError {
                pos,
                message: "unpaired UTF-16 surrogate in \\u escape".into(),
            });
        }
        char::from_u32(hi).ok_or(SyntaxError {
            pos,
            message: "\\u escape is not a valid character".into(),
        })
    }

    fn number(&mut self) -> Result<Value, SyntaxError> {
        let start = self.pos();
        let mut s = String::new();
        if let Some(c @ ('-' | '+')) = self.peek() {
            s.push(c);
            self.bump();
        }
        // Words after a sign: -inf, +inf.
        if self.peek().is_some_and(is_ident_start) {
            let w = self.ident();
            return match w.as_str() {
                "inf" if s == "-" => Ok(Value::Float(f64::NEG_INFINITY)),
                "inf" => Ok(Value::Float(f64::INFINITY)),
                _ => Err(SyntaxError {
                    pos: start,
                    message: format!("invalid number `{s}{w}`"),
                }),
            };
        }
        let mut is_float = false;
        while let Some(c) = self.peek() {
            match c {
                '0'..='9' | '_' => {}
                '.' | 'e' | 'E' => is_float = true,
                '-' | '+' if s.ends_with(['e', 'E']) => {}
                _ => break,
            }
            s.push(c);
            self.bump();
        }
        let clean: String = s.chars().filter(|&c| c != '_').collect();
        let bad = || SyntaxError {
            pos: start,
            message: format!("invalid number `{s}`"),
        };
        if is_float {
            clean.parse::<f64>().map(Value::Float).map_err(|_| bad())
        } else {
            match clean.parse::<i128>() {
                Ok(i) => Ok(Value::Int(i)),
                // Integers too large for i128 still read as numbers.
                Err(_) => clean.parse::<f64>().map(Value::Float).map_err(|_| bad()),
            }
        }
    }
}

fn is_ident_start(c: char) -> bool {
    c.is_alphabetic() || c == '_'
}

fn is_ident_continue(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_with_positions() {
        let n = parse("{\n  \"a\": [1, 2.5, \"x\"],\n  \"b\": null\n}").expect("parses");
        let entries = n.value.entries().expect("map");
        assert_eq!(entries[0].0.pos, Pos { line: 2, col: 3 });
        assert_eq!(entries[1].1.pos, Pos { line: 3, col: 8 });
        assert_eq!(entries[1].1.value, Value::Null);
    }

    #[test]
    fn ron_structs_tuples_comments() {
        let text = "// c\n(nodes: { \"a\": LoadImage(image: \"x.png\", /* n /* nested */ */ ), \"b\": Foo(1, Some(2)) },)";
        let n = parse(text).expect("parses");
        let nodes = n.value.get("nodes").expect("nodes");
        let a = nodes.value.get("a").expect("a");
        assert!(matches!(&a.value, Value::Struct { name: Some(n), .. } if n == "LoadImage"));
        let b = nodes.value.get("b").expect("b");
        match &b.value {
            Value::Tuple { items, .. } => assert_eq!(items[1].value, Value::Int(2)),
            v => panic!("{v:?}"),
        }
    }

    #[test]
    fn big_seed_and_escapes() {
        let n = parse("[18446744073709551615, \"\\u00e9\\ud83d\\ude00\", -1e3]").expect("parses");
        match n.value {
            Value::List(items) => {
                assert_eq!(items[0].value, Value::Int(u64::MAX as i128));
                assert_eq!(items[1].value, Value::Str("é😀".into()));
                assert_eq!(items[2].value, Value::Float(-1000.0));
            }
            v => panic!("{v:?}"),
        }
    }

    #[test]
    fn errors_have_positions() {
        let e = parse("{\n \"a\": [1, 2\n}").expect_err("fails");
        assert_eq!(e.pos.line, 3);
        let e = parse("{\"a\": \"open").expect_err("fails");
        assert_eq!(e.pos, Pos { line: 1, col: 7 });
        assert!(parse(&"[".repeat(10_000)).is_err());
    }
}
