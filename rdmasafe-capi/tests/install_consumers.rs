//! rdmasafe installed and consumed like a real C library.
//!
//! `install_and_consume` (the big one):
//! 1. CMake configure / build / install into a fresh prefix under
//!    `<target>/install-consumers/` (cargo inside reuses the workspace
//!    target dir, so an up-to-date release build costs nothing);
//! 2. the installed tree: the ABI of `librdmasafe.so.X.Y.Z` (`nm -D
//!    --defined-only`) is exactly `rdmasafe-capi/abi/exports.txt`, every one
//!    under the RDMASAFE_0.2 node, and the same set of functions
//!    `include/rdmasafe.h` declares; SONAME `librdmasafe.so.X`; the two
//!    links; the static library, header, pkg-config and CMake package files;
//!    the man pages under share/man (`man -M` reads them, `.so` links too);
//!    what pkg-config answers for the prefix (relocatable paths, version,
//!    Libs.private); the in-tree C programs CMake built into `bin/`;
//!    librdmasafe-preload.so: its seven interposers exported unversioned
//!    (`rdmasafe-preload/abi/exports.txt`), pkg-config's `preload` variable;
//! 3. the consumers: `tests/consumer/cmake` (find_package,
//!    rdmasafe::rdmasafe and rdmasafe::rdmasafe_static) and
//!    `tests/consumer/make` (pkg-config, and `--static`) build the
//!    docs/migration "after" programs and the C++ consumer against the
//!    prefix; the "before" programs build with plain cc against
//!    librdmacm/libibverbs only; the DT_NEEDED entries of each say shared
//!    or static as intended;
//! 4. the C++ consumers run on the host (no device needed), with no
//!    LD_LIBRARY_PATH (the rpath must do); so does a C program built with
//!    AddressSanitizer against the installed library, which gets CM events
//!    from a stand-in librdmacm (tests/consumer/standin_rdmacm.c): no leak
//!    reported, exit 0; and one that makes a batch get on a blocking-mode
//!    channel runs under valgrind's memcheck with no error reported;
//! 5. all eight migration programs (before, after from CMake and make,
//!    shared and static) run in ONE Soft-RoCE guest (tests/bed/vm-run,
//!    tests/consumer/run-in-guest.sh); each must exit 0 with the output
//!    that shows the exchange worked; the "before" CM server also runs
//!    unmodified under the installed librdmasafe-preload.so, with the same
//!    output and every copy freed.
//!
//! `native_static_libs_match_rustc`: `rdmasafe-capi/abi/native-static-libs.txt`
//! (what CMake links the shared library with and writes into Libs.private
//! and rdmasafe::rdmasafe_static) equals what rustc reports for the
//! staticlib.
//!
//! `guide_snippets_match_their_sources`: every `<!-- snippet: FILE#NAME -->`
//! in docs/migrating-from-librdmacm.md and README.md is followed by a code
//! block byte-identical to the region between `/* guide:NAME begin */` and
//! `/* guide:NAME end */` in FILE, and every marked region is quoted.
//!
//! Runs on the host (the name does not start with `rxe_`); it boots the
//! guest itself, once. With RDMASAFE_DEVICE and RDMASAFE_ADDR set (real
//! hardware, opt-in) the device part runs on the host instead.

mod common;

use common::{blocks, root, Block};

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Instant;

/// The soname policy (docs/ABI.md): the number changes on every
/// incompatible ABI change, independently of the package version.
const SONAME: &str = "librdmasafe.so.1";
/// Seconds the guest may run before vm-run kills it.
const GUEST_TIMEOUT: u32 = 300;
/// Files whose `<!-- snippet: ... -->` markers are checked.
const GUIDES: &[&str] = &["docs/migrating-from-librdmacm.md", "README.md"];
/// The migration programs (each has guide regions).
const MIGRATION_DIR: &str = "docs/migration";

/// The cargo target dir this test was built into:
/// `<target>/<profile>/deps/install_consumers-<hash>`.
fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    exe.ancestors().nth(3).expect("<target>/<profile>/deps/<exe>").to_path_buf()
}

fn cargo() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| env!("CARGO").to_string())
}

fn log(msg: impl AsRef<str>) {
    println!("[install_consumers] {}", msg.as_ref());
}

