//! The man pages (man/man3/*.3, man/man7/rdmasafe.7) are GENERATED from
//! include/rdmasafe.h by the generator in this directory and checked in.
//!
//! Regenerate after a header change (regenerate the header first):
//!
//!     RDMASAFE_BLESS=1 cargo test -p rdmasafe-capi --test header
//!     RDMASAFE_BLESS=1 cargo test -p rdmasafe-capi --test manpages
//!
//! Inputs: include/rdmasafe.h (every function's prototype and doc
//! comment, the structs, callback types and constants they use),
//! man/groups.txt (which functions share a page) and man/rdmasafe.7.md
//! (the text of rdmasafe(7)). Nothing else about particular functions is
//! written here. The generator (cheader.rs reads the header, doc.rs
//! splits a doc comment into description / returns / errors / thread
//! safety / caller requirements, roff.rs writes man(7) roff, pages.rs
//! assembles the pages) uses no external tool; groff only lints the result.
//!
//! Tests:
//! - `pages_are_up_to_date`: the checked-in pages are what the generator
//!   writes from the checked-in header (RDMASAFE_BLESS=1 rewrites them and
//!   removes pages of functions that are gone);
//! - `every_export_has_a_page`: each function of rdmasafe-capi/abi/exports.txt
//!   has man3/NAME.3, a page or a `.so` link to one, whose NAME line lists it
//!   and whose SYNOPSIS has its prototype as the header declares it;
//! - `groff_reports_nothing`: `groff -man -ww -z` (for -Tutf8 and the
//!   default device) is silent for every page, `.so` links included;
//! - `no_doc_text_is_lost`: every clause of every function's doc comment,
//!   and of the structs (but opaque ones) and callback types it uses, is on
//!   its page;
//! - `generator_follows_the_header`: a different header (a struct with a
//!   leading `size` field, a new error code, an ungrouped function, a
//!   `(void)` function, `# Errors` / `# Thread safety` sections, a
//!   `PREFIX_*` constant reference) gives the pages it should.

mod cheader;
mod doc;
mod pages;
mod roff;

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

fn read(rel: &str) -> String {
    fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("read {rel}: {e}"))
}

fn generate_from_tree() -> BTreeMap<String, String> {
    pages::generate(
        &read("include/rdmasafe.h"),
        &read("man/groups.txt"),
        &read("man/rdmasafe.7.md"),
        env!("CARGO_PKG_VERSION"),
    )
    .unwrap_or_else(|e| panic!("the man page generator: {e}"))
}

/// The checked-in pages: man3/* and man7/* relative to man/.
fn checked_in(man: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for sec in ["man3", "man7"] {
        let Ok(dir) = fs::read_dir(man.join(sec)) else { continue };
        for e in dir.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            out.insert(format!("{sec}/{name}"), fs::read_to_string(e.path()).unwrap_or_default());
        }
    }
    out
}

#[test]
fn pages_are_up_to_date() {
    let man = root().join("man");
    let fresh = generate_from_tree();
    let old = checked_in(&man);
    if std::env::var_os("RDMASAFE_BLESS").is_some() {
        for (rel, text) in &fresh {
            let path = man.join(rel);
            fs::create_dir_all(path.parent().unwrap()).unwrap();
            fs::write(&path, text).unwrap();
        }
        for rel in old.keys().filter(|k| !fresh.contains_key(*k)) {
            fs::remove_file(man.join(rel)).unwrap();
        }
        return;
    }
    let mut problems = Vec::new();
    for (rel, text) in &fresh {
        match old.get(rel) {
            None => problems.push(format!("man/{rel} is missing")),
            Some(o) if o != text => problems.push(format!("man/{rel} is stale")),
            _ => {}
        }
    }
    for rel in old.keys().filter(|k| !fresh.contains_key(*k)) {
        problems.push(format!("man/{rel} is not generated any more"));
    }
    assert!(
        problems.is_empty(),
        "the man pages do not match include/rdmasafe.h:\n  {}\nregenerate with RDMASAFE_BLESS=1 cargo test -p rdmasafe-capi --test manpages",
        problems.join("\n  ")
    );
}

// ------------------------------------------------------- roff as text

/// After `\\f`: skips `B`, `I`, `R`, `P` or `[NAME]`.
fn skip_font_name(it: &mut std::iter::Peekable<std::str::Chars>) {
    if it.next() == Some('[') {
        for x in it.by_ref() {
            if x == ']' {
                break;
            }
        }
    }
}

