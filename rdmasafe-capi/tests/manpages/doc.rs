//! Doc comments as the header writes them (Markdown-ish, from rustdoc):
//! blocks, sentences, and a function's doc split into what goes into
//! DESCRIPTION, RETURN VALUE, ERRORS and NOTES.

/// One block of a doc comment.
#[derive(Debug, Clone, PartialEq)]
pub enum Block {
    /// A paragraph, its lines joined with spaces.
    Para(String),
    /// A bulleted or numbered list: one string per item.
    List(Vec<String>),
    /// A code block, verbatim.
    Code(String),
    /// A `# Heading` line.
    Heading(String),
    /// Text that is not in the header, already roff (generated lists).
    Roff(String),
}

fn list_item(line: &str) -> Option<&str> {
    let t = line.trim_start();
    if line.len() - t.len() > 3 {
        return None;
    }
    for bullet in ["- ", "* ", "+ "] {
        if let Some(r) = t.strip_prefix(bullet) {
            return Some(r);
        }
    }
    let digits = t.chars().take_while(|c| c.is_ascii_digit()).count();
    if digits > 0 {
        if let Some(r) = t[digits..].strip_prefix(". ").or_else(|| t[digits..].strip_prefix(") ")) {
            return Some(r);
        }
    }
    None
}

/// Splits a doc comment into blocks.
pub fn blocks(doc: &str) -> Vec<Block> {
    let mut out = Vec::new();
    let mut para: Vec<String> = Vec::new();
    let mut list: Vec<String> = Vec::new();
    let mut code: Option<Vec<String>> = None;
    let mut fence = false;
    fn end(out: &mut Vec<Block>, para: &mut Vec<String>, list: &mut Vec<String>) {
        if !para.is_empty() {
            out.push(Block::Para(para.join(" ")));
            para.clear();
        }
        if !list.is_empty() {
            out.push(Block::List(std::mem::take(list)));
        }
    }
    for line in doc.lines() {
        if line.trim_start().starts_with("```") {
            if fence {
                out.push(Block::Code(code.take().unwrap_or_default().join("\n")));
            } else {
                end(&mut out, &mut para, &mut list);
                code = Some(Vec::new());
            }
            fence = !fence;
            continue;
        }
        if fence {
            code.get_or_insert_with(Vec::new).push(line.to_string());
            continue;
        }
        // an indented code block: 4 spaces, after a blank line
        if line.starts_with("    ") && para.is_empty() && list.is_empty() {
            code.get_or_insert_with(Vec::new).push(line[4..].to_string());
            continue;
        }
        if let Some(c) = code.take() {
            out.push(Block::Code(c.join("\n")));
        }
        let t = line.trim();
        if t.is_empty() {
            end(&mut out, &mut para, &mut list);
        } else if let Some(h) = t.strip_prefix('#').filter(|_| para.is_empty()) {
            end(&mut out, &mut para, &mut list);
            out.push(Block::Heading(h.trim_start_matches('#').trim().to_string()));
        } else if let Some(item) = list_item(line).filter(|_| para.is_empty() || !list.is_empty()) {
            end(&mut out, &mut para, &mut Vec::new());
            list.push(item.trim().to_string());
        } else if let Some(last) = list.last_mut() {
            last.push(' ');
            last.push_str(t);
        } else {
            para.push(t.to_string());
        }
    }
    if let Some(c) = code.take() {
        out.push(Block::Code(c.join("\n")));
    }
    end(&mut out, &mut para, &mut list);
    out
}

const ABBREVIATIONS: &[&str] = &["e.g", "i.e", "etc", "cf", "vs", "approx", "resp", "incl"];