fn output_text(out: &Output) -> String {
    format!(
        "--- stdout\n{}\n--- stderr\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Runs `cmd`; panics with its output unless it exits 0.
fn run(what: &str, cmd: &mut Command) -> Output {
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: cannot run {cmd:?}: {e}"));
    if !out.status.success() {
        panic!("{what} failed ({}): {cmd:?}\n{}", out.status, output_text(&out));
    }
    out
}

fn stdout_of(what: &str, cmd: &mut Command) -> String {
    String::from_utf8_lossy(&run(what, cmd).stdout).into_owned()
}

/// Collects failed expectations, so one run reports all of them.
#[derive(Default)]
struct Checks {
    failures: Vec<String>,
    passed: usize,
}

impl Checks {
    fn that(&mut self, ok: bool, what: impl Into<String>) -> bool {
        if ok {
            self.passed += 1;
        } else {
            self.failures.push(what.into());
        }
        ok
    }

    fn assert_all(self, what: &str) {
        log(format!("{what}: {} expectations met, {} failed", self.passed, self.failures.len()));
        assert!(
            self.failures.is_empty(),
            "{what}: {} failed expectation(s):\n  {}",
            self.failures.len(),
            self.failures.join("\n  ")
        );
    }
}

fn remove_dir(dir: &Path) {
    if dir.exists() {
        fs::remove_dir_all(dir).unwrap_or_else(|e| panic!("remove {}: {e}", dir.display()));
    }
}

// ------------------------------------------------------------ snippets

/// The regions `/* guide:NAME begin */` ... `/* guide:NAME end */` of a
/// file: NAME -> the lines strictly between the two marker lines.
fn regions(path: &Path, problems: &mut Vec<String>) -> BTreeMap<String, String> {
    let text = fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    let mut done = BTreeMap::new();
    let mut open: BTreeMap<String, (usize, String)> = BTreeMap::new();
    for (i, line) in text.split_inclusive('\n').enumerate() {
        let lineno = i + 1;
        let marker = line.find("/* guide:").map(|at| &line[at + "/* guide:".len()..]);
        if let Some(rest) = marker {
            let spec = rest.split("*/").next().unwrap_or("").trim();
            let (name, what) = spec.rsplit_once(' ').unwrap_or((spec, ""));
            let name = name.to_string();
            match what {
                "begin" => {
                    if open.contains_key(&name) || done.contains_key(&name) {
                        problems.push(format!("{}:{lineno}: region {name} begins twice", path.display()));
                    }
                    open.insert(name, (lineno, String::new()));
                }
                "end" => match open.remove(&name) {
                    Some((_, body)) => {
                        done.insert(name, body);
                    }
                    None => problems.push(format!("{}:{lineno}: region {name} ends but never began", path.display())),
                },
                _ => problems.push(format!("{}:{lineno}: bad guide marker {line:?}", path.display())),
            }
            // markers are not part of any region, not even an enclosing one
            continue;
        }
        for (_, body) in open.values_mut() {
            body.push_str(line);
        }
    }
    for (name, (lineno, _)) in open {
        problems.push(format!("{}:{lineno}: region {name} never ends", path.display()));
    }
    done
}

/// One `<!-- snippet: FILE#NAME -->` and the code block after it.
struct Snippet {
    guide: String,
    line: usize,
    file: String,
    name: String,
    body: String,
}

fn snippets(guide: &str, problems: &mut Vec<String>) -> Vec<Snippet> {
    let path = root().join(guide);
    let text = fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    let lines: Vec<&str> = text.split_inclusive('\n').collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i].trim();
        i += 1;
        let Some(spec) = line.strip_prefix("<!-- snippet:").and_then(|s| s.strip_suffix("-->")) else {
            continue;
        };
        let marker_line = i;
        let Some((file, name)) = spec.trim().split_once('#') else {
            problems.push(format!("{guide}:{marker_line}: snippet marker without #NAME: {line}"));
            continue;
        };
        if i >= lines.len() || !lines[i].starts_with("```") {
            problems.push(format!("{guide}:{marker_line}: the line after a snippet marker must open a ``` block"));
            continue;
        }
        i += 1;
        let mut body = String::new();
        let mut closed = false;
        while i < lines.len() {
            let l = lines[i];
            i += 1;
            if l.trim_end() == "```" {
                closed = true;
                break;
            }
            body.push_str(l);
        }
        if !closed {
            problems.push(format!("{guide}:{marker_line}: the snippet's code block never closes"));
        }
        out.push(Snippet {
            guide: guide.to_string(),
            line: marker_line,
            file: file.trim().to_string(),
            name: name.trim().to_string(),
            body,
        });
    }
    out
}

/// Where two texts first differ: (line number from 1, left line, right line).
fn first_difference(a: &str, b: &str) -> (usize, String, String) {
    let (la, lb): (Vec<&str>, Vec<&str>) = (a.split_inclusive('\n').collect(), b.split_inclusive('\n').collect());
    for n in 0..la.len().max(lb.len()) {
        let (x, y) = (la.get(n).copied().unwrap_or("<end>"), lb.get(n).copied().unwrap_or("<end>"));
        if x != y {
            return (n + 1, x.to_string(), y.to_string());
        }
    }
    (0, String::new(), String::new())
}

#[test]
fn guide_snippets_match_their_sources() {
    let root = root();
    let mut problems = Vec::new();
    let mut checked = 0;
    let mut sources: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
    let mut quoted: BTreeSet<(String, String)> = BTreeSet::new();

    // every C file in docs/migration, and whatever else a guide quotes
    let mut files: Vec<String> = fs::read_dir(root.join(MIGRATION_DIR))
        .expect("docs/migration")
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".c"))
        .map(|n| format!("{MIGRATION_DIR}/{n}"))
        .collect();
    files.sort();
    assert!(files.len() >= 4, "docs/migration has only {files:?}");
    for f in &files {
        let r = regions(&root.join(f), &mut problems);
        sources.insert(f.clone(), r);
    }

    for guide in GUIDES {
        for s in snippets(guide, &mut problems) {
            if !sources.contains_key(&s.file) {
                let path = root.join(&s.file);
                if !path.is_file() {
                    problems.push(format!("{}:{}: quotes {} which does not exist", s.guide, s.line, s.file));
                    continue;
                }
                let r = regions(&path, &mut problems);
                sources.insert(s.file.clone(), r);
            }
            let Some(region) = sources[&s.file].get(&s.name) else {
                problems.push(format!(
                    "{}:{}: {} has no region {} (mark it with /* guide:{} begin */ ... /* guide:{} end */)",
                    s.guide, s.line, s.file, s.name, s.name, s.name
                ));
                continue;
            };
            quoted.insert((s.file.clone(), s.name.clone()));
            checked += 1;
            if s.body.as_bytes() != region.as_bytes() {
                let (n, src, doc) = first_difference(region, &s.body);
                problems.push(format!(
                    "{}:{}: the snippet {}#{} differs from its source, first at line {n} of the region:\n      \
                     source: {src:?}\n      guide:  {doc:?}\n    \
                     copy the region (the lines between its markers) into the guide verbatim",
                    s.guide, s.line, s.file, s.name
                ));
            }
        }
    }
    for (file, regions) in &sources {
        for name in regions.keys() {
            if !quoted.contains(&(file.clone(), name.clone())) {
                problems.push(format!("{file}: region {name} is marked but no guide quotes it"));
            }
        }
    }
    log(format!("{checked} snippets compared with their sources"));
    assert!(checked >= 8, "only {checked} snippets found in {GUIDES:?}");
    assert!(problems.is_empty(), "guide snippets:\n  {}", problems.join("\n  "));
}

// ------------------------------------------------- native-static-libs

