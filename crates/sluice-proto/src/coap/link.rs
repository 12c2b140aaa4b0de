//! CoRE Link Format (RFC 6690) writer: what `/.well-known/core` answers with.
//!
//! Owns: serialising links and their attributes. Does not own: which resources exist.

/// A link attribute value.
#[derive(Debug, Clone, Copy)]
pub enum Attr<'a> {
    /// Written quoted (`rt="core.ps"`); `"` and `\` are escaped.
    Quoted(&'a str),
    /// Written bare (`ct=40`).
    Token(&'a str),
    /// Written as a number (`ct=40`).
    Uint(u32),
}

/// Builds a link-format document.
#[derive(Debug, Default)]
pub struct LinkWriter {
    out: String,
}

impl LinkWriter {
    pub fn new() -> LinkWriter {
        LinkWriter::default()
    }

    /// Add the link `</path>` (segments joined by `/`) with `attrs`.
    pub fn link(&mut self, segments: &[&str], attrs: &[(&str, Attr<'_>)]) -> &mut Self {
        if !self.out.is_empty() {
            self.out.push(',');
        }
        self.out.push_str("</");
        for (i, s) in segments.iter().enumerate() {
            if i > 0 {
                self.out.push('/');
            }
            for c in s.chars() {
                // A URI reference: keep it from closing the link or the document.
                if matches!(c, '>' | ',' | ';' | '"' | ' ') || c.is_control() {
                    self.out.push_str(&format!("%{:02X}", c as u32 & 0xFF));
                } else {
                    self.out.push(c);
                }
            }
        }
        self.out.push('>');
        for (name, value) in attrs {
            self.out.push(';');
            self.out.push_str(name);
            self.out.push('=');
            match value {
                Attr::Quoted(v) => {
                    self.out.push('"');
                    for c in v.chars() {
                        if c == '"' || c == '\\' {
                            self.out.push('\\');
                        }
                        self.out.push(c);
                    }
                    self.out.push('"');
                }
                Attr::Token(v) => self.out.push_str(v),
                Attr::Uint(n) => self.out.push_str(&n.to_string()),
            }
        }
        self
    }

    pub fn finish(self) -> String {
        self.out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn links_are_comma_separated_with_their_attributes() {
        let mut w = LinkWriter::new();
        w.link(
            &["ps"],
            &[("rt", Attr::Quoted("core.ps")), ("ct", Attr::Uint(40))],
        )
        .link(&["cloud"], &[("title", Attr::Quoted("a \"proxy\""))])
        .link(&["odd>seg"], &[("if", Attr::Token("core.b"))]);
        assert_eq!(
            w.finish(),
            "</ps>;rt=\"core.ps\";ct=40,</cloud>;title=\"a \\\"proxy\\\"\",</odd%3Eseg>;if=core.b"
        );
    }
}