fn unescape(s: &str) -> String {
    let mut out = String::new();
    let mut it = s.chars().peekable();
    while let Some(c) = it.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match it.next() {
            Some('f') => skip_font_name(&mut it),
            Some('-') => out.push('-'),
            Some('e') => out.push('\\'),
            Some('&') | Some('%') => {}
            Some('(') => {
                let name: String = [it.next(), it.next()].iter().flatten().collect();
                out.push_str(match name.as_str() {
                    "aq" => "'",
                    "ga" => "`",
                    "ha" => "^",
                    "ti" => "~",
                    "dq" => "\"",
                    "bu" => "*",
                    _ => "?",
                });
            }
            Some('[') => {
                let name: String = it.by_ref().take_while(|&x| x != ']').collect();
                let ch = name.strip_prefix('u').and_then(|h| u32::from_str_radix(h, 16).ok()).and_then(char::from_u32);
                out.push(ch.unwrap_or('?'));
            }
            Some(x) => out.push(x),
            None => {}
        }
    }
    out
}

fn macro_args(s: &str) -> Vec<String> {
    let mut args = Vec::new();
    let mut cur = String::new();
    let mut quoted = false;
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '"' if quoted && chars.peek() == Some(&'"') => {
                chars.next();
                cur.push('"');
            }
            '"' => quoted = !quoted,
            ' ' if !quoted => {
                if !cur.is_empty() {
                    args.push(std::mem::take(&mut cur));
                }
            }
            c => cur.push(c),
        }
    }
    if !cur.is_empty() {
        args.push(cur);
    }
    args
}

/// A page as plain text, by section: (section title, lines).
fn sections(page: &str) -> Vec<(String, Vec<String>)> {
    let mut out: Vec<(String, Vec<String>)> = vec![(String::new(), Vec::new())];
    for line in page.lines() {
        if let Some(m) = line.strip_prefix('.') {
            let (name, rest) = m.split_once(' ').unwrap_or((m, ""));
            let args = macro_args(rest);
            let text = match name {
                "SH" => {
                    out.push((unescape(&args.join(" ")), Vec::new()));
                    continue;
                }
                "B" | "I" | "SS" => args.join(" "),
                "BI" | "BR" | "IR" | "IB" | "RB" | "RI" => args.concat(),
                _ => continue,
            };
            out.last_mut().unwrap().1.push(unescape(&text));
        } else {
            out.last_mut().unwrap().1.push(unescape(line));
        }
    }
    out
}

fn section<'a>(s: &'a [(String, Vec<String>)], title: &str) -> Option<&'a Vec<String>> {
    s.iter().find(|(t, _)| t == title).map(|(_, l)| l)
}

fn norm_ws(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ").replace("( ", "(").replace(" )", ")")
}

fn words(s: &str) -> Vec<String> {
    s.split(|c: char| !c.is_alphanumeric()).filter(|w| !w.is_empty()).map(|w| w.to_lowercase()).collect()
}

fn contains_seq(hay: &[String], needle: &[String]) -> bool {
    needle.is_empty() || hay.windows(needle.len()).any(|w| w == needle)
}

// -------------------------------------------------------------- exports