#[test]
fn native_static_libs_match_rustc() {
    let root = root();
    let file = root.join("rdmasafe-capi/abi/native-static-libs.txt");
    let want = fs::read_to_string(&file).expect("read native-static-libs.txt");
    let out = run(
        "cargo rustc --crate-type staticlib --print native-static-libs",
        Command::new(cargo())
            .current_dir(&root)
            .env("CARGO_TARGET_DIR", target_dir())
            .args(["rustc", "-p", "rdmasafe-capi", "--lib", "--crate-type", "staticlib", "--offline"])
            .args(["--", "--print", "native-static-libs"]),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    let got = stderr
        .lines()
        .find_map(|l| l.split_once("native-static-libs:").map(|(_, v)| v.trim().to_string()))
        .unwrap_or_else(|| panic!("rustc printed no native-static-libs note:\n{}", output_text(&out)));
    log(format!("rustc: native-static-libs: {got}"));
    let (w, g): (Vec<&str>, Vec<&str>) = (want.split_whitespace().collect(), got.split_whitespace().collect());
    assert_eq!(
        w,
        g,
        "rdmasafe-capi/abi/native-static-libs.txt is out of date.\n  file:  {}\n  rustc: {got}\n\
         If the change of native dependencies is intended, write rustc's list into the file \
         (one line) and reconfigure CMake: it links librdmasafe.so with it and writes it into \
         rdmasafe.pc (Libs.private) and rdmasafe::rdmasafe_static.",
        want.trim()
    );
}

// ------------------------------------------------------- the install

struct Layout {
    version: &'static str,
    soname: String,
    real: String,
    work: PathBuf,
    build: PathBuf,
    prefix: PathBuf,
    lib: PathBuf,
}

impl Layout {
    fn new() -> Layout {
        let version = env!("CARGO_PKG_VERSION");
        let work = target_dir().join("install-consumers");
        let prefix = work.join("prefix");
        Layout {
            version,
            soname: SONAME.to_string(),
            real: format!("librdmasafe.so.{version}"),
            build: work.join("build"),
            lib: prefix.join("lib"),
            prefix,
            work,
        }
    }
}

fn cmake_install(l: &Layout) {
    let root = root();
    let t = Instant::now();
    run(
        "cmake configure",
        Command::new("cmake")
            .arg("-S")
            .arg(&root)
            .arg("-B")
            .arg(&l.build)
            .arg(format!("-DRDMASAFE_CARGO_TARGET_DIR={}", target_dir().display())),
    );
    let t_build = Instant::now();
    run("cmake --build", Command::new("cmake").arg("--build").arg(&l.build).args(["-j", "2"]));
    let build_secs = t_build.elapsed().as_secs_f64();
    remove_dir(&l.prefix);
    run("cmake --install", Command::new("cmake").arg("--install").arg(&l.build).arg("--prefix").arg(&l.prefix));
    log(format!(
        "cmake configure + build (cargo inside: {build_secs:.1} s) + install into {} in {:.1} s",
        l.prefix.display(),
        t.elapsed().as_secs_f64()
    ));
}

/// The functions rdmasafe.h declares (outside comments).
fn header_functions(header: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in header.lines() {
        let t = line.trim_start();
        if t.starts_with('*') || t.starts_with("/*") || t.starts_with("//") || t.starts_with('#') {
            continue;
        }
        let mut rest = line;
        while let Some(at) = rest.find("rdmasafe_") {
            let tail = &rest[at..];
            let end = tail.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(tail.len());
            // a declaration's name is followed by its parameter list; a
            // function-pointer typedef's by ')'
            if tail[end..].starts_with('(') {
                names.insert(tail[..end].to_string());
            }
            rest = &tail[end..];
        }
    }
    names
}

fn check_abi(c: &mut Checks, l: &Layout) {
    let root = root();
    let so = l.lib.join(&l.real);
    let exports_file = root.join("rdmasafe-capi/abi/exports.txt");
    let listed: BTreeSet<String> = fs::read_to_string(&exports_file)
        .expect("read exports.txt")
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(String::from)
        .collect();
    let nm = stdout_of("nm -D --defined-only", Command::new("nm").args(["-D", "--defined-only"]).arg(&so));
    let mut exported = BTreeSet::new();
    let mut version_nodes = BTreeSet::new();
    for line in nm.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        let (kind, name) = match f.as_slice() {
            [_, kind, name] => (*kind, *name),
            [kind, name] => (*kind, *name),
            _ => continue,
        };
        if kind == "A" && !name.contains('@') {
            version_nodes.insert(name.to_string()); // a version definition
        } else {
            exported.insert(name.to_string());
        }
    }
    let added: Vec<&String> = exported.difference(&listed).collect();
    let removed: Vec<&String> = listed.difference(&exported).collect();
    c.that(
        added.is_empty() && removed.is_empty(),
        format!(
            "the ABI of {} differs from rdmasafe-capi/abi/exports.txt:\n    exported but not listed: {added:?}\n    \
             listed but not exported: {removed:?}\n    \
             If the change is intended, update the list on purpose:\n      \
             nm -D --defined-only {} | awk '$2 != \"A\" {{print $3}}' | sort > rdmasafe-capi/abi/exports.txt\n    \
             (a removed or changed function breaks users of the RDMASAFE_0.2 node: bump the node in \
             rdmasafe-capi/abi/rdmasafe.map and the soname instead)",
            l.real,
            so.display()
        ),
    );
    c.that(
        exported.iter().all(|n| n.starts_with("rdmasafe_") && n.ends_with("@@RDMASAFE_0.2")),
        format!("every exported symbol is rdmasafe_*@@RDMASAFE_0.2: {exported:?}"),
    );
    c.that(
        version_nodes == BTreeSet::from(["RDMASAFE_0.2".to_string()]),
        format!("version nodes {version_nodes:?} (want only RDMASAFE_0.2)"),
    );
    let header = fs::read_to_string(root.join("include/rdmasafe.h")).expect("read include/rdmasafe.h");
    let declared = header_functions(&header);
    let listed_names: BTreeSet<String> = listed.iter().map(|s| s.split('@').next().unwrap_or(s).to_string()).collect();
    c.that(
        declared == listed_names,
        format!(
            "include/rdmasafe.h declares {:?} not in exports.txt, and exports.txt lists {:?} the header \
             does not declare",
            declared.difference(&listed_names).collect::<Vec<_>>(),
            listed_names.difference(&declared).collect::<Vec<_>>()
        ),
    );
    log(format!(
        "ABI: {} symbols exported under {version_nodes:?}, {} functions in the header",
        exported.len(),
        declared.len()
    ));

    let dynamic = stdout_of("readelf -d", Command::new("readelf").arg("-d").arg(&so));
    let soname = dynamic
        .lines()
        .find_map(|l| l.split_once("Library soname: [").map(|(_, r)| r.trim_end_matches(']').to_string()));
    c.that(soname.as_deref() == Some(l.soname.as_str()), format!("SONAME {soname:?}, want {}", l.soname));
    c.that(!dynamic.contains("(RPATH)") && !dynamic.contains("(RUNPATH)"), "librdmasafe.so has no rpath/runpath");
}

