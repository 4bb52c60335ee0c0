//! llama.cpp's `n_indent` for code infill: once the output has a newline, a later line whose
//! first character other than space or tab comes after fewer than `n_indent` of them ends
//! the output right before that character (its indentation is kept, as llama.cpp keeps it;
//! a blank line counts as such a line). Streams need no hold-back: text before the cut is
//! final whatever comes next.

#[derive(Debug, Clone)]
pub struct IndentLimit {
    min: usize,
    /// Inside the indentation of a line that follows a newline.
    at_line_start: bool,
    indent: usize,
    stopped: bool,
}

impl IndentLimit {
    /// `min == 0` never stops.
    pub fn new(min: usize) -> Self {
        Self {
            min,
            at_line_start: false,
            indent: 0,
            stopped: false,
        }
    }

    /// The part of `text` that stays, and whether the output ends here.
    pub fn push<'a>(&mut self, text: &'a str) -> (&'a str, bool) {
        if self.stopped {
            return ("", true);
        }
        if self.min == 0 {
            return (text, false);
        }
        for (i, c) in text.char_indices() {
            if self.at_line_start {
                if c == ' ' || c == '\t' {
                    self.indent += 1;
                    continue;
                }
                if self.indent < self.min {
                    self.stopped = true;
                    return (&text[..i], true);
                }
                self.at_line_start = false;
            }
            if c == '\n' {
                self.at_line_start = true;
                self.indent = 0;
            }
        }
        (text, false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(min: usize, deltas: &[&str]) -> (String, bool) {
        let mut limit = IndentLimit::new(min);
        let mut out = String::new();
        for d in deltas {
            let (keep, stopped) = limit.push(d);
            out.push_str(keep);
            if stopped {
                return (out, true);
            }
        }
        (out, false)
    }

    #[test]
    fn a_less_indented_line_ends_the_output_before_its_text() {
        let text = "x = 1\n    y = 2\n  z = 3\n";
        assert_eq!(run(4, &[text]), ("x = 1\n    y = 2\n  ".into(), true));
        // The same wherever the deltas split.
        for cut in 0..text.len() {
            assert_eq!(
                run(4, &[&text[..cut], &text[cut..]]),
                ("x = 1\n    y = 2\n  ".into(), true),
                "{cut}"
            );
        }
        assert_eq!(run(2, &[text]), (text.into(), false));
        assert_eq!(run(0, &["a\nb\n"]), ("a\nb\n".into(), false));
    }

    #[test]
    fn the_first_line_is_free_and_a_blank_line_stops() {
        assert_eq!(run(4, &["return x"]), ("return x".into(), false));
        assert_eq!(run(4, &["a\n\n    b"]), ("a\n".into(), true));
        assert_eq!(run(1, &["a\n\tb\nc"]), ("a\n\tb\n".into(), true));
    }
}
