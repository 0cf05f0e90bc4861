//! A small reader for the C header cbindgen writes (include/rdmasafe.h): doc
//! comments, `#define` constants, structs / unions / enums, typedefs and
//! function prototypes. Not a C parser: it knows the shapes a C API header
//! declares, and fails loudly on a statement it does not understand, so a
//! header change the generator cannot render stops the test instead of
//! silently dropping a page.

#[derive(Debug, Clone)]
pub struct Const {
    pub name: String,
    pub value: String,
    pub doc: String,
}

/// A struct or union member, or an enum variant.
#[derive(Debug, Clone)]
pub struct Field {
    /// The declaration as written, whitespace normalised, without `;` / `,`.
    pub decl: String,
    pub name: String,
    pub doc: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `struct x;`
    Opaque,
    /// `struct x { ... };` or `union x { ... };`
    Aggregate,
    /// `enum x { ... };`
    Enum,
    /// `typedef R (*name)(params);`
    FnPointer,
    /// `typedef T name;`
    Alias,
}

#[derive(Debug, Clone)]
pub struct Type {
    /// How C code names it: `struct rdmasafe_cm_counters`, `rdmasafe_wc_cb`.
    pub name: String,
    pub kind: Kind,
    /// The declaration line (`typedef ...;`, `struct x;`), or for a type
    /// with a body its head (`struct x`).
    pub decl: String,
    pub fields: Vec<Field>,
    /// Parameters of a function-pointer typedef.
    pub params: Vec<Param>,
    pub doc: String,
}

/// One parameter: `before` + `name` + `after`, e.g. `struct ibv_cq *` +
/// `cq` + `` or `uint64_t` + `buckets` + `[16]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Param {
    pub before: String,
    pub name: String,
    pub after: String,
}

impl Param {
    /// The text between the type and the name: nothing after `*`, a space
    /// otherwise.
    pub fn joiner(&self) -> &'static str {
        if self.name.is_empty() || self.before.ends_with('*') || self.before.ends_with('(') {
            ""
        } else {
            " "
        }
    }
    pub fn text(&self) -> String {
        format!("{}{}{}{}", self.before, self.joiner(), self.name, self.after)
    }
}

#[derive(Debug, Clone)]
pub struct Function {
    pub name: String,
    /// Return type, e.g. `int`, `const char *`.
    pub ret: String,
    pub params: Vec<Param>,
    pub doc: String,
}

impl Function {
    /// The prototype on one line, e.g. `int f(int a, int b);`.
    pub fn prototype(&self) -> String {
        format!("{}{}({});", ret_prefix(&self.ret), self.name, params_text(&self.params))
    }
    pub fn param_names(&self) -> Vec<String> {
        self.params.iter().filter(|p| !p.name.is_empty()).map(|p| p.name.clone()).collect()
    }
}

/// `int ` or `const char *` (no space after a `*`).
pub fn ret_prefix(ret: &str) -> String {
    if ret.ends_with('*') {
        ret.to_string()
    } else {
        format!("{ret} ")
    }
}

pub fn params_text(params: &[Param]) -> String {
    if params.is_empty() {
        return "void".into();
    }
    params.iter().map(Param::text).collect::<Vec<_>>().join(", ")
}

#[derive(Debug, Default)]
pub struct Header {
    pub consts: Vec<Const>,
    pub types: Vec<Type>,
    pub functions: Vec<Function>,
}

impl Header {
    pub fn function(&self, name: &str) -> Option<&Function> {
        self.functions.iter().find(|f| f.name == name)
    }
}

// ------------------------------------------------------------------ lexer

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Doc(String),
    Pre(String),
    Text(String),
    Open,
    Close,
    Semi,
}

/// The text of a `/** ... */` comment: each line without its leading
/// ` * `, leading and trailing blank lines dropped.
fn clean_doc(body: &str) -> String {
    let mut lines: Vec<String> = body
        .lines()
        .map(|l| {
            let t = l.trim_start();
            let t = t.strip_prefix('*').unwrap_or(t);
            let t = t.strip_prefix(' ').unwrap_or(t);
            t.trim_end().to_string()
        })
        .collect();
    while lines.first().is_some_and(|l| l.is_empty()) {
        lines.remove(0);
    }
    while lines.last().is_some_and(|l| l.is_empty()) {
        lines.pop();
    }
    lines.join("\n")
}

