//! The pages: which function goes on which page (man/groups.txt), and each
//! page assembled from the header: NAME, SYNOPSIS, DESCRIPTION (with the
//! structs, callback types and constants the functions use), RETURN VALUE,
//! ERRORS, NOTES, EXAMPLES, SEE ALSO; plus rdmasafe(7) from its Markdown
//! source.

use crate::cheader::{self, ret_prefix, Function, Header, Kind, Param, Type};
use crate::doc::{self, Block, Convention, FnDoc};
use crate::roff::{arg, escape, inline, Ctx, Page};
use std::collections::{BTreeMap, BTreeSet};

/// The header's middle: short, so that the longest page names still fit
/// in 80 columns.
pub const MANUAL: &str = "rdmasafe";
pub const COMMENT: &[&str] = &[
    "Generated from include/rdmasafe.h by rdmasafe-capi/tests/manpages: do not edit.",
    "Regenerate: RDMASAFE_BLESS=1 cargo test -p rdmasafe-capi --test manpages",
];

/// One line of man/groups.txt: functions sharing a page (the first names
/// it), and optionally the NAME line's description.
#[derive(Debug, Clone)]
pub struct Group {
    pub names: Vec<String>,
    pub summary: Option<String>,
}

pub fn parse_groups(text: &str) -> Result<Vec<Group>, String> {
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let (names, summary) = match line.split_once(" -- ") {
            Some((a, b)) => (a, Some(b.trim().to_string())),
            None => (line, None),
        };
        let names: Vec<String> = names.split_whitespace().map(String::from).collect();
        if names.len() < 2 && summary.is_none() {
            return Err(format!("man/groups.txt:{}: a group needs two functions or a summary", n + 1));
        }
        out.push(Group { names, summary });
    }
    Ok(out)
}

/// A page: its name (the first function), its functions, its summary.
#[derive(Debug, Clone)]
pub struct PagePlan {
    pub name: String,
    pub functions: Vec<String>,
    pub summary: String,
}

pub fn plan(h: &Header, groups: &[Group]) -> Result<Vec<PagePlan>, String> {
    let mut seen = BTreeSet::new();
    for g in groups {
        for n in &g.names {
            if h.function(n).is_none() {
                return Err(format!("man/groups.txt names {n}, which include/rdmasafe.h does not declare"));
            }
            if !seen.insert(n.clone()) {
                return Err(format!("man/groups.txt names {n} twice"));
            }
        }
    }
    let mut pages = Vec::new();
    let mut done = BTreeSet::new();
    for f in &h.functions {
        if done.contains(&f.name) {
            continue;
        }
        let (functions, summary) = match groups.iter().find(|g| g.names.contains(&f.name)) {
            Some(g) => (g.names.clone(), g.summary.clone()),
            None => (vec![f.name.clone()], None),
        };
        for n in &functions {
            done.insert(n.clone());
        }
        let first = h.function(&functions[0]).unwrap();
        if first.doc.trim().is_empty() {
            return Err(format!("{} has no doc comment in include/rdmasafe.h: document it", first.name));
        }
        let summary = summary.unwrap_or_else(|| doc::summary(&first.doc));
        pages.push(PagePlan { name: functions[0].clone(), functions, summary });
    }
    Ok(pages)
}

/// `word` occurs in `text`, not as part of a longer identifier.
pub fn contains_word(text: &str, word: &str) -> bool {
    let mut from = 0;
    while let Some(at) = text[from..].find(word) {
        let s = from + at;
        let e = s + word.len();
        let before = text[..s].chars().next_back();
        let after = text[e..].chars().next();
        if !before.is_some_and(cheader::is_ident_char) && !after.is_some_and(cheader::is_ident_char) {
            return true;
        }
        from = e;
    }
    false
}

/// The header's types that the functions' prototypes or docs name, and
/// the types those name in turn, in header order.
fn referenced_types<'a>(h: &'a Header, fns: &[&Function]) -> Vec<&'a Type> {
    let mut texts: Vec<String> = fns.iter().map(|f| format!("{} {}", f.prototype(), f.doc)).collect();
    let mut found: BTreeSet<String> = BTreeSet::new();
    loop {
        let before = found.len();
        for t in &h.types {
            if !found.contains(&t.name) && texts.iter().any(|x| contains_word(x, &t.name)) {
                found.insert(t.name.clone());
                texts.push(t.decl.clone());
                texts.extend(t.fields.iter().map(|f| f.decl.clone()));
            }
        }
        if found.len() == before {
            break;
        }
    }
    h.types.iter().filter(|t| found.contains(&t.name)).collect()
}

