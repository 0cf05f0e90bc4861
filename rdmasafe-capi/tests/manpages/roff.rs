//! Writing roff (man(7) macros only): escaping, inline Markdown (code
//! spans, emphasis, `name(3)` references), blocks.

use crate::doc::{sentences, Block};

/// Names set in italics when quoted as code (the parameters of the
/// function being described); other code spans are bold.
#[derive(Default, Clone)]
pub struct Ctx {
    pub params: Vec<String>,
}

fn push_char(out: &mut String, c: char, prev: Option<char>, code: bool) {
    match c {
        '\\' => out.push_str("\\e"),
        // a minus sign (start of a word, or anywhere in code), else a hyphen
        '-' if code || !prev.is_some_and(|p| p.is_alphanumeric()) => out.push_str("\\-"),
        '^' => out.push_str("\\(ha"),
        '~' => out.push_str("\\(ti"),
        '\'' if code => out.push_str("\\(aq"),
        '`' => out.push_str("\\(ga"),
        c if !c.is_ascii() => out.push_str(&format!("\\[u{:04X}]", c as u32)),
        c => out.push(c),
    }
}

/// Escapes plain text (no Markdown).
pub fn escape(s: &str) -> String {
    let mut out = String::new();
    let mut prev = None;
    for c in s.chars() {
        push_char(&mut out, c, prev, false);
        prev = Some(c);
    }
    out
}

/// Escapes text for a quoted macro argument.
pub fn arg(s: &str) -> String {
    format!("\"{}\"", escape(s).replace('"', "\\(dq"))
}

fn escape_code(s: &str) -> String {
    let mut out = String::new();
    let mut prev = None;
    for c in s.chars() {
        push_char(&mut out, c, prev, true);
        prev = Some(c);
    }
    out
}

fn ident_at(chars: &[char], i: usize) -> usize {
    let mut j = i;
    while j < chars.len() && (chars[j].is_ascii_alphanumeric() || chars[j] == '_') {
        j += 1;
    }
    j
}

/// Converts one line of Markdown inline text to roff.
pub fn inline(s: &str, ctx: &Ctx) -> String {
    let chars: Vec<char> = s.chars().collect();
    let mut out = String::new();
    let mut i = 0;
    let mut prev: Option<char> = None;
    while i < chars.len() {
        let c = chars[i];
        // `code`
        if c == '`' {
            if let Some(len) = chars[i + 1..].iter().position(|&x| x == '`') {
                let code: String = chars[i + 1..i + 1 + len].iter().collect();
                let bare = code.trim_start_matches(['*', '&']).trim_end_matches("()");
                let font = if ctx.params.iter().any(|p| p == bare) { "\\fI" } else { "\\fB" };
                out.push_str(font);
                out.push_str(&escape_code(&code));
                out.push_str("\\fR");
                i += len + 2;
                prev = Some('`');
                continue;
            }
        }
        // **strong**
        if c == '*' && chars.get(i + 1) == Some(&'*') {
            let rest: String = chars[i + 2..].iter().collect();
            if let Some(end) = rest.find("**").filter(|&e| e > 0) {
                out.push_str("\\fB");
                out.push_str(&inline(&rest[..end], ctx));
                out.push_str("\\fR");
                i += 2 + rest[..end].chars().count() + 2;
                prev = Some('*');
                continue;
            }
        }
        // *emphasis*: opens before a non-space, closes after one, not inside a word
        if c == '*'
            && !prev.is_some_and(|p| p.is_alphanumeric())
            && chars.get(i + 1).is_some_and(|n| !n.is_whitespace() && *n != '*')
        {
            let close = (i + 2..chars.len()).find(|&k| {
                chars[k] == '*'
                    && !chars[k - 1].is_whitespace()
                    && !chars.get(k + 1).is_some_and(|n| n.is_alphanumeric())
            });
            if let Some(k) = close {
                let inner: String = chars[i + 1..k].iter().collect();
                out.push_str("\\fI");
                out.push_str(&inline(&inner, ctx));
                out.push_str("\\fR");
                i = k + 1;
                prev = Some('*');
                continue;
            }
        }
        // [text](target), or a rustdoc link [`item`] (kept as its text)
        if c == '[' {
            let rest: String = chars[i..].iter().collect();
            if let Some(close) = rest.find(']') {
                let after = rest[close + 1..].chars().next();
                let inner = &rest[1..close];
                let code = inner.len() > 2 && inner.starts_with('`') && inner.ends_with('`');
                if code && !matches!(after, Some('(') | Some(':') | Some('[')) {
                    out.push_str(&inline(inner, ctx));
                    i += rest[..close + 1].chars().count();
                    prev = Some(']');
                    continue;
                }
            }
            if let Some(mid) = rest.find("](") {
                if let Some(end) = rest[mid..].find(')') {
                    let text = &rest[1..mid];
                    let target = &rest[mid + 2..mid + end];
                    out.push_str(&inline(text, ctx));
                    if !target.starts_with('#') {
                        out.push_str(" <");
                        out.push_str(&escape(target));
                        out.push('>');
                    }
                    i += rest[..mid + end + 1].chars().count();
                    prev = Some(')');
                    continue;
                }
            }
        }
        // name(3): a reference to a man page
        if (c.is_ascii_alphabetic() || c == '_') && !prev.is_some_and(|p| p.is_ascii_alphanumeric() || p == '_') {
            let j = ident_at(&chars, i);
            if chars.get(j) == Some(&'(')
                && chars.get(j + 1).is_some_and(|d| d.is_ascii_digit())
                && chars.get(j + 2) == Some(&')')
            {
                let name: String = chars[i..j].iter().collect();
                out.push_str(&format!("\\fB{}\\fR({})", escape(&name), chars[j + 1]));
                i = j + 3;
                prev = Some(')');
                continue;
            }
            let word: String = chars[i..j].iter().collect();
            out.push_str(&escape(&word));
            prev = chars.get(j - 1).copied();
            i = j;
            continue;
        }
        push_char(&mut out, c, prev, false);
        prev = Some(c);
        i += 1;
    }
    out
}