/// Removes `/* */` and `//` comments from a preprocessor line.
fn strip_comments(line: &str) -> String {
    let mut out = String::new();
    let mut rest = line;
    loop {
        let block = rest.find("/*");
        let slash = rest.find("//");
        match (block, slash) {
            (Some(b), s) if s.is_none_or(|s| b < s) => {
                out.push_str(&rest[..b]);
                match rest[b + 2..].find("*/") {
                    Some(e) => rest = &rest[b + 2 + e + 2..],
                    None => return out.trim().to_string(),
                }
            }
            (_, Some(s)) => {
                out.push_str(&rest[..s]);
                return out.trim().to_string();
            }
            _ => {
                out.push_str(rest);
                return out.trim().to_string();
            }
        }
    }
}

fn lex(src: &str) -> Result<Vec<Tok>, String> {
    let mut toks = Vec::new();
    let mut text = String::new();
    let mut i = 0;
    let mut line_blank = true; // only whitespace so far on this line
    let flush = |text: &mut String, toks: &mut Vec<Tok>| {
        if !text.trim().is_empty() {
            toks.push(Tok::Text(std::mem::take(text)));
        } else {
            text.clear();
        }
    };
    while i < src.len() {
        let rest = &src[i..];
        if (rest.starts_with("/**") && !rest.starts_with("/**/")) || rest.starts_with("/*!") {
            flush(&mut text, &mut toks);
            let end = rest[3..].find("*/").ok_or("unterminated doc comment")?;
            toks.push(Tok::Doc(clean_doc(&rest[3..3 + end])));
            i += 3 + end + 2;
            continue;
        }
        if let Some(body) = rest.strip_prefix("/*") {
            let end = body.find("*/").ok_or("unterminated comment")?;
            i += 2 + end + 2;
            continue;
        }
        if rest.starts_with("///") || rest.starts_with("//!") {
            flush(&mut text, &mut toks);
            let end = rest.find('\n').unwrap_or(rest.len());
            let line = rest[3..end].strip_prefix(' ').unwrap_or(&rest[3..end]).trim_end().to_string();
            match toks.last_mut() {
                Some(Tok::Doc(d)) => {
                    d.push('\n');
                    d.push_str(&line);
                }
                _ => toks.push(Tok::Doc(line)),
            }
            i += end;
            continue;
        }
        if rest.starts_with("//") {
            i += rest.find('\n').unwrap_or(rest.len());
            continue;
        }
        let c = rest.chars().next().unwrap();
        if c == '#' && line_blank {
            flush(&mut text, &mut toks);
            let mut line = String::new();
            let mut j = 0;
            let bytes = rest.as_bytes();
            while j < bytes.len() {
                if bytes[j] == b'\\' && bytes.get(j + 1) == Some(&b'\n') {
                    line.push(' ');
                    j += 2;
                    continue;
                }
                if bytes[j] == b'\n' {
                    break;
                }
                j += 1;
                line.push(bytes[j - 1] as char);
            }
            toks.push(Tok::Pre(strip_comments(&line)));
            i += j;
            continue;
        }
        if c == '"' || c == '\'' {
            // a literal: copy it through, escapes included
            let mut j = 1;
            let b = rest.as_bytes();
            while j < b.len() && b[j] != c as u8 {
                j += if b[j] == b'\\' { 2 } else { 1 };
            }
            let j = (j + 1).min(rest.len());
            text.push_str(&rest[..j]);
            line_blank = false;
            i += j;
            continue;
        }
        match c {
            '{' => {
                flush(&mut text, &mut toks);
                toks.push(Tok::Open);
            }
            '}' => {
                flush(&mut text, &mut toks);
                toks.push(Tok::Close);
            }
            ';' => {
                flush(&mut text, &mut toks);
                toks.push(Tok::Semi);
            }
            _ => text.push(c),
        }
        if c == '\n' {
            line_blank = true;
        } else if !c.is_whitespace() {
            line_blank = false;
        }
        i += c.len_utf8();
    }
    flush(&mut text, &mut toks);
    Ok(toks)
}

// ----------------------------------------------------------------- parser

pub fn is_ident_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// Collapses runs of whitespace into one space, and removes the space
/// after `(` / before `)` and `,`.
fn norm(s: &str) -> String {
    let joined = s.split_whitespace().collect::<Vec<_>>().join(" ");
    joined.replace("( ", "(").replace(" )", ")").replace(" ,", ",")
}

