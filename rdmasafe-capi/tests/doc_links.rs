//! The project's documentation stands alone: a user of the repository has
//! nothing outside it. `docs_stay_inside_the_repository` reads README.md,
//! docs/**/*.md and man/*.md and fails on
//! - a Markdown link (`[text](target)`, `![alt](target)`, `[ref]: target`,
//!   `<scheme://...>`) whose target is a URL, an absolute path, or a
//!   relative path that leaves the repository or names no file in it;
//! - any other text with a URL (`scheme://`) or a relative path with `../`
//!   that leaves the repository (code blocks included).
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

#[test]
fn docs_stay_inside_the_repository() {
    let root = root();
    let mut files = vec![root.join("README.md")];
    markdown_files(&root.join("docs"), &mut files);
    markdown_files(&root.join("man"), &mut files);
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
