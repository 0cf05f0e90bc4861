//! The project's documentation stands alone: a user of the repository has
//! nothing outside it. `docs_stay_inside_the_repository` reads README.md,
//! docs/**/*.md and man/*.md and fails on
//! - a Markdown link (`[text](target)`, `![alt](target)`, `[ref]: target`,
//!   `<scheme://...>`) whose target is a URL, an absolute path, or a
//!   relative path that leaves the repository or names no file in it;
//! - any other text with a URL (`scheme://`) or a relative path with `../`
//!   that leaves the repository (code blocks included).
//!
//!
//! `docs_name_tests_that_exist` fails on a test cited in those Markdown
//! files as `file.rs::name` or `test_file_stem::name` (the docs cite the
//! test that shows a claim) that no `.rs` file of that path in the
//! repository defines as `fn name`: a renamed test leaves a stale citation
//! otherwise.
//!
//! Runs on the host, reads files only.

use std::fs;
use std::path::{Component, Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

fn markdown_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else { return };
    let mut entries: Vec<PathBuf> = entries.flatten().map(|e| e.path()).collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            markdown_files(&p, out);
        } else if p.extension().is_some_and(|e| e == "md") {
            out.push(p);
        }
    }
}

/// `base` joined with `rel`, `.` and `..` resolved without the file
/// system (the path need not exist).
fn resolve(base: &Path, rel: &str) -> PathBuf {
    let mut out = PathBuf::new();
    for c in base.join(rel).components() {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}

/// Targets of the Markdown links on one line.
fn link_targets(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = line;
    while let Some(at) = rest.find("](") {
        let tail = &rest[at + 2..];
        let mut depth = 0;
        let mut end = tail.len();
        for (i, c) in tail.char_indices() {
            match c {
                '(' => depth += 1,
                ')' if depth == 0 => {
                    end = i;
                    break;
                }
                ')' => depth -= 1,
                _ => {}
            }
        }
        out.push(tail[..end].split_whitespace().next().unwrap_or("").to_string());
        rest = &tail[end.min(tail.len())..];
    }
    // [ref]: target
    let t = line.trim_start();
    if t.starts_with('[') {
        if let Some((_, target)) = t.split_once("]: ") {
            out.push(target.split_whitespace().next().unwrap_or("").to_string());
        }
    }
    // <scheme://...>
    let mut rest = line;
    while let Some(at) = rest.find('<') {
        let tail = &rest[at + 1..];
        if let Some(end) = tail.find('>') {
            if tail[..end].contains("://") {
                out.push(tail[..end].to_string());
            }
            rest = &tail[end..];
        } else {
            break;
        }
    }
    out
}

fn check_file(root: &Path, file: &Path, problems: &mut Vec<String>) {
    let text = fs::read_to_string(file).unwrap_or_else(|e| panic!("read {}: {e}", file.display()));
    let rel_file = file.strip_prefix(root).unwrap_or(file).display().to_string();
    let dir = file.parent().unwrap();
    for (n, line) in text.lines().enumerate() {
        let at = format!("{rel_file}:{}", n + 1);
        let targets = link_targets(line);
        for target in &targets {
            let path = target.split('#').next().unwrap_or("");
            if target.is_empty() || (path.is_empty() && target.starts_with('#')) {
                continue; // an anchor on the same page
            }
            if target.contains("://") || target.starts_with("mailto:") {
                problems.push(format!("{at}: a link leaves the repository: {target}"));
                continue;
            }
            if path.starts_with('/') || path.starts_with('~') {
                problems.push(format!("{at}: an absolute link (make it relative to the file): {target}"));
                continue;
            }
            let resolved = resolve(dir, path);
            if !resolved.starts_with(root) {
                problems.push(format!("{at}: a link leaves the repository: {target}"));
            } else if !resolved.exists() {
                problems.push(format!("{at}: a link to a file that does not exist: {target}"));
            }
        }
        for token in line.split(|c: char| c.is_whitespace() || "()[]<>`\"',;|*".contains(c)) {
            if targets.iter().any(|t| t == token) {
                continue; // checked as a link above
            }
            if token.contains("://") {
                problems.push(format!("{at}: a URL: {token}"));
            } else if token.contains("../") {
                let start = token.find("../").unwrap();
                let resolved = resolve(dir, &token[start..]);
                if !resolved.starts_with(root) {
                    problems.push(format!("{at}: a path that leaves the repository: {token}"));
                }
            }
        }
    }
}

/// The Markdown the checks read: README.md, docs/**/*.md, man/*.md.
fn doc_files(root: &Path) -> Vec<PathBuf> {
    let mut files = vec![root.join("README.md")];
    markdown_files(&root.join("docs"), &mut files);
    markdown_files(&root.join("man"), &mut files);
    files
}

#[test]
fn docs_stay_inside_the_repository() {
    let root = root();
    let files = doc_files(&root);
    assert!(files.len() >= 5, "too few Markdown files: {files:?}");
    let mut problems = Vec::new();
    for f in &files {
        check_file(&root, f, &mut problems);
    }
    println!("[doc_links] {} files checked", files.len());
    assert!(
        problems.is_empty(),
        "the docs must stand alone (describe an outside source by name instead of linking it):\n  {}",
        problems.join("\n  ")
    );
}

#[test]
fn the_checks_catch_what_they_should() {
    let dir = std::env::temp_dir().join(format!("rdmasafe-links-{}", std::process::id()));
    let inside = dir.join("repo");
    fs::create_dir_all(inside.join("docs")).unwrap();
    fs::write(inside.join("docs/a.md"), "x").unwrap();
    let doc = inside.join("docs/t.md");
    fs::write(
        &doc,
        "ok [a](a.md) [b](../docs/a.md#x) [c](#top) `../docs/a.md`\n\
         bad [d](../../outside.md) [e](https://example.org) [f](/etc/passwd) [g](missing.md)\n\
         bad see `../../shared/notes/x.md` and http://example.org\n[r]: ../../r.md\n",
    )
    .unwrap();
    let mut problems = Vec::new();
    check_file(&inside, &doc, &mut problems);
    let _ = fs::remove_dir_all(&dir);
    assert!(problems.iter().all(|p| !p.contains(":1:")), "false alarms on line 1: {problems:?}");
    for want in [
        "../../outside.md",
        "https://example.org",
        "/etc/passwd",
        "missing.md",
        "../../shared/notes/x.md",
        "http://example.org",
        "../../r.md",
    ] {
        assert!(problems.iter().any(|p| p.ends_with(want)), "not caught: {want}: {problems:?}");
    }
    assert_eq!(problems.len(), 7, "{problems:?}");
}

/// The `.rs` files below `dir`, but for build output and hidden folders.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else { return };
    for p in entries.flatten().map(|e| e.path()) {
        let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if p.is_dir() {
            if name != "target" && !name.starts_with('.') {
                rust_files(&p, out);
            }
        } else if name.ends_with(".rs") {
            out.push(p);
        }
    }
}