/// The identifier that ends `s` (after trailing whitespace), if any.
fn trailing_ident(s: &str) -> Option<(usize, &str)> {
    let t = s.trim_end();
    let start = t.rfind(|c: char| !is_ident_char(c)).map(|i| i + 1).unwrap_or(0);
    let id = &t[start..];
    (!id.is_empty() && !id.starts_with(|c: char| c.is_ascii_digit())).then_some((start, id))
}

/// Splits at commas outside parentheses and brackets.
fn split_top(s: &str, sep: char) -> Vec<String> {
    let mut out = Vec::new();
    let mut depth = 0i32;
    let mut cur = String::new();
    for c in s.chars() {
        match c {
            '(' | '[' => depth += 1,
            ')' | ']' => depth -= 1,
            _ => {}
        }
        if c == sep && depth == 0 {
            out.push(std::mem::take(&mut cur));
        } else {
            cur.push(c);
        }
    }
    out.push(cur);
    out
}

fn parse_param(p: &str) -> Result<Param, String> {
    let p = norm(p);
    if p == "..." {
        return Ok(Param { before: p, name: String::new(), after: String::new() });
    }
    if let Some(at) = p.find("(*") {
        // function pointer: R (*name)(args)
        let tail = &p[at + 2..];
        let end = tail.find(|c: char| !is_ident_char(c)).unwrap_or(tail.len());
        return Ok(Param {
            before: p[..at + 2].to_string(),
            name: tail[..end].to_string(),
            after: tail[end..].to_string(),
        });
    }
    let (head, after) = match p.find('[') {
        Some(b) => (p[..b].trim_end().to_string(), p[b..].to_string()),
        None => (p.clone(), String::new()),
    };
    match trailing_ident(&head) {
        // a lone type keyword or type name (unnamed parameter)
        Some((start, id)) if start > 0 && !matches!(head[..start].trim_end(), "struct" | "union" | "enum") => {
            Ok(Param { before: head[..start].trim_end().to_string(), name: id.to_string(), after })
        }
        _ => Ok(Param { before: head, name: String::new(), after }),
    }
}

fn parse_params(inner: &str) -> Result<Vec<Param>, String> {
    let inner = inner.trim();
    if inner.is_empty() || inner == "void" {
        return Ok(Vec::new());
    }
    split_top(inner, ',').iter().map(|p| parse_param(p)).collect()
}

/// `name(params)` in `s`: (text before the name, name, params inside, rest).
fn split_call(s: &str) -> Result<(String, String, String, String), String> {
    let open = s.find('(').ok_or_else(|| format!("no parameter list in {s:?}"))?;
    let (start, name) = trailing_ident(&s[..open]).ok_or_else(|| format!("no name before '(' in {s:?}"))?;
    let mut depth = 0;
    for (i, c) in s[open..].char_indices() {
        match c {
            '(' => depth += 1,
            ')' => {
                depth -= 1;
                if depth == 0 {
                    let close = open + i;
                    return Ok((
                        s[..start].trim().to_string(),
                        name.to_string(),
                        s[open + 1..close].to_string(),
                        s[close + 1..].trim().to_string(),
                    ));
                }
            }
            _ => {}
        }
    }
    Err(format!("unbalanced parentheses in {s:?}"))
}

enum BodyItem {
    Doc(String),
    Text(String),
    Semi,
    Nested(String),
}

struct Parser {
    toks: Vec<Tok>,
    i: usize,
}

impl Parser {
    fn next(&mut self) -> Option<Tok> {
        let t = self.toks.get(self.i).cloned();
        self.i += 1;
        t
    }

    /// Skips to the `#endif` that closes the conditional just read.
    fn skip_conditional(&mut self) -> Result<(), String> {
        let mut depth = 1;
        while let Some(t) = self.next() {
            if let Tok::Pre(p) = t {
                let d = p.trim_start_matches('#').trim_start();
                if d.starts_with("if") {
                    depth += 1;
                } else if d.starts_with("endif") {
                    depth -= 1;
                    if depth == 0 {
                        return Ok(());
                    }
                }
            }
        }
        Err("unterminated #if".into())
    }