/// Constants named (or matched by a `PREFIX_*` pattern) in the texts.
fn referenced_consts<'a>(h: &'a Header, texts: &[String]) -> Vec<&'a cheader::Const> {
    let mut prefixes = Vec::new();
    for t in texts {
        let mut rest = t.as_str();
        while let Some(at) = rest.find("_*") {
            let head = &rest[..at + 1];
            let start = head.rfind(|c: char| !cheader::is_ident_char(c)).map(|i| i + 1).unwrap_or(0);
            if at + 1 - start > 1 {
                prefixes.push(head[start..].to_string());
            }
            rest = &rest[at + 2..];
        }
    }
    h.consts
        .iter()
        .filter(|c| texts.iter().any(|t| contains_word(t, &c.name)) || prefixes.iter().any(|p| c.name.starts_with(p)))
        .collect()
}

/// `.BI` / `.B` lines for `head` + params + `tail`, one parameter per line
/// when they do not fit on one.
fn prototype_lines(head: &str, params: &[Param], tail: &str) -> Vec<String> {
    if params.is_empty() {
        return vec![format!(".B {}", arg(&format!("{head}void{tail}")))];
    }
    let one: String = format!("{head}{}{tail}", cheader::params_text(params));
    let bi = |bold1: &str, p: &Param, bold2: &str| -> String {
        if p.name.is_empty() {
            format!(".B {}", arg(&format!("{bold1}{}{bold2}", p.before)))
        } else {
            format!(
                ".BI {} {} {}",
                arg(&format!("{bold1}{}{}", p.before, p.joiner())),
                arg(&p.name),
                arg(&format!("{}{bold2}", p.after))
            )
        }
    };
    if params.len() == 1 && one.len() <= 78 {
        return vec![bi(head, &params[0], tail)];
    }
    let indent = " ".repeat(head.len());
    params
        .iter()
        .enumerate()
        .map(|(k, p)| {
            let first = if k == 0 { head.to_string() } else { indent.clone() };
            let last = if k + 1 == params.len() { tail.to_string() } else { ",".to_string() };
            bi(&first, p, &last)
        })
        .collect()
}

fn ctx_for(params: &[String]) -> Ctx {
    Ctx { params: params.to_vec() }
}

/// A reason as a sentence: capitalised (unless it starts with code), with
/// a full stop.
fn sentence(s: &str) -> String {
    let s = s.trim();
    let mut c = s.chars();
    let mut out = match c.next() {
        Some(f) if f.is_lowercase() => format!("{}{}", f.to_uppercase(), c.as_str()),
        _ => s.to_string(),
    };
    if !out.ends_with(['.', '!', '?']) {
        out.push('.');
    }
    out
}

fn fn_ref(name: &str) -> String {
    format!("\\fB{}\\fR()", escape(name))
}

fn names_list(names: &[String]) -> String {
    let refs: Vec<String> = names.iter().map(|n| fn_ref(n)).collect();
    match refs.len() {
        0 => String::new(),
        1 => refs[0].clone(),
        n => format!("{} and {}", refs[..n - 1].join(", "), refs[n - 1]),
    }
}

/// Every `struct NAME` the header mentions (its own and foreign types).
fn struct_names(header_src: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for kw in ["struct ", "union ", "enum "] {
        let mut rest = header_src;
        while let Some(at) = rest.find(kw) {
            let tail = &rest[at + kw.len()..];
            let id: String = tail.chars().take_while(|c| cheader::is_ident_char(*c)).collect();
            if !id.is_empty() {
                out.insert(id);
            }
            rest = tail;
        }
    }
    out
}

/// Functions of other libraries quoted as code in `doc` (`rdma_*`, `ibv_*`).
fn foreign_functions(doc: &str, structs: &BTreeSet<String>) -> Vec<String> {
    let mut out = Vec::new();
    for (k, span) in doc.split('`').enumerate() {
        if k % 2 == 0 {
            continue;
        }
        let name = span.split('(').next().unwrap_or("").trim();
        let ok = (name.starts_with("rdma_") || name.starts_with("ibv_"))
            && name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
            && !structs.contains(name);
        if ok {
            out.push(name.to_string());
        }
    }
    out
}