/// The test citations on one line, as (path or stem as written, name):
/// `path/file.rs::name`, `file.rs::name`, and `stem::name` where `stem`
/// is the name of a file in `stems` (the test files: `rxe_cq_loop::name`;
/// a Rust path such as `std::thread` is no citation).
fn test_citations(line: &str, stems: &[String]) -> Vec<(String, String)> {
    let word = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let path_char = |c: char| word(c) || "/.-".contains(c);
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(at) = line[from..].find("::") {
        let at = from + at;
        from = at + 2;
        // The path before "::" (char boundaries: the text may hold any
        // character), the name after it.
        let start = line[..at].char_indices().rev().find(|&(_, c)| !path_char(c)).map_or(0, |(i, c)| i + c.len_utf8());
        let rest = &line[at + 2..];
        let end = rest.find(|c: char| !word(c)).unwrap_or(rest.len());
        let (path, name) = (&line[start..at], &rest[..end]);
        if path.is_empty() || name.is_empty() {
            continue;
        }
        if path.ends_with(".rs") || stems.iter().any(|s| s == path) {
            out.push((path.to_string(), name.to_string()));
        }
    }
    out
}

/// The stems of the test files among `sources` (`rxe_cm` for
/// `rdmasafe-core/tests/rxe_cm.rs`).
fn test_stems(sources: &[PathBuf]) -> Vec<String> {
    let mut stems: Vec<String> = sources
        .iter()
        .filter(|p| p.parent().and_then(|d| d.file_name()).is_some_and(|d| d == "tests"))
        .filter_map(|p| p.file_stem().and_then(|s| s.to_str()).map(str::to_string))
        .collect();
    stems.sort();
    stems.dedup();
    stems
}