#[test]
fn every_export_has_a_page() {
    let man = root().join("man");
    let header = cheader::parse(&read("include/rdmasafe.h")).expect("parse include/rdmasafe.h");
    let exports: Vec<String> = read("rdmasafe-capi/abi/exports.txt")
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| l.split('@').next().unwrap().to_string())
        .collect();
    assert!(exports.len() >= 20, "exports.txt lists only {exports:?}");
    let mut problems = Vec::new();
    for name in &exports {
        let rel = format!("man3/{name}.3");
        let Ok(mut text) = fs::read_to_string(man.join(&rel)) else {
            problems.push(format!("{name}: no man/{rel}"));
            continue;
        };
        if let Some(target) = text.strip_prefix(".so ") {
            let target = target.trim();
            match fs::read_to_string(man.join(target)) {
                Ok(t) => text = t,
                Err(_) => {
                    problems.push(format!("{name}: man/{rel} links to {target}, which does not exist"));
                    continue;
                }
            }
        }
        let s = sections(&text);
        let name_line = section(&s, "NAME").map(|l| l.join(" ")).unwrap_or_default();
        let listed = name_line.split(" - ").next().unwrap_or("").split(", ").any(|n| n.trim() == name);
        if !listed {
            problems.push(format!("{name}: the NAME line of its page does not list it: {name_line:?}"));
        }
        let synopsis = norm_ws(&section(&s, "SYNOPSIS").map(|l| l.join(" ")).unwrap_or_default());
        match header.function(name) {
            Some(f) if synopsis.contains(&norm_ws(&f.prototype())) => {}
            Some(f) => {
                problems.push(format!("{name}: the SYNOPSIS lacks the prototype {:?}: {synopsis:?}", f.prototype()))
            }
            None => problems.push(format!("{name}: exported but include/rdmasafe.h does not declare it")),
        }
        for sec in ["DESCRIPTION", "RETURN VALUE", "NOTES", "SEE ALSO"] {
            if section(&s, sec).is_none_or(|l| l.iter().all(|x| x.trim().is_empty())) {
                problems.push(format!("{name}: its page has no {sec}"));
            }
        }
    }
    if !man.join("man7/rdmasafe.7").is_file() {
        problems.push("no man/man7/rdmasafe.7".into());
    }
    assert!(problems.is_empty(), "man pages of the exports:\n  {}", problems.join("\n  "));
}

// ----------------------------------------------------------------- lint

fn lint(dir: &Path, rels: &[String]) -> Vec<String> {
    let mut problems = Vec::new();
    for rel in rels {
        for device in [Some("-Tutf8"), None] {
            let mut cmd = Command::new("groff");
            cmd.current_dir(dir).env("LC_ALL", "C.UTF-8").args(["-man", "-ww", "-z"]);
            if let Some(d) = device {
                cmd.arg(d);
            }
            let out = cmd.arg(rel).output().expect("run groff (Debian package groff-base)");
            let stderr = String::from_utf8_lossy(&out.stderr);
            if !out.status.success() || !stderr.trim().is_empty() {
                problems.push(format!("groff -man -ww -z {} {rel}: {}\n{stderr}", device.unwrap_or(""), out.status));
            }
        }
    }
    problems
}

#[test]
fn groff_reports_nothing() {
    let man = root().join("man");
    let rels: Vec<String> = checked_in(&man).into_keys().collect();
    let exports = read("rdmasafe-capi/abi/exports.txt").lines().filter(|l| !l.trim().is_empty()).count();
    assert!(rels.len() > exports, "only {} pages under man/ for {exports} exports: {rels:?}", rels.len());
    let problems = lint(&man, &rels);
    assert!(problems.is_empty(), "{} lint report(s):\n{}", problems.len(), problems.join("\n"));
}

// ------------------------------------------------------- text coverage

/// The clauses of a text (sentences split at `;` and `:`), as words.
fn clauses(text: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    for b in doc::blocks(text) {
        let body = match b {
            doc::Block::Para(p) => vec![p],
            doc::Block::List(items) => items,
            doc::Block::Code(c) => vec![c],
            doc::Block::Heading(_) | doc::Block::Roff(_) => vec![],
        };
        for p in body {
            for s in doc::sentences(&p) {
                for c in s.split([';', ':']) {
                    let w = words(&c.replace('`', ""));
                    if !w.is_empty() {
                        out.push(w);
                    }
                }
            }
        }
    }
    out
}

fn check_coverage(files: &BTreeMap<String, String>, header: &cheader::Header) -> Vec<String> {
    let mut problems = Vec::new();
    for f in &header.functions {
        let Some(mut page) = files.get(&format!("man3/{}.3", f.name)).cloned() else {
            problems.push(format!("{}: no page", f.name));
            continue;
        };
        if let Some(t) = page.strip_prefix(".so ") {
            page = files.get(t.trim()).cloned().unwrap_or_default();
        }
        let text: Vec<String> = sections(&page).into_iter().flat_map(|(_, l)| l).collect();
        let hay = words(&text.join(" "));
        let mut docs = vec![(f.name.clone(), f.doc.clone())];
        for t in header.types.iter().filter(|t| t.kind != cheader::Kind::Opaque) {
            if pages::contains_word(&format!("{} {}", f.prototype(), f.doc), &t.name) {
                docs.push((t.name.clone(), t.doc.clone()));
                docs.extend(t.fields.iter().map(|x| (format!("{}.{}", t.name, x.name), x.doc.clone())));
            }
        }
        for (what, d) in docs {
            for c in clauses(&d) {
                if !contains_seq(&hay, &c) {
                    problems.push(format!("{}: the page lacks this text of {what}: {:?}", f.name, c.join(" ")));
                }
            }
        }
    }
    problems
}