    /// The items of a `{ ... }` body up to its `}` (already past the `{`).
    fn body(&mut self) -> Result<Vec<BodyItem>, String> {
        let mut items = Vec::new();
        while let Some(t) = self.next() {
            match t {
                Tok::Doc(d) => items.push(BodyItem::Doc(d)),
                Tok::Text(t) => items.push(BodyItem::Text(t)),
                Tok::Semi => items.push(BodyItem::Semi),
                Tok::Open => {
                    let inner = self.body()?;
                    let mut text = String::from("{ ");
                    for it in inner {
                        match it {
                            BodyItem::Text(t) | BodyItem::Nested(t) => text.push_str(&t),
                            BodyItem::Semi => text.push_str("; "),
                            BodyItem::Doc(_) => {}
                        }
                    }
                    text.push('}');
                    items.push(BodyItem::Nested(norm(&text)));
                }
                Tok::Close => return Ok(items),
                Tok::Pre(p) => return Err(format!("preprocessor line inside a body: {p}")),
            }
        }
        Err("unterminated body".into())
    }
}

fn fields(items: Vec<BodyItem>, is_enum: bool) -> Result<Vec<Field>, String> {
    let mut out = Vec::new();
    let mut doc = String::new();
    let mut cur = String::new();
    let push = |cur: &mut String, doc: &mut String, out: &mut Vec<Field>| -> Result<(), String> {
        let decl = norm(cur);
        cur.clear();
        if decl.is_empty() {
            return Ok(());
        }
        let name = if is_enum {
            decl.split('=').next().unwrap_or("").trim().to_string()
        } else {
            let head = decl.split('[').next().unwrap_or("");
            let head = head.split(':').next().unwrap_or(head); // bit-fields
            if let Some(at) = head.find("(*") {
                head[at + 2..].chars().take_while(|c| is_ident_char(*c)).collect()
            } else {
                trailing_ident(head).map(|(_, id)| id.to_string()).unwrap_or_default()
            }
        };
        if name.is_empty() {
            return Err(format!("cannot name the member {decl:?}"));
        }
        out.push(Field { decl, name, doc: std::mem::take(doc) });
        Ok(())
    };
    for it in items {
        match it {
            BodyItem::Doc(d) => doc = d,
            BodyItem::Text(t) if is_enum => {
                let parts = split_top(&t, ',');
                let n = parts.len();
                for (k, part) in parts.into_iter().enumerate() {
                    cur.push_str(&part);
                    if k + 1 < n {
                        push(&mut cur, &mut doc, &mut out)?;
                    }
                }
            }
            BodyItem::Text(t) | BodyItem::Nested(t) => {
                cur.push(' ');
                cur.push_str(&t);
            }
            BodyItem::Semi => push(&mut cur, &mut doc, &mut out)?,
        }
    }
    push(&mut cur, &mut doc, &mut out)?;
    Ok(out)
}

