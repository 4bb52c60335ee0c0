//! An incremental JSON checker: fed one character at a time, it says at once when the text
//! stops being the prefix of a JSON value, and where the value ends. The tool-call parser
//! streams a call's arguments with it: every character it passes on is known to keep them
//! valid JSON so far, and the closing brace is told apart from braces inside strings.

/// What one more character did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Feed {
    /// Part of the value, which goes on.
    More,
    /// Part of the value, which it completes.
    Ended,
    /// Not part of the value: the value (a number) had ended before it.
    EndedBefore,
    /// The text is no longer the prefix of any JSON value.
    Invalid,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Container {
    /// In an object, expecting: a key or `}` (just opened), a key (after `,`), `:`, a value,
    /// `,` or `}`.
    Object(ObjectAt),
    /// In an array, expecting a value or `]` (just opened), a value (after `,`), `,` or `]`.
    Array(ArrayAt),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ObjectAt {
    KeyOrEnd,
    Key,
    Colon,
    Value,
    CommaOrEnd,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ArrayAt {
    ValueOrEnd,
    Value,
    CommaOrEnd,
}

/// Where a number is, by JSON's grammar.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Number {
    Minus,
    Zero,
    Int,
    Dot,
    Frac,
    E,
    ESign,
    Exp,
}

impl Number {
    /// Whether the number may end here.
    fn complete(self) -> bool {
        matches!(
            self,
            Number::Zero | Number::Int | Number::Frac | Number::Exp
        )
    }

    fn next(self, c: char) -> Option<Number> {
        use Number::*;
        let digit = c.is_ascii_digit();
        match (self, c) {
            (Minus, '0') => Some(Zero),
            (Minus, _) if digit => Some(Int),
            (Int, _) if digit => Some(Int),
            (Zero | Int, '.') => Some(Dot),
            (Dot | Frac, _) if digit => Some(Frac),
            (Zero | Int | Frac, 'e' | 'E') => Some(E),
            (E, '+' | '-') => Some(ESign),
            (E | ESign | Exp, _) if digit => Some(Exp),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scalar {
    None,
    /// In a string (`key`: an object key); `escape`: after a backslash; `hex`: digits of a
    /// `\u` escape still to come.
    String {
        key: bool,
        escape: bool,
        hex: u8,
    },
    Number(Number),
    /// The rest of `true`, `false` or `null`.
    Literal(&'static str),
}

/// The checker's state: open containers and the scalar being read.
#[derive(Debug, Clone)]
pub struct JsonPrefix {
    stack: Vec<Container>,
    scalar: Scalar,
    started: bool,
    ended: bool,
}

impl Default for JsonPrefix {
    fn default() -> Self {
        Self::new()
    }
}

impl JsonPrefix {
    pub fn new() -> Self {
        Self {
            stack: Vec::new(),
            scalar: Scalar::None,
            started: false,
            ended: false,
        }
    }

    /// Whether the text so far is a whole value (a number needs no more characters).
    pub fn complete(&self) -> bool {
        self.ended
            || (self.stack.is_empty() && matches!(self.scalar, Scalar::Number(n) if n.complete()))
    }

    pub fn feed(&mut self, c: char) -> Feed {
        if self.ended {
            return Feed::EndedBefore;
        }
        match self.scalar {
            Scalar::String { key, escape, hex } => return self.in_string(c, key, escape, hex),
            Scalar::Literal(rest) => {
                return match rest.strip_prefix(c) {
                    Some("") => {
                        self.scalar = Scalar::None;
                        self.value_done()
                    }
                    Some(more) => {
                        self.scalar = Scalar::Literal(more);
                        Feed::More
                    }
                    None => Feed::Invalid,
                }
            }
            Scalar::Number(n) => match n.next(c) {
                Some(next) => {
                    self.scalar = Scalar::Number(next);
                    return Feed::More;
                }
                None if n.complete() => {
                    self.scalar = Scalar::None;
                    if self.value_done() == Feed::Ended {
                        return Feed::EndedBefore;
                    }
                    // The character after the number belongs to its container: go on below.
                }
                None => return Feed::Invalid,
            },
            Scalar::None => {}
        }
        if matches!(c, ' ' | '\t' | '\n' | '\r') {
            return Feed::More;
        }
        match self.stack.last().copied() {
            None if self.started => Feed::Invalid,
            None => {
                self.started = true;
                self.value_start(c)
            }
            Some(Container::Object(at)) => self.in_object(at, c),
            Some(Container::Array(at)) => self.in_array(at, c),
        }
    }

    fn set_top(&mut self, container: Container) {
        if let Some(top) = self.stack.last_mut() {
            *top = container;
        }
    }

    fn in_object(&mut self, at: ObjectAt, c: char) -> Feed {
        match (at, c) {
            (ObjectAt::KeyOrEnd | ObjectAt::Key, '"') => {
                self.set_top(Container::Object(ObjectAt::Colon));
                self.scalar = Scalar::String {
                    key: true,
                    escape: false,
                    hex: 0,
                };
                Feed::More
            }
            (ObjectAt::KeyOrEnd | ObjectAt::CommaOrEnd, '}') => {
                self.stack.pop();
                self.value_done()
            }
            (ObjectAt::Colon, ':') => {
                self.set_top(Container::Object(ObjectAt::Value));
                Feed::More
            }
            (ObjectAt::Value, _) => self.value_start(c),
            (ObjectAt::CommaOrEnd, ',') => {
                self.set_top(Container::Object(ObjectAt::Key));
                Feed::More
            }
            _ => Feed::Invalid,
        }
    }

    fn in_array(&mut self, at: ArrayAt, c: char) -> Feed {
        match (at, c) {
            (ArrayAt::ValueOrEnd | ArrayAt::CommaOrEnd, ']') => {
                self.stack.pop();
                self.value_done()
            }
            (ArrayAt::ValueOrEnd | ArrayAt::Value, _) => self.value_start(c),
            (ArrayAt::CommaOrEnd, ',') => {
                self.set_top(Container::Array(ArrayAt::Value));
                Feed::More
            }
            _ => Feed::Invalid,
        }
    }

    fn in_string(&mut self, c: char, key: bool, escape: bool, hex: u8) -> Feed {
        let next = |escape, hex| Scalar::String { key, escape, hex };
        if hex > 0 {
            if !c.is_ascii_hexdigit() {
                return Feed::Invalid;
            }
            self.scalar = next(false, hex - 1);
            return Feed::More;
        }
        if escape {
            return match c {
                '"' | '\\' | '/' | 'b' | 'f' | 'n' | 'r' | 't' => {
                    self.scalar = next(false, 0);
                    Feed::More
                }
                'u' => {
                    self.scalar = next(false, 4);
                    Feed::More
                }
                _ => Feed::Invalid,
            };
        }
        match c {
            '"' => {
                self.scalar = Scalar::None;
                if key {
                    // The container already expects the colon.
                    Feed::More
                } else {
                    self.value_done()
                }
            }
            '\\' => {
                self.scalar = next(true, 0);
                Feed::More
            }
            c if (c as u32) < 0x20 => Feed::Invalid,
            _ => Feed::More,
        }
    }

    /// A value starts with `c` where one is expected.
    fn value_start(&mut self, c: char) -> Feed {
        // The container now expects what follows the value.
        match self.stack.last().copied() {
            Some(Container::Object(_)) => self.set_top(Container::Object(ObjectAt::CommaOrEnd)),
            Some(Container::Array(_)) => self.set_top(Container::Array(ArrayAt::CommaOrEnd)),
            None => {}
        }
        match c {
            '{' => self.stack.push(Container::Object(ObjectAt::KeyOrEnd)),
            '[' => self.stack.push(Container::Array(ArrayAt::ValueOrEnd)),
            '"' => {
                self.scalar = Scalar::String {
                    key: false,
                    escape: false,
                    hex: 0,
                }
            }
            '-' => self.scalar = Scalar::Number(Number::Minus),
            '0' => self.scalar = Scalar::Number(Number::Zero),
            '1'..='9' => self.scalar = Scalar::Number(Number::Int),
            't' => self.scalar = Scalar::Literal("rue"),
            'f' => self.scalar = Scalar::Literal("alse"),
            'n' => self.scalar = Scalar::Literal("ull"),
            _ => return Feed::Invalid,
        }
        Feed::More
    }

    /// A value just ended: the whole text, if it was the outermost one.
    fn value_done(&mut self) -> Feed {
        if self.stack.is_empty() {
            self.ended = true;
            Feed::Ended
        } else {
            Feed::More
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `text`; returns the byte offset where the value ended (exclusive) or the first
    /// invalid character, and whether it was valid.
    fn run(text: &str) -> (Option<usize>, bool) {
        let mut p = JsonPrefix::new();
        for (i, c) in text.char_indices() {
            match p.feed(c) {
                Feed::More => {}
                Feed::Ended => return (Some(i + c.len_utf8()), true),
                Feed::EndedBefore => return (Some(i), true),
                Feed::Invalid => return (Some(i), false),
            }
        }
        (p.complete().then_some(text.len()), true)
    }

    #[test]
    fn values_end_where_json_says() {
        for (text, end) in [
            (r#"{"a": [1, -2.5e+3, true, null, "x\"}"]} tail"#, 39),
            (r#"{}"#, 2),
            ("  [ ]x", 5),
            ("\"\\u00e9\\n\" ", 10),
            ("12 ", 2),
            ("0}", 1),
            ("false", 5),
            ("{\"k\":{\"n\":{}}}}", 14),
            // A number ends at the first character that cannot continue it.
            ("01", 1),
            ("1 2", 1),
        ] {
            assert_eq!(run(text), (Some(end), true), "{text}");
        }
        // Prefixes that are not yet whole.
        for text in [r#"{"a": "#, "[1,", "\"abc", "tr", "-", "1.", "1e", "{\"a\""] {
            assert_eq!(run(text), (None, true), "{text}");
        }
    }

    #[test]
    fn invalid_text_is_caught_at_its_first_bad_character() {
        for (text, at) in [
            (r#"{"a" 1}"#, 5),
            ("{a}", 1),
            ("[1,]", 3),
            ("tru ", 3),
            ("\"\\x\"", 2),
            ("\"a\nb\"", 2),
            ("{\"a\":1,}", 7),
            ("-a", 1),
            ("\"\\u12g4\"", 5),
        ] {
            assert_eq!(run(text), (Some(at), false), "{text}");
        }
    }
}