/// librdmasafe-preload.so: installed in libdir, named by pkg-config's
/// `preload` variable, exporting exactly rdmasafe-preload/abi/exports.txt
/// and each of them unversioned (a program's versioned references bind to
/// an unversioned definition; under a version node of its own they would
/// not), and librdmacm / libibverbs among its DT_NEEDED.
fn check_preload(c: &mut Checks, l: &Layout) {
    let so = l.lib.join("librdmasafe-preload.so");
    c.that(so.is_file() && !so.is_symlink(), format!("{} is a regular file", so.display()));
    let listed: BTreeSet<String> = fs::read_to_string(root().join("rdmasafe-preload/abi/exports.txt"))
        .expect("read rdmasafe-preload/abi/exports.txt")
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(String::from)
        .collect();
    let nm = stdout_of("nm -D --defined-only", Command::new("nm").args(["-D", "--defined-only"]).arg(&so));
    let exported: BTreeSet<String> =
        nm.lines().filter_map(|line| line.split_whitespace().nth(2)).map(String::from).collect();
    c.that(exported == listed, format!("librdmasafe-preload.so exports {exported:?}, want {listed:?} (unversioned)"));
    // `readelf -W --dyn-syms`: a versioned definition reads name@VERSION
    let syms = stdout_of("readelf --dyn-syms", Command::new("readelf").args(["-W", "--dyn-syms"]).arg(&so));
    for name in &listed {
        let defs: Vec<&str> = syms
            .lines()
            .filter(|line| {
                let f: Vec<&str> = line.split_whitespace().collect();
                f.len() >= 8 && f[6] != "UND" && f[7].split('@').next() == Some(name.as_str())
            })
            .collect();
        c.that(
            defs.len() == 1 && !defs[0].contains('@'),
            format!("librdmasafe-preload.so defines {name} once, unversioned: {defs:?}"),
        );
    }
    let dynamic = stdout_of("readelf -d", Command::new("readelf").arg("-d").arg(&so));
    for lib in ["librdmacm.so.1", "libibverbs.so.1"] {
        c.that(dynamic.contains(&format!("[{lib}]")), format!("librdmasafe-preload.so needs {lib}"));
    }
    let var = stdout_of(
        "pkg-config --variable=preload rdmasafe",
        Command::new("pkg-config")
            .env("PKG_CONFIG_PATH", l.lib.join("pkgconfig"))
            .args(["--variable=preload", "rdmasafe"]),
    );
    let named = fs::canonicalize(shell_words(var.trim()).concat()).ok();
    c.that(
        named.is_some() && named == fs::canonicalize(&so).ok(),
        format!("pkg-config --variable=preload rdmasafe names {named:?}, want {}", so.display()),
    );
}