/// The citations of `file` that name no `fn` in a file of that path.
fn check_citations(
    root: &Path,
    file: &Path,
    sources: &[PathBuf],
    stems: &[String],
    problems: &mut Vec<String>,
) -> usize {
    let text = fs::read_to_string(file).unwrap_or_else(|e| panic!("read {}: {e}", file.display()));
    let rel_file = file.strip_prefix(root).unwrap_or(file).display().to_string();
    let mut cited = 0;
    for (n, line) in text.lines().enumerate() {
        for (path, name) in test_citations(line, stems) {
            cited += 1;
            // A path relative to the doc ("../rdmasafe-core/tests/x.rs")
            // or the repository ("rdmasafe-core/tests/x.rs"), or a name
            // alone: matched as the end of a source's path.
            let tail = path.trim_start_matches(['.', '/']);
            let tail = if tail.ends_with(".rs") { tail.to_string() } else { format!("{tail}.rs") };
            let defines = |p: &PathBuf| {
                let rel = p.strip_prefix(root).unwrap_or(p).to_string_lossy().replace('\\', "/");
                (rel == tail || rel.ends_with(&format!("/{tail}")))
                    && fs::read_to_string(p)
                        .is_ok_and(|t| t.contains(&format!("fn {name}(")) || t.contains(&format!("fn {name}<")))
            };
            if !sources.iter().any(defines) {
                problems.push(format!("{rel_file}:{}: {path}::{name} names no fn of that file", n + 1));
            }
        }
    }
    cited
}

#[test]
fn docs_name_tests_that_exist() {
    let root = root();
    let files = doc_files(&root);
    let mut sources = Vec::new();
    rust_files(&root, &mut sources);
    let stems = test_stems(&sources);
    let mut problems = Vec::new();
    let cited: usize = files.iter().map(|f| check_citations(&root, f, &sources, &stems, &mut problems)).sum();
    println!("[doc_links] {cited} test citations in {} files", files.len());
    assert!(cited >= 10, "the docs cite fewer tests than expected ({cited}): is the pattern still file.rs::name?");
    assert!(problems.is_empty(), "stale test citations:\n  {}", problems.join("\n  "));
}

#[test]
fn the_citation_check_catches_a_renamed_test() {
    let dir = std::env::temp_dir().join(format!("rdmasafe-cites-{}", std::process::id()));
    fs::create_dir_all(dir.join("x/tests")).unwrap();
    fs::create_dir_all(dir.join("docs")).unwrap();
    fs::write(dir.join("x/tests/rxe_a.rs"), "#[test]\nfn kept() {}\nfn generic<T>() {}\n").unwrap();
    let doc = dir.join("docs/d.md");
    fs::write(
        &doc,
        "`rxe_a.rs::kept`, x/tests/rxe_a.rs::generic, \u{201c}rxe_a::kept\u{201d}, ../x/tests/rxe_a.rs::kept;\n\
         std::thread::spawn and rdmasafe_core::cq are no citations\n\
         (`rxe_a.rs::renamed`, `rxe_b.rs::kept`, \u{201c}rxe_a::gone\u{201d})\n",
    )
    .unwrap();
    let mut sources = Vec::new();
    rust_files(&dir, &mut sources);
    let mut problems = Vec::new();
    let cited = check_citations(&dir, &doc, &sources, &test_stems(&sources), &mut problems);
    let _ = fs::remove_dir_all(&dir);
    assert_eq!(cited, 7, "{problems:?}");
    assert_eq!(problems.len(), 3, "{problems:?}");
    assert!(problems.iter().all(|p| p.contains("d.md:3:")), "{problems:?}");
    for want in ["rxe_a.rs::renamed", "rxe_b.rs::kept", "rxe_a::gone"] {
        assert!(problems.iter().any(|p| p.contains(want)), "not caught: {want}: {problems:?}");
    }
}