/// Splits a paragraph into sentences (a sentence ends with `.`, `!` or `?`
/// outside parentheses and code, followed by a space and a capital, a
/// digit, a quote, a `(` or a code span; never after an abbreviation).
pub fn sentences(p: &str) -> Vec<String> {
    let chars: Vec<char> = p.chars().collect();
    let mut out = Vec::new();
    let mut start = 0;
    let mut depth = 0i32;
    let mut code = false;
    for i in 0..chars.len() {
        let c = chars[i];
        match c {
            '`' => code = !code,
            '(' | '[' if !code => depth += 1,
            ')' | ']' if !code => depth -= 1,
            '.' | '!' | '?' if !code && depth <= 0 => {
                let next = chars.get(i + 1);
                let after = chars.get(i + 2);
                let boundary = next.is_some_and(|n| n.is_whitespace())
                    && after.is_some_and(|a| a.is_uppercase() || a.is_ascii_digit() || "`\"'(*-".contains(*a));
                if boundary {
                    let word: String = chars[start..i]
                        .iter()
                        .rev()
                        .take_while(|c| !c.is_whitespace() && **c != '(')
                        .collect::<Vec<_>>()
                        .into_iter()
                        .rev()
                        .collect();
                    // an abbreviation, or an ellipsis ("1 ... 5")
                    let abbrev = c == '.'
                        && (ABBREVIATIONS.iter().any(|a| word.eq_ignore_ascii_case(a)) || word.ends_with(".."));
                    if !abbrev {
                        out.push(chars[start..=i].iter().collect::<String>().trim().to_string());
                        start = i + 1;
                    }
                }
            }
            _ => {}
        }
    }
    let tail: String = chars[start..].iter().collect::<String>().trim().to_string();
    if !tail.is_empty() {
        out.push(tail);
    }
    out
}

/// Splits `s` at top-level occurrences of `sep` (outside parentheses and
/// code spans).
pub fn split_top<'a>(s: &'a str, sep: &str) -> Vec<&'a str> {
    let mut out = Vec::new();
    let mut depth = 0i32;
    let mut code = false;
    let mut start = 0;
    let mut i = 0;
    let b = s.as_bytes();
    while i < s.len() {
        match b[i] {
            b'`' => code = !code,
            b'(' | b'[' if !code => depth += 1,
            b')' | b']' if !code => depth -= 1,
            _ => {}
        }
        if depth == 0 && !code && s[i..].starts_with(sep) {
            out.push(&s[start..i]);
            i += sep.len();
            start = i;
            continue;
        }
        i += 1;
    }
    out.push(&s[start..]);
    out
}

pub fn is_returns(s: &str) -> bool {
    let t = s.trim_start();
    t.starts_with("Returns ") || t.starts_with("Returns:") || t.starts_with("Return value")
}

pub fn is_thread(s: &str) -> bool {
    let l = s.to_ascii_lowercase();
    l.contains("thread-safe") || l.contains("thread safe") || l.starts_with("mt-safe")
}

fn capitalised(s: &str) -> String {
    let mut c = s.chars();
    match c.next() {
        Some(f) => format!("{}{}", f.to_uppercase(), c.as_str()),
        None => String::new(),
    }
}

fn full_stop(s: &str) -> String {
    format!("{}.", s.trim_end_matches('.'))
}

/// Splits "X; returns Y." into "X." and "Returns Y.", and "X; thread-safe."
/// into "X." and "Thread-safe.".
fn split_clauses(s: &str) -> Vec<String> {
    let parts = split_top(s, "; ");
    for (k, part) in parts.iter().enumerate().skip(1) {
        if part.starts_with("returns ") {
            let head = parts[..k].join("; ");
            let tail = parts[k..].join("; ");
            let mut out = split_clauses(&full_stop(&head));
            out.push(capitalised(&tail));
            return out;
        }
    }
    if parts.len() > 1 && parts.iter().any(|p| is_thread(p)) && !parts.iter().all(|p| is_thread(p)) {
        let (thread, other): (Vec<&str>, Vec<&str>) = parts.iter().partition(|p| is_thread(p));
        return vec![full_stop(&other.join("; ")), capitalised(&full_stop(&thread.join("; ")))];
    }
    vec![s.to_string()]
}

#[derive(Debug, Default, Clone)]
pub struct FnDoc {
    pub description: Vec<Block>,
    pub returns: Vec<Block>,
    /// An explicit `# Errors` section.
    pub errors: Vec<Block>,
    /// Thread-safety sentences and paragraphs.
    pub thread: Vec<String>,
    /// The `# Safety` section: what the caller must guarantee.
    pub safety: Vec<Block>,
    pub notes: Vec<Block>,
    pub examples: Vec<Block>,
}