fn check_installed_files(c: &mut Checks, l: &Layout) {
    let root = root();
    let so = l.lib.join(&l.real);
    c.that(so.is_file() && !so.is_symlink(), format!("{} is a regular file", so.display()));
    for (link, to) in [(l.soname.clone(), l.real.clone()), ("librdmasafe.so".to_string(), l.soname.clone())] {
        let got = fs::read_link(l.lib.join(&link)).ok();
        c.that(got.as_deref() == Some(Path::new(&to)), format!("lib/{link} -> {to} (got {got:?})"));
    }
    for f in [
        "lib/librdmasafe.a",
        "lib/pkgconfig/rdmasafe.pc",
        "lib/cmake/rdmasafe/rdmasafeConfig.cmake",
        "lib/cmake/rdmasafe/rdmasafeConfigVersion.cmake",
    ] {
        c.that(l.prefix.join(f).is_file(), format!("installed {f}"));
    }
    let installed_header = fs::read(l.prefix.join("include/rdmasafe.h")).unwrap_or_default();
    let header = fs::read(root.join("include/rdmasafe.h")).expect("read include/rdmasafe.h");
    c.that(installed_header == header, "include/rdmasafe.h installed byte for byte");

    // the man pages of the tree (man/man3, man/man7) under share/man, and
    // man(1) reads them there, through a .so link page too
    let mandir = l.prefix.join("share/man");
    let mut pages = 0;
    for sec in ["man3", "man7"] {
        for e in fs::read_dir(root.join("man").join(sec)).expect("man/ of the tree").flatten() {
            let rel = format!("{sec}/{}", e.file_name().to_string_lossy());
            let installed = fs::read(mandir.join(&rel)).ok();
            c.that(installed == fs::read(e.path()).ok(), format!("share/man/{rel} installed byte for byte"));
            pages += 1;
        }
    }
    let exports = fs::read_to_string(root.join("rdmasafe-capi/abi/exports.txt")).unwrap_or_default();
    c.that(pages > exports.lines().count(), format!("{pages} man pages in the tree (one per export and rdmasafe(7))"));
    for (section, page, want) in [
        ("3", "rdmasafe_get_event_timeout", "int rdmasafe_get_event_timeout(struct rdma_event_channel *channel,"),
        ("7", "rdmasafe", "ERROR CONVENTIONS"),
    ] {
        let out = Command::new("man").env("MANWIDTH", "100").arg("-M").arg(&mandir).args([section, page]).output();
        let text = out.as_ref().map(|o| String::from_utf8_lossy(&o.stdout).into_owned()).unwrap_or_default();
        c.that(
            out.as_ref().is_ok_and(|o| o.status.success()) && text.contains("SYNOPSIS") && text.contains(want),
            format!("man -M {} {section} {page} shows the page ({want:?}): {out:?}", mandir.display()),
        );
    }

    // pkg-config on the prefix: relocatable paths, version, Libs.private
    let pc = |args: &[&str]| -> String {
        stdout_of(
            &format!("pkg-config {}", args.join(" ")),
            Command::new("pkg-config").env("PKG_CONFIG_PATH", l.lib.join("pkgconfig")).args(args),
        )
        .trim()
        .to_string()
    };
    c.that(pc(&["--modversion", "rdmasafe"]) == l.version, format!("pkg-config --modversion rdmasafe = {}", l.version));
    let libdir = fs::canonicalize(shell_words(&pc(&["--variable=libdir", "rdmasafe"])).concat()).ok();
    c.that(
        libdir.as_deref() == fs::canonicalize(&l.lib).ok().as_deref(),
        format!("pkg-config libdir {libdir:?} is the prefix's lib/"),
    );
    let cflags = pc(&["--cflags", "rdmasafe"]);
    let want_inc = fs::canonicalize(l.prefix.join("include")).ok();
    let names_inc = shell_words(&cflags)
        .iter()
        .filter_map(|f| f.strip_prefix("-I"))
        .filter_map(|p| fs::canonicalize(p).ok())
        .any(|p| Some(p) == want_inc);
    c.that(names_inc, format!("pkg-config --cflags names the prefix's include/: {cflags}"));
    let libs = pc(&["--libs", "rdmasafe"]);
    c.that(
        ["-lrdmasafe", "-lrdmacm", "-libverbs"].iter().all(|f| shell_words(&libs).iter().any(|x| x == f)),
        format!("pkg-config --libs rdmasafe: {libs}"),
    );
    let static_libs = pc(&["--static", "--libs", "rdmasafe"]);
    let native = fs::read_to_string(root.join("rdmasafe-capi/abi/native-static-libs.txt")).unwrap_or_default();
    let missing: Vec<&str> =
        native.split_whitespace().filter(|f| !shell_words(&static_libs).iter().any(|x| x == f)).collect();
    c.that(missing.is_empty(), format!("pkg-config --static --libs lacks native-static-libs {missing:?}"));

    // relocatable: pkg-config and the CMake package find the prefix from
    // their own location, so a moved prefix still works
    let config = fs::read_to_string(l.lib.join("cmake/rdmasafe/rdmasafeConfig.cmake")).unwrap_or_default();
    let prefix_text = l.prefix.display().to_string();
    c.that(
        !config.contains(&prefix_text)
            && !fs::read_to_string(l.lib.join("pkgconfig/rdmasafe.pc")).unwrap_or_default().contains(&prefix_text),
        "rdmasafeConfig.cmake and rdmasafe.pc name no absolute install path",
    );
    let moved = l.work.join("prefix-moved");
    remove_dir(&moved);
    fs::rename(&l.prefix, &moved).expect("move the prefix");
    let moved_pc = |var: &str| -> Option<PathBuf> {
        let out = Command::new("pkg-config")
            .env("PKG_CONFIG_PATH", moved.join("lib/pkgconfig"))
            .args([&format!("--variable={var}"), "rdmasafe"])
            .output()
            .ok()?;
        fs::canonicalize(shell_words(&String::from_utf8_lossy(&out.stdout)).concat()).ok()
    };
    let (libdir, incdir) = (moved_pc("libdir"), moved_pc("includedir"));
    fs::rename(&moved, &l.prefix).expect("move the prefix back");
    let moved = fs::canonicalize(l.work.clone()).unwrap().join("prefix-moved");
    c.that(
        libdir == Some(moved.join("lib")) && incdir == Some(moved.join("include")),
        format!("a moved prefix: pkg-config libdir {libdir:?}, includedir {incdir:?} (want under {})", moved.display()),
    );

    // the in-tree C programs CMake builds
    let mut progs = vec![
        "messenger_server",
        "messenger_client",
        "rdmasafe_rdma_server",
        "rdmasafe_rdma_client",
        "cm_capi_test",
        "cm_ud_test",
        "cm_mcast_test",
        "cm_barrier_test",
    ];
    if root.join("tests/c/cq_loop_test.c").exists() {
        progs.push("cq_loop_test");
    }
    for p in progs {
        c.that(l.build.join("bin").join(p).is_file(), format!("CMake built the in-tree program bin/{p}"));
    }
}

/// The words of pkg-config's output: it escapes a space inside a path
/// with a backslash, for the shell ("-I/x\\ y/include" is one word).
fn shell_words(s: &str) -> Vec<String> {
    let (mut words, mut cur, mut chars) = (Vec::new(), None::<String>, s.chars());
    while let Some(ch) = chars.next() {
        match ch {
            '\\' => cur.get_or_insert_with(String::new).extend(chars.next()),
            c if c.is_whitespace() => words.extend(cur.take()),
            c => cur.get_or_insert_with(String::new).push(c),
        }
    }
    words.extend(cur);
    words
}

/// DT_NEEDED entries of a binary, and its rpath / runpath directories.
fn needed(bin: &Path) -> (Vec<String>, Vec<PathBuf>) {
    let dynamic = stdout_of("readelf -d", Command::new("readelf").arg("-d").arg(bin));
    let field = |key: &str| -> Vec<String> {
        dynamic.lines().filter_map(|l| l.split_once(key).map(|(_, r)| r.trim_end_matches(']').to_string())).collect()
    };
    let paths = [field("Library runpath: ["), field("Library rpath: [")]
        .concat()
        .iter()
        .flat_map(|p| p.split(':').map(String::from).collect::<Vec<_>>())
        .filter_map(|p| fs::canonicalize(p).ok())
        .collect();
    (field("Shared library: ["), paths)
}