#[test]
fn no_doc_text_is_lost() {
    let header = cheader::parse(&read("include/rdmasafe.h")).expect("parse include/rdmasafe.h");
    let files = generate_from_tree();
    let mut problems = check_coverage(&files, &header);
    problems.extend(check_constants(&files, &header));
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// Every constant the header documents is on a function page (a page
/// lists the constants its functions' docs name in full), and no page
/// shows a constant or field without its doc ("Not documented.").
fn check_constants(files: &BTreeMap<String, String>, header: &cheader::Header) -> Vec<String> {
    let mut problems = Vec::new();
    for k in header.consts.iter().filter(|k| !k.doc.trim().is_empty()) {
        let listed = format!(".BR \"{}\"", k.name);
        if !files.iter().any(|(name, page)| name.starts_with("man3/") && page.contains(&listed)) {
            problems.push(format!(
                "{}: documented in the header, on no page (name it in full in a function's doc)",
                k.name
            ));
        }
    }
    for (name, page) in files {
        if page.contains("Not documented.") {
            problems.push(format!("{name}: shows a constant or field without its doc"));
        }
    }
    problems
}

// ------------------------------------------------ a different header

const OTHER_HEADER: &str = r#"
#ifndef X_H
#define X_H
#include <stdint.h>

/**
 * First widget kind.
 */
#define RDMASAFE_WIDGET_A 1

/**
 * Second widget kind.
 */
#define RDMASAFE_WIDGET_B 2

/**
 * A widget (opaque).
 */
struct rdmasafe_widget;

/**
 * Options of `rdmasafe_widget_new`.
 */
struct rdmasafe_widget_options {
  /**
   * `sizeof(struct rdmasafe_widget_options)`: the library reads only what it covers.
   */
  size_t size;
  /**
   * One of RDMASAFE_WIDGET_*.
   */
  int kind;
  /**
   * Names, NUL-terminated.
   */
  char names[4][16];
};

/**
 * Called for each widget event.
 */
typedef int (*rdmasafe_widget_cb)(void *ctx, struct rdmasafe_widget *w);

#ifdef __cplusplus
extern "C" {
#endif // __cplusplus

/**
 * Creates a widget from `opts` (the whole struct up to `opts->size`).
 * Calls `cb` for every event, see `rdmasafe_version`.
 *
 * Returns 0, -EINVAL (`opts` NULL), -EOVERFLOW (`opts->size` larger than
 * the library knows and the extra bytes not zero), or a negative errno.
 *
 * # Thread safety
 * Not thread-safe with `rdmasafe_widget_free` on the same widget.
 *
 * # Safety
 * `opts` NULL or readable for `opts->size` bytes.
 */
int rdmasafe_widget_new(const struct rdmasafe_widget_options *opts,
                        rdmasafe_widget_cb cb,
                        void *ctx,
                        struct rdmasafe_widget **out);

/**
 * The library's version as "MAJOR.MINOR.PATCH", like `rdma_event_str`.
 * Returns a static string, never NULL.
 */
const char *rdmasafe_version(void);

/**
 * Frees a widget.
 *
 * # Errors
 * - `-EBUSY`: the widget is in use.
 * - `-EINVAL`: `w` is NULL.
 */
int rdmasafe_widget_free(struct rdmasafe_widget *w);

#ifdef __cplusplus
}  // extern "C"
#endif  // __cplusplus

#endif  /* X_H */
"#;

#[test]
fn generator_follows_the_header() {
    let groups = "rdmasafe_widget_new rdmasafe_widget_free -- make and free widgets\n";
    let seven = "# NAME\nrdmasafe - test\n\n# FUNCTIONS\n<!-- functions -->\n";
    let files = pages::generate(OTHER_HEADER, groups, seven, "9.8.7").expect("generate");
    let keys: Vec<&str> = files.keys().map(String::as_str).collect();
    assert_eq!(
        keys,
        ["man3/rdmasafe_version.3", "man3/rdmasafe_widget_free.3", "man3/rdmasafe_widget_new.3", "man7/rdmasafe.7"]
    );
    assert_eq!(files["man3/rdmasafe_widget_free.3"], ".so man3/rdmasafe_widget_new.3\n");

    let page = &files["man3/rdmasafe_widget_new.3"];
    let s = sections(page);
    let get = |t: &str| section(&s, t).map(|l| l.join("\n")).unwrap_or_default();
    assert_eq!(get("NAME"), "rdmasafe_widget_new, rdmasafe_widget_free - make and free widgets");
    let syn = norm_ws(&get("SYNOPSIS"));
    for want in [
        "#include <rdmasafe.h>",
        "struct rdmasafe_widget;",
        "typedef int (*rdmasafe_widget_cb)(void *ctx, struct rdmasafe_widget *w);",
        "int rdmasafe_widget_new(const struct rdmasafe_widget_options *opts, rdmasafe_widget_cb cb, void *ctx, struct rdmasafe_widget **out);",
        "int rdmasafe_widget_free(struct rdmasafe_widget *w);",
        "-lrdmasafe",
    ] {
        assert!(syn.contains(want), "SYNOPSIS lacks {want:?}:\n{syn}");
    }
    assert!(
        page.contains(".BI \"int rdmasafe_widget_new(const struct rdmasafe_widget_options *\" \"opts\" \",\""),
        "{page}"
    );
    let desc = get("DESCRIPTION");
    for want in [
        "struct rdmasafe_widget_options {",
        "size_t size;",
        "char names[4][16];",
        "RDMASAFE_WIDGET_A (1)",
        "RDMASAFE_WIDGET_B (2)",
        "Called for each widget event.",
    ] {
        assert!(desc.contains(want), "DESCRIPTION lacks {want:?}:\n{desc}");
    }
    assert!(!desc.contains("Returns"), "the Returns paragraph stays out of DESCRIPTION:\n{desc}");
    let errors = get("ERRORS");
    for want in
        ["EOVERFLOW", "opts->size larger than", "EBUSY", "The widget is in use.", "Other failures: a negative errno."]
    {
        assert!(errors.contains(want), "ERRORS lacks {want:?}:\n{errors}");
    }
    let notes = get("NOTES");
    for want in [
        "Not thread-safe with rdmasafe_widget_free",
        "Caller requirements",
        "readable for opts->size bytes",
        "negative errno value",
    ] {
        assert!(notes.contains(want), "NOTES lacks {want:?}:\n{notes}");
    }
    let see = norm_ws(&get("SEE ALSO"));
    assert_eq!(see, "rdmasafe_version(3), rdmasafe(7)");

    let v = sections(&files["man3/rdmasafe_version.3"]);
    assert_eq!(
        section(&v, "NAME").unwrap().join(""),
        "rdmasafe_version - the library's version as \"MAJOR.MINOR.PATCH\", like rdma_event_str"
    );
    assert!(norm_ws(&section(&v, "SYNOPSIS").unwrap().join(" ")).contains("const char *rdmasafe_version(void);"));
    assert!(section(&v, "ERRORS").is_none(), "no errors documented, no ERRORS section");
    assert!(norm_ws(&section(&v, "SEE ALSO").unwrap().join(" ")).contains("rdma_event_str(3)"));
    assert!(files["man7/rdmasafe.7"].contains("\\fBrdmasafe_version\\fR(3)"));
    assert!(files.values().all(|p| p.contains("9.8.7") || p.starts_with(".so")));

    let header = cheader::parse(OTHER_HEADER).unwrap();
    let problems = check_coverage(&files, &header);
    assert!(problems.is_empty(), "{}", problems.join("\n"));

    let dir = std::env::temp_dir().join(format!("rdmasafe-man-{}", std::process::id()));
    for (rel, text) in &files {
        let p = dir.join(rel);
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        fs::write(p, text).unwrap();
    }
    let problems = lint(&dir, &files.keys().cloned().collect::<Vec<_>>());
    let _ = fs::remove_dir_all(&dir);
    assert!(problems.is_empty(), "{}", problems.join("\n"));

    // what the generator refuses
    assert!(pages::generate(OTHER_HEADER, "rdmasafe_gone rdmasafe_version\n", seven, "1")
        .unwrap_err()
        .contains("rdmasafe_gone"));
    assert!(pages::generate("int f(int);\nstruct { oops", "", seven, "1").is_err());
}