#[derive(Clone, Copy, PartialEq)]
enum Section {
    Description,
    Returns,
    Errors,
    Thread,
    Safety,
    Notes,
    Examples,
}

pub fn split_fn_doc(doc: &str) -> FnDoc {
    let mut d = FnDoc::default();
    let mut section = Section::Description;
    let mut after_returns = false;
    for b in blocks(doc) {
        if let Block::Heading(h) = &b {
            let l = h.to_ascii_lowercase();
            section = match l.as_str() {
                "safety" => Section::Safety,
                "errors" => Section::Errors,
                "returns" | "return value" | "return values" => Section::Returns,
                "thread safety" | "thread-safety" | "threads" | "threading" | "concurrency" => Section::Thread,
                "notes" | "note" => Section::Notes,
                "example" | "examples" => Section::Examples,
                _ => {
                    d.description.push(b.clone());
                    Section::Description
                }
            };
            after_returns = false;
            continue;
        }
        match section {
            Section::Description => match &b {
                Block::Para(p) => {
                    let ss: Vec<String> = sentences(p).iter().flat_map(|s| split_clauses(s)).collect();
                    let whole = ss.first().is_some_and(|s| is_returns(s));
                    let (mut keep, mut ret) = (Vec::new(), Vec::new());
                    for s in ss {
                        if is_thread(&s) {
                            d.thread.push(s);
                        } else if whole || is_returns(&s) {
                            ret.push(s);
                        } else {
                            keep.push(s);
                        }
                    }
                    if !keep.is_empty() {
                        d.description.push(Block::Para(keep.join(" ")));
                    }
                    after_returns = whole || (!ret.is_empty() && keep.is_empty());
                    if !ret.is_empty() {
                        d.returns.push(Block::Para(ret.join(" ")));
                    }
                }
                // a list right after a "Returns ..." paragraph lists return values
                Block::List(_) if after_returns => d.returns.push(b.clone()),
                _ => {
                    after_returns = false;
                    d.description.push(b.clone());
                }
            },
            Section::Returns => d.returns.push(b),
            Section::Errors => d.errors.push(b),
            Section::Thread => match b {
                Block::Para(p) => d.thread.push(p),
                other => d.notes.push(other),
            },
            Section::Safety => d.safety.push(b),
            Section::Notes => d.notes.push(b),
            Section::Examples => d.examples.push(b),
        }
    }
    d
}

/// The NAME line's description: the first sentence, cut at a top-level
/// `:` or `;` (when at least three words come before it), without
/// parenthesised asides and code quotes, starting lower-case.
pub fn summary(doc: &str) -> String {
    let first = blocks(doc)
        .into_iter()
        .find_map(|b| match b {
            Block::Para(p) => Some(p),
            _ => None,
        })
        .unwrap_or_default();
    let s = sentences(&first).into_iter().next().unwrap_or_default();
    let mut s = s.trim_end_matches('.').to_string();
    for sep in [": ", "; "] {
        let parts = split_top(&s, sep);
        if parts.len() > 1 && parts[0].split_whitespace().count() >= 3 {
            s = parts[0].to_string();
        }
    }
    // drop top-level parentheses
    let mut out = String::new();
    let mut depth = 0;
    let mut code = false;
    for c in s.chars() {
        match c {
            '`' => {
                code = !code;
                continue;
            }
            '(' if !code => depth += 1,
            ')' if !code && depth > 0 => {
                depth -= 1;
                continue;
            }
            _ => {}
        }
        if depth == 0 {
            out.push(c);
        }
    }
    let out = out.split_whitespace().collect::<Vec<_>>().join(" ").replace(" ,", ",");
    let mut chars = out.chars();
    match (chars.next(), chars.next()) {
        (Some(a), Some(b)) if a.is_uppercase() && !b.is_uppercase() => {
            format!("{}{}", a.to_lowercase(), &out[a.len_utf8()..])
        }
        _ => out,
    }
}