/// Builds every consumer; returns (label, binary) of the migration programs.
fn build_consumers(c: &mut Checks, l: &Layout) -> Vec<(String, PathBuf)> {
    let root = root();
    let t = Instant::now();
    let pc_path = l.lib.join("pkgconfig");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());

    // CMake: find_package(rdmasafe CONFIG REQUIRED)
    let cm = l.work.join("consumer-cmake");
    remove_dir(&cm);
    run(
        "consumer cmake configure",
        Command::new("cmake")
            .arg("-S")
            .arg(root.join("tests/consumer/cmake"))
            .arg("-B")
            .arg(&cm)
            .arg(format!("-DCMAKE_PREFIX_PATH={}", l.prefix.display()))
            .env_remove("PKG_CONFIG_PATH"),
    );
    run("consumer cmake build", Command::new("cmake").arg("--build").arg(&cm).args(["-j", "2"]));

    // make + pkg-config
    let mk = l.work.join("consumer-make");
    remove_dir(&mk);
    run(
        "consumer make",
        Command::new("make")
            .arg("-C")
            .arg(root.join("tests/consumer/make"))
            .arg(format!("OUT={}", mk.display()))
            .args(["-j", "2"])
            .env("PKG_CONFIG_PATH", &pc_path),
    );

    // the "before" programs: librdmacm and libibverbs only
    let before = l.work.join("before");
    remove_dir(&before);
    fs::create_dir_all(&before).unwrap();
    for p in ["cm_server_before", "cq_rank_before"] {
        run(
            &format!("cc {p}.c"),
            Command::new(&cc)
                .args(["-Wall", "-Wextra", "-Werror", "-O2", "-g", "-o"])
                .arg(before.join(p))
                .arg(root.join(MIGRATION_DIR).join(format!("{p}.c")))
                .args(["-lrdmacm", "-libverbs"]),
        );
    }
    log(format!("consumers built (cmake, make, cc) in {:.1} s", t.elapsed().as_secs_f64()));

    // (label, binary, how librdmasafe must be linked: Some(true) shared, Some(false) static, None not at all)
    let programs: Vec<(&str, PathBuf, Option<bool>)> = vec![
        ("before_cm_server", before.join("cm_server_before"), None),
        ("before_cq_rank", before.join("cq_rank_before"), None),
        ("cmake_cm_server_after", cm.join("cm_server_after"), Some(true)),
        ("cmake_cq_rank_after", cm.join("cq_rank_after"), Some(true)),
        ("cmake_cm_server_after_static", cm.join("cm_server_after_static"), Some(false)),
        ("make_cm_server_after", mk.join("cm_server_after"), Some(true)),
        ("make_cq_rank_after", mk.join("cq_rank_after"), Some(true)),
        ("make_cq_rank_after_static", mk.join("cq_rank_after_static"), Some(false)),
        ("cmake_cxx_consumer", cm.join("cxx_consumer"), Some(true)),
        ("make_cxx_consumer", mk.join("cxx_consumer"), Some(true)),
    ];
    let mut out = Vec::new();
    for (label, bin, shared) in programs {
        if !c.that(bin.is_file(), format!("{label}: {} was built", bin.display())) {
            continue;
        }
        let (need, paths) = needed(&bin);
        let links_ours = need.iter().any(|n| n.starts_with("librdmasafe"));
        let ok = match shared {
            Some(true) => need.contains(&l.soname),
            Some(false) | None => !links_ours,
        };
        c.that(ok, format!("{label}: DT_NEEDED {need:?} (librdmasafe wanted: {shared:?}; Some(true) = {})", l.soname));
        if shared == Some(true) {
            let lib = fs::canonicalize(&l.lib).ok();
            c.that(
                paths.iter().any(|p| Some(p) == lib.as_ref()),
                format!("{label}: its rpath/runpath {paths:?} names the prefix's lib/"),
            );
        }
        if shared == Some(false) {
            c.that(
                need.iter().any(|n| n.starts_with("librdmacm.so"))
                    && need.iter().any(|n| n.starts_with("libibverbs.so")),
                format!("{label}: the system libraries stay shared: {need:?}"),
            );
        }
        if !label.ends_with("cxx_consumer") {
            out.push((label.to_string(), bin));
        }
    }
    out
}

fn run_cxx_consumers(c: &mut Checks, l: &Layout) {
    for dir in ["consumer-cmake", "consumer-make"] {
        let bin = l.work.join(dir).join("cxx_consumer");
        let out = Command::new(&bin).env_remove("LD_LIBRARY_PATH").output();
        let Ok(out) = out else {
            c.that(false, format!("cannot run {}", bin.display()));
            continue;
        };
        let stdout = String::from_utf8_lossy(&out.stdout);
        let last = stdout.lines().last().unwrap_or("").to_string();
        let passed = last
            .strip_prefix("cxx_consumer: ")
            .and_then(|r| r.strip_suffix(" passed, 0 failed"))
            .and_then(|n| n.parse::<usize>().ok());
        c.that(
            out.status.success() && passed.is_some_and(|n| n >= 20),
            format!("{dir}/cxx_consumer on the host: {} / {last:?}\n{}", out.status, output_text(&out)),
        );
        log(format!("{dir}/cxx_consumer: {last}"));
    }
}

/// Builds `tests/consumer/<name>.c` with `cflags` against the installed
/// library and the librdmacm stand-in (tests/consumer/standin_rdmacm.c,
/// linked first, so that librdmasafe's references to librdmacm's two
/// event calls bind to it), into `<work>/<name>/`; returns the program.
fn build_standin_consumer(l: &Layout, name: &str, cflags: &[&str]) -> PathBuf {
    let root = root();
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let dir = l.work.join(name);
    remove_dir(&dir);
    fs::create_dir_all(&dir).unwrap();
    run(
        "cc standin_rdmacm.c",
        Command::new(&cc)
            .args(["-Wall", "-Wextra", "-Werror", "-O2", "-g", "-shared", "-fPIC", "-o"])
            .arg(dir.join("libstandin_rdmacm.so"))
            .arg(root.join("tests/consumer/standin_rdmacm.c")),
    );
    let bin = dir.join(name);
    run(
        &format!("cc {name}.c"),
        Command::new(&cc)
            .args(["-Wall", "-Wextra", "-Werror", "-g"])
            .args(cflags)
            .arg(format!("-I{}", l.prefix.join("include").display()))
            .arg("-o")
            .arg(&bin)
            .arg(root.join(format!("tests/consumer/{name}.c")))
            // the stand-in first, kept though the program calls none of it
            .arg("-Wl,--no-as-needed")
            .arg(format!("-L{}", dir.display()))
            .arg("-lstandin_rdmacm")
            .arg(format!("-L{}", l.lib.display()))
            .arg("-lrdmasafe")
            .arg(format!("-Wl,-rpath,{}", dir.display()))
            .arg(format!("-Wl,-rpath,{}", l.lib.display())),
    );
    bin
}