struct Ctxs<'a> {
    h: &'a Header,
    header_src: &'a str,
    version: &'a str,
}

fn function_page(c: &Ctxs, page: &PagePlan) -> String {
    let h = c.h;
    let fns: Vec<&Function> = page.functions.iter().map(|n| h.function(n).unwrap()).collect();
    let docs: Vec<FnDoc> = fns.iter().map(|f| doc::split_fn_doc(&f.doc)).collect();
    let errors: Vec<doc::Errors> = docs.iter().map(doc::errors).collect();
    let group = fns.len() > 1;
    let types = referenced_types(h, &fns);
    let mut texts: Vec<String> = fns.iter().map(|f| f.doc.clone()).collect();
    for t in &types {
        texts.push(t.doc.clone());
        texts.extend(t.fields.iter().map(|f| f.doc.clone()));
    }
    let consts = referenced_consts(h, &texts);
    let none = Ctx::default();

    let mut p = Page::new(COMMENT);
    p.th(&page.name.to_uppercase(), "3", &format!("rdmasafe {}", c.version), MANUAL);

    p.sh("NAME");
    p.raw(&format!("{} \\- {}", escape(&page.functions.join(", ")), escape(&page.summary)));

    p.sh("SYNOPSIS");
    p.raw(".nf");
    p.raw(&format!(".B {}", arg("#include <rdmasafe.h>")));
    let decls: Vec<&&Type> =
        types.iter().filter(|t| matches!(t.kind, Kind::Opaque | Kind::FnPointer | Kind::Alias)).collect();
    if !decls.is_empty() {
        p.raw(".PP");
        for t in decls {
            match t.kind {
                Kind::FnPointer => {
                    let at = t.decl.find(")(").map(|i| i + 2).unwrap_or(t.decl.len());
                    for l in prototype_lines(&t.decl[..at], &t.params, ");") {
                        p.raw(&l);
                    }
                }
                _ => p.raw(&format!(".B {}", arg(&t.decl))),
            }
        }
    }
    for f in &fns {
        p.raw(".PP");
        for l in prototype_lines(&format!("{}{}(", ret_prefix(&f.ret), f.name), &f.params, ");") {
            p.raw(&l);
        }
    }
    p.raw(".fi");
    p.raw(".PP");
    p.raw("Compile and link with\n.BR \"pkg\\-config \\-\\-cflags \\-\\-libs rdmasafe\" ,\nor link with\n.IR \"\\-lrdmasafe \\-lrdmacm \\-libverbs\" .");

    p.sh("DESCRIPTION");
    for (f, d) in fns.iter().zip(&docs) {
        if group {
            p.ss(&format!("{}()", f.name));
        }
        p.blocks(&d.description, &ctx_for(&f.param_names()));
    }
    for t in &types {
        match t.kind {
            Kind::Aggregate | Kind::Enum => {
                p.ss(&t.name);
                p.blocks(&doc::blocks(&t.doc), &none);
                let sep = if t.kind == Kind::Enum { "," } else { ";" };
                let mut def = format!("{} {{\n", t.decl);
                for f in &t.fields {
                    def.push_str(&format!("    {}{sep}\n", f.decl));
                }
                def.push_str("};");
                p.block(&Block::Code(def), &none);
                for f in &t.fields {
                    let tag = if t.kind == Kind::Enum {
                        format!(".B {}", arg(&f.name))
                    } else {
                        format!(".I {}", arg(&f.name))
                    };
                    let body = if f.doc.trim().is_empty() {
                        vec![Block::Para("Not documented.".into())]
                    } else {
                        doc::blocks(&f.doc)
                    };
                    p.tagged(&tag, &body, &none);
                }
            }
            Kind::FnPointer | Kind::Alias if !t.doc.trim().is_empty() => {
                p.ss(&t.name);
                let names: Vec<String> = t.params.iter().map(|x| x.name.clone()).collect();
                p.blocks(&doc::blocks(&t.doc), &ctx_for(&names));
            }
            _ => {}
        }
    }
    if !consts.is_empty() {
        p.ss("Constants");
        for k in &consts {
            let body =
                if k.doc.trim().is_empty() { vec![Block::Para("Not documented.".into())] } else { doc::blocks(&k.doc) };
            p.tagged(&format!(".BR {} {}", arg(&k.name), arg(&format!(" ({})", k.value))), &body, &none);
        }
    }

    p.sh("RETURN VALUE");
    for (f, d) in fns.iter().zip(&docs) {
        if group {
            p.ss(&format!("{}()", f.name));
        }
        if !d.returns.is_empty() {
            p.blocks(&d.returns, &ctx_for(&f.param_names()));
        } else if f.ret == "void" {
            p.para_roff(&format!("{} returns no value.\n", fn_ref(&f.name)));
        } else {
            p.para_roff("See DESCRIPTION.\n");
        }
    }

    let with_errors: Vec<usize> =
        (0..fns.len()).filter(|&i| !errors[i].codes.is_empty() || !errors[i].others.is_empty()).collect();
    if !with_errors.is_empty() {
        p.sh("ERRORS");
        for &i in &with_errors {
            let (f, e) = (fns[i], &errors[i]);
            let ctx = ctx_for(&f.param_names());
            if with_errors.len() > 1 {
                p.ss(&format!("{}()", f.name));
            }
            let intro = match e.convention {
                Convention::Errno => format!("On failure {} sets \\fIerrno\\fR to one of:\n", fn_ref(&f.name)),
                _ => format!("On failure {} returns one of these values, negated:\n", fn_ref(&f.name)),
            };
            p.para_roff(&intro);
            for code in &e.codes {
                let body: Vec<Block> = if code.reasons.is_empty() {
                    // what the code means wherever it appears, else the text above
                    let generic = if code.code == "ENOMEM" { "Out of memory." } else { "See DESCRIPTION." };
                    vec![Block::Para(generic.into())]
                } else {
                    code.reasons.iter().map(|r| Block::Para(sentence(r))).collect()
                };
                p.tagged(&format!(".B {}", code.code), &body, &ctx);
            }
            if !e.others.is_empty() {
                let list: Vec<String> = e.others.iter().map(|o| inline(o, &ctx)).collect();
                p.para_roff(&format!("Other failures: {}.\n", list.join("; ")));
            }
        }
    }

    p.sh("NOTES");
    let by_conv = |want: Convention| -> Vec<String> {
        fns.iter().zip(&errors).filter(|(_, e)| e.convention == want).map(|(f, _)| f.name.clone()).collect()
    };
    let errno = by_conv(Convention::Errno);
    let negative = by_conv(Convention::Negative);
    if !errno.is_empty() {
        let verb = if errno.len() > 1 { "report" } else { "reports" };
        p.para_roff(&format!(
            "Error convention: {} {verb} failure like librdmacm, through \\fIerrno\\fR; see \\fBrdmasafe\\fR(7).\n",
            names_list(&errno)
        ));
    }
    if !negative.is_empty() {
        let ret = if negative.len() > 1 { "return" } else { "returns" };
        p.para_roff(&format!(
            "Error convention: {} {ret} a negative errno value on failure; \\fIerrno\\fR is unspecified \
             afterwards, even on success; see \\fBrdmasafe\\fR(7).\n",
            names_list(&negative)
        ));
    }
    let per_fn = |p: &mut Page, title: &str, pick: &dyn Fn(&FnDoc) -> Vec<Block>| {
        let parts: Vec<(usize, Vec<Block>)> =
            docs.iter().enumerate().map(|(i, d)| (i, pick(d))).filter(|(_, b)| !b.is_empty()).collect();
        if parts.is_empty() {
            return;
        }
        p.ss(title);
        for (i, blocks) in parts {
            let ctx = ctx_for(&fns[i].param_names());
            if group {
                p.tagged(&format!(".BR {} ()", arg(&fns[i].name)), &blocks, &ctx);
            } else {
                p.blocks(&blocks, &ctx);
            }
        }
    };
    per_fn(&mut p, "Thread safety", &|d: &FnDoc| {
        if d.thread.is_empty() {
            vec![]
        } else {
            vec![Block::Para(d.thread.join(" "))]
        }
    });
    per_fn(&mut p, "Caller requirements", &|d: &FnDoc| d.safety.clone());
    per_fn(&mut p, "More", &|d: &FnDoc| d.notes.clone());

    if docs.iter().any(|d| !d.examples.is_empty()) {
        p.sh("EXAMPLES");
        for (f, d) in fns.iter().zip(&docs) {
            if group && !d.examples.is_empty() {
                p.ss(&format!("{}()", f.name));
            }
            p.blocks(&d.examples, &ctx_for(&f.param_names()));
        }
    }

    p.sh("SEE ALSO");
    let structs = struct_names(c.header_src);
    let mut refs: BTreeSet<String> = BTreeSet::new();
    for t in &texts {
        for g in &h.functions {
            if !page.functions.contains(&g.name) && contains_word(t, &g.name) {
                refs.insert(g.name.clone());
            }
        }
    }
    for f in &fns {
        refs.extend(foreign_functions(&f.doc, &structs));
    }
    let mut lines: Vec<String> = refs.iter().map(|r| format!(".BR {} (3)", arg(r))).collect();
    lines.push(".BR rdmasafe (7)".into());
    let n = lines.len();
    for (k, l) in lines.into_iter().enumerate() {
        p.raw(&if k + 1 < n { format!("{l},") } else { l });
    }
    p.out
}