// ----------------------------------------------------------------- errors

/// Linux errno names (asm-generic/errno-base.h, errno.h, and ENOTSUP).
pub const ERRNO_NAMES: &[&str] = &[
    "EPERM",
    "ENOENT",
    "ESRCH",
    "EINTR",
    "EIO",
    "ENXIO",
    "E2BIG",
    "ENOEXEC",
    "EBADF",
    "ECHILD",
    "EAGAIN",
    "ENOMEM",
    "EACCES",
    "EFAULT",
    "ENOTBLK",
    "EBUSY",
    "EEXIST",
    "EXDEV",
    "ENODEV",
    "ENOTDIR",
    "EISDIR",
    "EINVAL",
    "ENFILE",
    "EMFILE",
    "ENOTTY",
    "ETXTBSY",
    "EFBIG",
    "ENOSPC",
    "ESPIPE",
    "EROFS",
    "EMLINK",
    "EPIPE",
    "EDOM",
    "ERANGE",
    "EDEADLK",
    "ENAMETOOLONG",
    "ENOLCK",
    "ENOSYS",
    "ENOTEMPTY",
    "ELOOP",
    "EWOULDBLOCK",
    "ENOMSG",
    "EIDRM",
    "ECHRNG",
    "EL2NSYNC",
    "EL3HLT",
    "EL3RST",
    "ELNRNG",
    "EUNATCH",
    "ENOCSI",
    "EL2HLT",
    "EBADE",
    "EBADR",
    "EXFULL",
    "ENOANO",
    "EBADRQC",
    "EBADSLT",
    "EDEADLOCK",
    "EBFONT",
    "ENOSTR",
    "ENODATA",
    "ETIME",
    "ENOSR",
    "ENONET",
    "ENOPKG",
    "EREMOTE",
    "ENOLINK",
    "EADV",
    "ESRMNT",
    "ECOMM",
    "EPROTO",
    "EMULTIHOP",
    "EDOTDOT",
    "EBADMSG",
    "EOVERFLOW",
    "ENOTUNIQ",
    "EBADFD",
    "EREMCHG",
    "ELIBACC",
    "ELIBBAD",
    "ELIBSCN",
    "ELIBMAX",
    "ELIBEXEC",
    "EILSEQ",
    "ERESTART",
    "ESTRPIPE",
    "EUSERS",
    "ENOTSOCK",
    "EDESTADDRREQ",
    "EMSGSIZE",
    "EPROTOTYPE",
    "ENOPROTOOPT",
    "EPROTONOSUPPORT",
    "ESOCKTNOSUPPORT",
    "EOPNOTSUPP",
    "ENOTSUP",
    "EPFNOSUPPORT",
    "EAFNOSUPPORT",
    "EADDRINUSE",
    "EADDRNOTAVAIL",
    "ENETDOWN",
    "ENETUNREACH",
    "ENETRESET",
    "ECONNABORTED",
    "ECONNRESET",
    "ENOBUFS",
    "EISCONN",
    "ENOTCONN",
    "ESHUTDOWN",
    "ETOOMANYREFS",
    "ETIMEDOUT",
    "ECONNREFUSED",
    "EHOSTDOWN",
    "EHOSTUNREACH",
    "EALREADY",
    "EINPROGRESS",
    "ESTALE",
    "EUCLEAN",
    "ENOTNAM",
    "ENAVAIL",
    "EISNAM",
    "EREMOTEIO",
    "EDQUOT",
    "ENOMEDIUM",
    "EMEDIUMTYPE",
    "ECANCELED",
    "ENOKEY",
    "EKEYEXPIRED",
    "EKEYREVOKED",
    "EKEYREJECTED",
    "EOWNERDEAD",
    "ENOTRECOVERABLE",
    "ERFKILL",
    "EHWPOISON",
];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Convention {
    /// -1 (or NULL) with errno set, like librdmacm.
    Errno,
    /// A negative errno value as the return value.
    Negative,
    /// No failure documented.
    None,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ErrorCode {
    pub code: String,
    pub reasons: Vec<String>,
}

#[derive(Debug, Clone)]
pub struct Errors {
    pub convention: Convention,
    pub codes: Vec<ErrorCode>,
    /// Failures described without a code ("the error of `rdma_get_cm_event`").
    pub others: Vec<String>,
}

/// The first errno name in `item` outside parentheses and its reason: the
/// parenthesised text after it, or the text after ` if ` / ` for ` /
/// ` when ` / `:` / ` - `.
fn code_in(item: &str) -> Option<(String, Option<String>)> {
    let b = item.as_bytes();
    let mut depth = 0;
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'(' => depth += 1,
            b')' => depth -= 1,
            b'E' if depth == 0 && (i == 0 || !crate::cheader::is_ident_char(b[i - 1] as char)) => {
                let end = item[i..].find(|c: char| !crate::cheader::is_ident_char(c)).map(|e| i + e).unwrap_or(b.len());
                let word = &item[i..end];
                if ERRNO_NAMES.contains(&word) {
                    let rest = item[end..].trim_start_matches('`');
                    let t = rest.trim_start();
                    let reason = if let Some(inner) = t.strip_prefix('(') {
                        let mut d = 1;
                        let mut close = inner.len();
                        for (k, c) in inner.char_indices() {
                            match c {
                                '(' => d += 1,
                                ')' => {
                                    d -= 1;
                                    if d == 0 {
                                        close = k;
                                        break;
                                    }
                                }
                                _ => {}
                            }
                        }
                        Some(inner[..close].trim().to_string())
                    } else if let Some(r) = t.strip_prefix(':').or_else(|| t.strip_prefix("- ")) {
                        Some(r.trim().to_string())
                    } else if [" if ", " for ", " when ", " on "].iter().any(|w| rest.starts_with(w)) {
                        Some(rest.trim().to_string())
                    } else {
                        None
                    };
                    return Some((word.to_string(), reason.filter(|r| !r.is_empty())));
                }
                i = end;
                continue;
            }
            _ => {}
        }
        i += 1;
    }
    None
}