/// An application built with AddressSanitizer, linked against the
/// installed (release) library, gets CM events with the default ack
/// deadline (rdmasafe's ack thread starts) and exits: exit 0, no leak
/// reported. It exited 1 ("8 bytes leaked": the thread's handle, held only
/// from memory LeakSanitizer does not scan; found by a review of the docs'
/// "clean under ASan"). On the host, with the librdmacm stand-in.
fn run_asan_consumer(c: &mut Checks, l: &Layout) {
    let bin = build_standin_consumer(l, "asan_cm_event", &["-O1", "-fsanitize=address", "-fno-omit-frame-pointer"]);
    let out = Command::new(&bin).env_remove("LD_LIBRARY_PATH").env_remove("LD_PRELOAD").output();
    let Ok(out) = out else {
        c.that(false, format!("cannot run {}", bin.display()));
        return;
    };
    let text = output_text(&out);
    c.that(
        out.status.success()
            && String::from_utf8_lossy(&out.stdout).contains("asan_cm_event: ok")
            && !text.contains("LeakSanitizer"),
        format!("asan_cm_event (AddressSanitizer, installed library) on the host: {}\n{text}", out.status),
    );
    log(format!("asan_cm_event: {}", out.status));
}

/// A batch get on a blocking-mode channel, under valgrind's memcheck,
/// against the installed (release) library: no error reported. valgrind
/// reported "Conditional jump or move depends on uninitialised value(s)"
/// in `poll_readable_ex` (the look for more events computed a poll timeout
/// from a no-wait value's unset bytes; found by a review of a Ceph-style
/// server run under valgrind, which fails such a run with
/// `--error-exitcode`). On the host, with the librdmacm stand-in.
fn run_valgrind_consumer(c: &mut Checks, l: &Layout) {
    let bin = build_standin_consumer(l, "valgrind_batch", &["-O2"]);
    let out = Command::new("valgrind")
        .args(["--tool=memcheck", "--error-exitcode=99", "--num-callers=30"])
        .arg(&bin)
        .env_remove("LD_LIBRARY_PATH")
        .env_remove("LD_PRELOAD")
        .output();
    let Ok(out) = out else {
        c.that(false, format!("cannot run valgrind {}", bin.display()));
        return;
    };
    let text = output_text(&out);
    c.that(
        out.status.success() && String::from_utf8_lossy(&out.stdout).contains("valgrind_batch: ok"),
        format!("valgrind_batch (memcheck, installed library) on the host: {}\n{text}", out.status),
    );
    log(format!("valgrind_batch: {}", out.status));
}

/// The unmodified "before" server under the installed preload: the same
/// output as without it, and the preload's exit lines (one per process)
/// show copies, all freed.
fn check_preloaded(c: &mut Checks, label: &str, b: &Block) {
    let (ours, own): (Vec<&str>, Vec<&str>) = b.lines().partition(|l| l.starts_with("rdmasafe["));
    let program = Block { out: own.iter().map(|l| format!("{l}\n")).collect(), exit: b.exit };
    check_cm_server(c, label, &program);
    let exits: Vec<&str> = ours.iter().copied().filter(|l| l.starts_with("rdmasafe[INFO]: preload exit [")).collect();
    let copied: u64 = exits
        .iter()
        .filter_map(|l| l.split_once(" copied=").and_then(|(_, r)| r.split(' ').next()?.parse::<u64>().ok()))
        .sum();
    c.that(
        !exits.is_empty()
            && exits
                .iter()
                .all(|l| l.contains(": mode=copy ") && l.contains(" outstanding=0 ") && l.contains(" not_copies=0 ")),
        format!("{label}: the preload's exit lines {exits:?} (want mode=copy, outstanding=0, not_copies=0)"),
    );
    c.that(copied > 0, format!("{label}: no event went through the preload: {exits:?}"));
    log(format!("{label}: {copied} events copied by the installed librdmasafe-preload.so"));
}