/// rdmasafe(7) from man/rdmasafe.7.md: `# X` starts section X, `## Y` a
/// subsection, `<!-- functions -->` becomes the list of the function pages;
/// other HTML comments are dropped.
fn seven(c: &Ctxs, md: &str, pages: &[PagePlan]) -> Result<String, String> {
    let mut p = Page::new(COMMENT);
    p.th("RDMASAFE", "7", &format!("rdmasafe {}", c.version), MANUAL);
    let none = Ctx::default();
    let mut chunk = String::new();
    let mut section = String::new();
    let mut placeholders = 0;
    let flush = |p: &mut Page, chunk: &mut String, section: &str| -> Result<(), String> {
        if section == "NAME" {
            let text = chunk.split_whitespace().collect::<Vec<_>>().join(" ");
            let (name, what) = text.split_once(" - ").ok_or("rdmasafe.7.md: NAME must read \"name - description\"")?;
            p.raw(&format!("{} \\- {}", escape(name), escape(what)));
        } else {
            p.blocks(&doc::blocks(chunk), &none);
        }
        chunk.clear();
        Ok(())
    };
    let mut in_comment = false;
    for line in md.lines() {
        let t = line.trim();
        if t == "<!-- functions -->" {
            flush(&mut p, &mut chunk, &section)?;
            placeholders += 1;
            for pg in pages {
                let mut body = format!("{}.", escape(&pg.summary));
                if pg.functions.len() > 1 {
                    let others: Vec<String> =
                        pg.functions[1..].iter().map(|n| format!("\\fB{}\\fR(3)", escape(n))).collect();
                    body.push_str(&format!("\nAlso on this page: {}.", others.join(", ")));
                }
                p.block(&Block::Roff(format!(".TP\n\\fB{}\\fR(3)\n{body}", escape(&pg.name))), &none);
            }
            continue;
        }
        if in_comment || t.starts_with("<!--") {
            in_comment = !t.ends_with("-->");
            continue;
        }
        if let Some(title) = line.strip_prefix("# ") {
            flush(&mut p, &mut chunk, &section)?;
            section = title.trim().to_string();
            p.sh(&section);
        } else if let Some(title) = line.strip_prefix("## ") {
            flush(&mut p, &mut chunk, &section)?;
            p.ss(title.trim());
        } else {
            chunk.push_str(line);
            chunk.push('\n');
        }
    }
    flush(&mut p, &mut chunk, &section)?;
    if placeholders != 1 {
        return Err(format!("rdmasafe.7.md must have one <!-- functions --> line, has {placeholders}"));
    }
    Ok(p.out)
}

/// All pages: `man3/NAME.3` (and `.so` link pages for the other functions
/// of a grouped page) and `man7/rdmasafe.7`.
pub fn generate(
    header_src: &str,
    groups: &str,
    seven_md: &str,
    version: &str,
) -> Result<BTreeMap<String, String>, String> {
    let h = cheader::parse(header_src)?;
    if h.functions.is_empty() {
        return Err("the header declares no function".into());
    }
    let pages = plan(&h, &parse_groups(groups)?)?;
    let c = Ctxs { h: &h, header_src, version };
    let mut files = BTreeMap::new();
    for page in &pages {
        files.insert(format!("man3/{}.3", page.name), function_page(&c, page));
        for other in &page.functions[1..] {
            files.insert(format!("man3/{other}.3"), format!(".so man3/{}.3\n", page.name));
        }
    }
    files.insert("man7/rdmasafe.7".into(), seven(&c, seven_md, &pages)?);
    Ok(files)
}