/// A text line that cannot be read as a request.
fn guard(line: String) -> String {
    if line.starts_with('.') || line.starts_with('\'') {
        format!("\\&{line}")
    } else {
        line
    }
}

/// A paragraph as roff text lines: one sentence per line.
pub fn para_lines(p: &str, ctx: &Ctx) -> String {
    let mut out = String::new();
    for s in sentences(p) {
        out.push_str(&guard(inline(&s, ctx)));
        out.push('\n');
    }
    out
}

/// Builds a page.
pub struct Page {
    pub out: String,
    /// At the start of a section or list item: no `.PP` needed.
    fresh: bool,
}

impl Page {
    pub fn new(comment: &[&str]) -> Page {
        let mut out = String::new();
        for c in comment {
            out.push_str(&format!(".\\\" {c}\n"));
        }
        Page { out, fresh: true }
    }
    pub fn raw(&mut self, s: &str) {
        self.out.push_str(s);
        if !s.ends_with('\n') {
            self.out.push('\n');
        }
    }
    pub fn th(&mut self, title: &str, section: &str, source: &str, manual: &str) {
        self.raw(&format!(".TH {} {section} \"\" {} {}", escape(title), arg(source), arg(manual)));
        // identifiers everywhere: no hyphenation, ragged right
        self.raw(".nh");
        self.raw(".ad l");
    }
    pub fn sh(&mut self, title: &str) {
        self.raw(&format!(".SH {}", arg(title)));
        self.fresh = true;
    }
    pub fn ss(&mut self, title: &str) {
        self.raw(&format!(".SS {}", arg(title)));
        self.fresh = true;
    }
    /// Starts a paragraph of already-converted lines.
    pub fn para_roff(&mut self, lines: &str) {
        if !self.fresh {
            self.raw(".PP");
        }
        self.raw(lines);
        self.fresh = false;
    }
    pub fn para(&mut self, text: &str, ctx: &Ctx) {
        self.para_roff(&para_lines(text, ctx));
    }
    /// A tagged paragraph: `tag` is a roff line (e.g. `.B EINVAL`).
    pub fn tagged(&mut self, tag: &str, body: &[Block], ctx: &Ctx) {
        self.raw(".TP");
        self.raw(tag);
        let mut first = true;
        for b in body {
            match b {
                Block::Para(p) => {
                    if !first {
                        self.raw(".IP");
                    }
                    self.raw(&para_lines(p, ctx));
                }
                other => {
                    self.raw(".RS");
                    self.fresh = true;
                    self.block(other, ctx);
                    self.raw(".RE");
                }
            }
            first = false;
        }
        self.fresh = false;
    }
    pub fn block(&mut self, b: &Block, ctx: &Ctx) {
        match b {
            Block::Para(p) => self.para(p, ctx),
            Block::List(items) => {
                for it in items {
                    self.raw(".IP \\(bu 2");
                    self.raw(&para_lines(it, ctx));
                }
                self.fresh = false;
            }
            Block::Code(c) => {
                if !self.fresh {
                    self.raw(".PP");
                }
                self.code(c);
            }
            Block::Heading(h) => self.ss(h),
            Block::Roff(r) => {
                self.raw(r);
                self.fresh = false;
            }
        }
    }
    /// Verbatim lines, indented.
    pub fn code(&mut self, text: &str) {
        self.raw(".RS 4");
        self.raw(".nf");
        for l in text.lines() {
            let l = if l.is_empty() { "\\&".to_string() } else { guard(escape_code(l)) };
            self.raw(&l);
        }
        self.raw(".fi");
        self.raw(".RE");
        self.fresh = false;
    }
    pub fn blocks(&mut self, bs: &[Block], ctx: &Ctx) {
        for b in bs {
            self.block(b, ctx);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inline_markup() {
        let ctx = Ctx { params: vec!["event".into()] };
        assert_eq!(
            inline("`*event` and `rdma_ack_cm_event` -1", &ctx),
            "\\fI*event\\fR and \\fBrdma_ack_cm_event\\fR \\-1"
        );
        assert_eq!(inline("see rdmasafe(7), non-blocking", &ctx), "see \\fBrdmasafe\\fR(7), non-blocking");
        assert_eq!(inline("a **b** *c* x * y", &ctx), "a \\fBb\\fR \\fIc\\fR x * y");
        assert_eq!(inline("2^(i-1) \u{2014}", &ctx), "2\\(ha(i-1) \\[u2014]");
        assert_eq!(guard(".x".into()), "\\&.x");
        assert_eq!(
            inline("see [`CqLoop`] and [the guide](docs/x.md)", &ctx),
            "see \\fBCqLoop\\fR and the guide <docs/x.md>"
        );
        assert_eq!(inline("`wc[0..n]` [0..n] wc[1]", &ctx), "\\fBwc[0..n]\\fR [0..n] wc[1]");
    }
}