fn check_cm_server(c: &mut Checks, label: &str, b: &Block) {
    let prog = if label.starts_with("before") { "cm_server_before" } else { "cm_server_after" };
    c.that(
        b.last_line() == format!("{prog}: client exit status 0: OK"),
        format!("{label}: last line {:?}", b.last_line()),
    );
    c.that(b.has("server: 3 served, 1 refused, 0 failed"), format!("{label}: server summary"));
    c.that(b.has("client: 4 of 4 connections as expected"), format!("{label}: client summary"));
    for i in 0..3 {
        // the hello: its own length inside the padded 56
        let hello = b.lines_with(&format!(
            "server: hello from client 7 conn {i} name \"client-7.{i}\" (hello len 19, private_data_len 56) -> session "
        ));
        let session = hello.first().and_then(|l| l.rsplit(' ').next()).unwrap_or("?").to_string();
        c.that(hello.len() == 1, format!("{label}: one hello of conn {i} in the padded 56 bytes, got {hello:?}"));
        // the welcome built from the server's per-connection state
        let welcome = b.lines_with(&format!(
            "client: conn {i}: welcome session {session} \"session {session} for client-7.{i}, welcome\" (welcome len "
        ));
        c.that(
            welcome.len() == 1 && welcome[0].ends_with(", private_data_len 196)"),
            format!("{label}: conn {i}: the welcome of session {session} in the padded 196 bytes: {welcome:?}"),
        );
        c.that(
            b.has(&format!("server: session {session} (client 7 conn {i} \"client-7.{i}\") disconnected, served")),
            format!("{label}: session {session} (conn {i}) served"),
        );
        if prog == "cm_server_after" {
            c.that(
                b.has(&format!(
                    "worker: session {session} ended by RDMA_CM_EVENT_DISCONNECTED (status 0): client 7 conn {i} \
                     \"client-7.{i}\" (hello len 19, still readable after rdma_destroy_id)"
                )),
                format!("{label}: the worker read conn {i}'s held CONNECT_REQUEST copy after rdma_destroy_id"),
            );
        }
    }
    c.that(b.has("server: refusing a connection: unsupported hello version"), format!("{label}: the refusal"));
    c.that(
        b.has(
            "client: conn 3: refused (status 28): \"unsupported hello version\" (refusal len 27, private_data_len 148)",
        ),
        format!("{label}: the client got the refusal's own 27 bytes in the padded 148"),
    );
    if prog == "cm_server_after" {
        for who in ["server", "client"] {
            let line = b.lines_with(&format!("{who}: counters copied="));
            c.that(
                line.len() == 1 && line[0].ends_with(" outstanding=0"),
                format!("{label}: {who} counters: no copy left: {line:?}"),
            );
        }
    }
}

fn check_cq_rank(c: &mut Checks, label: &str, b: &Block) {
    let prog = if label.starts_with("before") { "cq_rank_before" } else { "cq_rank_after" };
    c.that(b.last_line() == format!("{prog}: OK"), format!("{label}: last line {:?}", b.last_line()));
    c.that(b.has(&format!("{prog}: 1000 round trips, 4000 completions (0 errors)")), format!("{label}: round trips"));
    c.that(b.has(" connected on ") && b.has("4 CQs on one completion channel"), format!("{label}: connected"));
    if prog == "cq_rank_after" {
        let stats = b.lines_with("cq_rank_after: loop: ");
        c.that(
            stats.len() == 1 && stats[0].contains(" 4000 completions,") && stats[0].contains(", 0 unacked,"),
            format!("{label}: loop figures: {stats:?}"),
        );
        c.that(b.lines_with(" CQ: ").len() == 4, format!("{label}: a callback count for each of the 4 CQs"));
    } else {
        c.that(b.lines_with(" CQ: ").len() == 4, format!("{label}: an event count for each of the 4 CQs"));
    }
}

fn run_on_device(c: &mut Checks, l: &Layout, programs: &[(String, PathBuf)]) {
    let root = root();
    // the unmodified "before" server once more, under the installed preload
    let mut programs = programs.to_vec();
    if let Some((_, bin)) = programs.iter().find(|(label, _)| label == "before_cm_server").cloned() {
        programs.push(("before_cm_server.preload".to_string(), bin));
    }
    c.that(programs.len() == 9, "before_cm_server is among the programs (to run it under the preload)");
    let script = root.join("tests/consumer/run-in-guest.sh");
    let hw = match (std::env::var("RDMASAFE_DEVICE"), std::env::var("RDMASAFE_ADDR")) {
        (Ok(d), Ok(a)) if !d.is_empty() && !a.is_empty() => Some((d, a)),
        _ => None,
    };
    let mut cmd;
    if let Some((device, addr)) = &hw {
        log(format!("real hardware: {device} ({addr}), on the host"));
        cmd = Command::new("timeout");
        cmd.args(["-k", "10", &GUEST_TIMEOUT.to_string(), "bash"])
            .arg(&script)
            .env("RDMASAFE_TEST_DEVICE", device)
            .env("RDMASAFE_TEST_ADDR", addr);
    } else {
        cmd = Command::new(root.join("tests/bed/vm-run"));
        cmd.args(["--timeout", &GUEST_TIMEOUT.to_string(), "--", "bash"]).arg(&script);
    }
    for (label, bin) in &programs {
        cmd.arg(format!("{label}={}", bin.display()));
    }
    cmd.current_dir(&root)
        .env_remove("LD_LIBRARY_PATH")
        .env("RDMASAFE_CONSUMER_PRELOAD", l.lib.join("librdmasafe-preload.so"));
    let t = Instant::now();
    let out = cmd.output().expect("run tests/consumer/run-in-guest.sh");
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    eprintln!("{}", String::from_utf8_lossy(&out.stderr));
    log(format!("{} programs on the device in {:.1} s", programs.len(), t.elapsed().as_secs_f64()));

    let runs = blocks(&stdout);
    c.that(out.status.success(), format!("run-in-guest.sh exit status {}", out.status));
    c.that(stdout.contains("==== SUMMARY 0 failed"), "the script's summary does not say 0 failed");
    let empty = Block::default();
    for (label, _) in &programs {
        let b = runs.get(label).unwrap_or(&empty);
        c.that(b.exit == Some(0), format!("{label}: exit {:?} (want Some(0); None = did not run)", b.exit));
        if label.ends_with(".preload") {
            check_preloaded(c, label, b);
        } else if label.contains("cm_server") {
            check_cm_server(c, label, b);
        } else {
            check_cq_rank(c, label, b);
        }
    }
}

#[test]
fn install_and_consume() {
    let t0 = Instant::now();
    let l = Layout::new();
    fs::create_dir_all(&l.work).unwrap();
    cmake_install(&l);

    let mut c = Checks::default();
    check_abi(&mut c, &l);
    check_installed_files(&mut c, &l);
    check_preload(&mut c, &l);
    let programs = build_consumers(&mut c, &l);
    run_cxx_consumers(&mut c, &l);
    run_asan_consumer(&mut c, &l);
    run_valgrind_consumer(&mut c, &l);
    if programs.len() == 8 {
        run_on_device(&mut c, &l, &programs);
    } else {
        c.that(false, format!("only {} of the 8 migration programs were built: not running them", programs.len()));
    }
    log(format!("total {:.1} s", t0.elapsed().as_secs_f64()));
    c.assert_all("install and consume");
}