fn statement(h: &mut Header, stmt: &str, body: Option<Vec<BodyItem>>, doc: String) -> Result<(), String> {
    let s = norm(stmt);
    if s.is_empty() {
        return Ok(());
    }
    let words: Vec<&str> = s.split(' ').collect();
    let agg = |w: &str| matches!(w, "struct" | "union" | "enum");
    if words[0] == "typedef" {
        let rest = s["typedef ".len()..].to_string();
        if let Some(items) = body {
            // typedef struct tag { ... } name;
            let keyword = words[1];
            let (_, name) = trailing_ident(&rest).ok_or_else(|| format!("unnamed typedef {s:?}"))?;
            let is_enum = keyword == "enum";
            h.types.push(Type {
                name: name.to_string(),
                kind: if is_enum { Kind::Enum } else { Kind::Aggregate },
                decl: format!("typedef {keyword}"),
                fields: fields(items, is_enum)?,
                params: Vec::new(),
                doc,
            });
        } else if let Some(at) = rest.find("(*") {
            let tail = &rest[at + 2..];
            let name: String = tail.chars().take_while(|c| is_ident_char(*c)).collect();
            let after = &tail[name.len()..];
            let params = match after.trim_start().strip_prefix(')') {
                Some(p) => split_call(&format!("x{p}")).map(|(_, _, inner, _)| inner).and_then(|i| parse_params(&i))?,
                None => Vec::new(),
            };
            h.types.push(Type { name, kind: Kind::FnPointer, decl: format!("{s};"), fields: vec![], params, doc });
        } else {
            let (_, name) = trailing_ident(&rest).ok_or_else(|| format!("unnamed typedef {s:?}"))?;
            h.types.push(Type {
                name: name.to_string(),
                kind: Kind::Alias,
                decl: format!("{s};"),
                fields: vec![],
                params: vec![],
                doc,
            });
        }
        return Ok(());
    }
    if agg(words[0]) && words.len() >= 2 && !s.contains('(') {
        let name = format!("{} {}", words[0], words[1]);
        match body {
            Some(items) => {
                let is_enum = words[0] == "enum";
                h.types.push(Type {
                    kind: if is_enum { Kind::Enum } else { Kind::Aggregate },
                    decl: name.clone(),
                    name,
                    fields: fields(items, is_enum)?,
                    params: vec![],
                    doc,
                });
            }
            None if words.len() == 2 => {
                h.types.push(Type {
                    decl: format!("{name};"),
                    name,
                    kind: Kind::Opaque,
                    fields: vec![],
                    params: vec![],
                    doc,
                });
            }
            None => return Err(format!("cannot read the declaration {s:?}")),
        }
        return Ok(());
    }
    if body.is_some() {
        return Err(format!("unexpected body in {s:?}"));
    }
    if s.contains('(') {
        let (before, name, inner, rest) = split_call(&s)?;
        if !rest.is_empty() && !rest.chars().all(|c| is_ident_char(c) || c == ' ' || c == '(' || c == ')') {
            return Err(format!("cannot read the prototype {s:?}"));
        }
        let ret = before.strip_prefix("extern ").unwrap_or(&before).trim().to_string();
        if ret.is_empty() {
            return Err(format!("no return type in {s:?}"));
        }
        h.functions.push(Function { name, ret: norm(&ret), params: parse_params(&inner)?, doc });
        return Ok(());
    }
    Err(format!("cannot read the statement {s:?}"))
}

pub fn parse(src: &str) -> Result<Header, String> {
    let mut p = Parser { toks: lex(src)?, i: 0 };
    let mut h = Header::default();
    let mut doc = String::new();
    let mut stmt = String::new();
    let mut body: Option<Vec<BodyItem>> = None;
    while let Some(t) = p.next() {
        match t {
            Tok::Doc(d) => {
                if stmt.trim().is_empty() && body.is_none() {
                    doc = d;
                }
            }
            Tok::Pre(line) => {
                let d = line.trim_start_matches('#').trim_start();
                let words: Vec<&str> = d.split_whitespace().collect();
                match words.as_slice() {
                    ["ifdef", "__cplusplus", ..] | ["if", "defined(__cplusplus)", ..] => p.skip_conditional()?,
                    ["define", name, ..] if words.len() >= 3 && !name.contains('(') => {
                        let value = d["define".len()..].trim_start()[name.len()..].trim().to_string();
                        h.consts.push(Const { name: name.to_string(), value, doc: std::mem::take(&mut doc) });
                    }
                    _ => doc.clear(),
                }
            }
            Tok::Text(t) => stmt.push_str(&t),
            Tok::Open => {
                if body.is_some() {
                    return Err(format!("two bodies in one statement: {stmt:?}"));
                }
                body = Some(p.body()?);
            }
            Tok::Close => return Err(format!("unbalanced '}}' after {stmt:?}")),
            Tok::Semi => {
                statement(&mut h, &stmt, body.take(), std::mem::take(&mut doc))?;
                stmt.clear();
            }
        }
    }
    if !stmt.trim().is_empty() {
        return Err(format!("unterminated statement {stmt:?}"));
    }
    Ok(h)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_of_every_shape() {
        let p = parse_params("struct a *x, int n, uint64_t b[16], void (*cb)(void *ctx, int n), const char *").unwrap();
        assert_eq!(p[0], Param { before: "struct a *".into(), name: "x".into(), after: "".into() });
        assert_eq!(p[1].text(), "int n");
        assert_eq!(p[2], Param { before: "uint64_t".into(), name: "b".into(), after: "[16]".into() });
        assert_eq!(p[3].name, "cb");
        assert_eq!(p[3].text(), "void (*cb)(void *ctx, int n)");
        assert_eq!(p[4].name, "");
        assert!(parse_params("void").unwrap().is_empty());
    }
}