fn starts_with_code(s: &str) -> bool {
    let t = s.trim_start().trim_start_matches(['`', '-']);
    let word: String = t.chars().take_while(|c| crate::cheader::is_ident_char(*c)).collect();
    ERRNO_NAMES.contains(&word.as_str())
}

/// The items of a "Returns a, b (x, y), or c." sentence.
fn items(sentence: &str) -> Vec<String> {
    let s = sentence.trim().trim_end_matches('.');
    let s = s.strip_prefix("Returns").unwrap_or(s).trim_start_matches(':').trim();
    let mut out = Vec::new();
    for part in split_top(s, ", ") {
        // "x or -EINVAL": split at " or " only before a code
        let pieces = split_top(part, " or ");
        let mut cur = pieces[0].to_string();
        for p in &pieces[1..] {
            if starts_with_code(p) {
                out.push(std::mem::take(&mut cur));
                cur = p.to_string();
            } else {
                cur.push_str(" or ");
                cur.push_str(p);
            }
        }
        out.push(cur);
    }
    out.into_iter()
        .map(|i| {
            let t = i.trim();
            t.strip_prefix("or ").or_else(|| t.strip_prefix("and ")).unwrap_or(t).trim().to_string()
        })
        .filter(|i| !i.is_empty())
        .collect()
}

pub fn errors(d: &FnDoc) -> Errors {
    // (text, whether a failure without a code may be read from it)
    let mut texts: Vec<(String, bool)> = Vec::new();
    for (blocks, explicit) in [(&d.returns, false), (&d.errors, true)] {
        for b in blocks.iter() {
            match b {
                Block::Para(p) => {
                    for s in sentences(p) {
                        let listing = explicit || is_returns(&s);
                        texts.push((s, listing));
                    }
                }
                Block::List(items) => texts.extend(items.iter().map(|i| (i.clone(), true))),
                _ => {}
            }
        }
    }
    let mut e = Errors { convention: Convention::None, codes: Vec::new(), others: Vec::new() };
    for (t, listing) in &texts {
        for item in items(t) {
            match code_in(&item) {
                Some((code, reason)) => match e.codes.iter_mut().find(|c| c.code == code) {
                    Some(c) => c.reasons.extend(reason),
                    None => e.codes.push(ErrorCode { code, reasons: reason.into_iter().collect() }),
                },
                None if *listing => {
                    let l = item.to_ascii_lowercase();
                    if l.contains("errno") || l.contains("error") {
                        e.others.push(item);
                    }
                }
                None => {}
            }
        }
    }
    let all = texts.iter().map(|(t, _)| t.to_ascii_lowercase()).collect::<Vec<_>>().join(" ");
    let errno = ["-1 with errno", "sets errno", "null with errno", "-1 and sets errno"];
    e.convention = if errno.iter().any(|w| all.contains(w)) {
        Convention::Errno
    } else if !e.codes.is_empty() || !e.others.is_empty() {
        Convention::Negative
    } else {
        Convention::None
    };
    e
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sentences_respect_abbreviations_parens_and_code() {
        assert_eq!(sentences("Level 1 ... 5 (trace). Next."), ["Level 1 ... 5 (trace).", "Next."]);
        let s = sentences("The name, e.g. `\"X\"`, like `y`. Never NULL (see `a. B`). Thread-safe. `x` is freed.");
        assert_eq!(
            s,
            ["The name, e.g. `\"X\"`, like `y`.", "Never NULL (see `a. B`).", "Thread-safe.", "`x` is freed."]
        );
    }

    #[test]
    fn returns_and_thread_sentences_move() {
        let d = split_fn_doc(
            "Does x. Thread-safe; returns 0.\n\nMore text.\nReturns 2. Still text.\n\n\
             Returns 1, -EINVAL (bad `n`), -EBUSY, or a negative errno.\nNothing on failure.",
        );
        assert_eq!(d.description, [Block::Para("Does x.".into()), Block::Para("More text. Still text.".into())]);
        assert_eq!(d.thread, ["Thread-safe."]);
        let b = split_fn_doc("Reads it. Never blocks; thread-safe.");
        assert_eq!(b.description, [Block::Para("Reads it. Never blocks.".into())]);
        assert_eq!(b.thread, ["Thread-safe."]);
        assert_eq!(
            d.returns,
            [
                Block::Para("Returns 0.".into()),
                Block::Para("Returns 2.".into()),
                Block::Para("Returns 1, -EINVAL (bad `n`), -EBUSY, or a negative errno. Nothing on failure.".into())
            ]
        );
        let e = errors(&d);
        assert_eq!(e.convention, Convention::Negative);
        assert_eq!(e.codes[0], ErrorCode { code: "EINVAL".into(), reasons: vec!["bad `n`".into()] });
        assert_eq!(e.codes[1], ErrorCode { code: "EBUSY".into(), reasons: vec![] });
        assert_eq!(e.others, ["a negative errno"]);
    }

    #[test]
    fn errno_convention_and_if_reasons() {
        let d =
            split_fn_doc("X.\n\nReturns 0, or -1 with errno: EINVAL (`a` or `b` NULL), EAGAIN, or the error of `f`.");
        let e = errors(&d);
        assert_eq!(e.convention, Convention::Errno);
        assert_eq!(e.codes.iter().map(|c| c.code.as_str()).collect::<Vec<_>>(), ["EINVAL", "EAGAIN"]);
        assert_eq!(e.codes[0].reasons, ["`a` or `b` NULL"]);
        assert_eq!(e.others, ["the error of `f`"]);
        let d = split_fn_doc("Y. Returns the fd (>= 0) or -EINVAL if `out` is NULL or too small.");
        let e = errors(&d);
        assert_eq!(e.codes[0].reasons, ["if `out` is NULL or too small"]);
    }

    #[test]
    fn summaries() {
        assert_eq!(summary("One cycle: waits at most `t` (-1 forever). More."), "one cycle: waits at most t");
        assert_eq!(summary("Creates a loop on `channel` (a channel). X."), "creates a loop on channel");
        assert_eq!(summary("Asks the loop to stop; it returns."), "asks the loop to stop");
        assert_eq!(summary("CQ loop figures."), "CQ loop figures");
    }
}
