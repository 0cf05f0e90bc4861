//! The C view of the ABI, from a C program built against include/rdmasafe.h
//! and librdmasafe.so (host only: nothing here needs a device):
//!
//! 1. every sized struct has the same size and field offsets in C as in the
//!    Rust definitions, and `size` is its first field;
//! 2. a caller with an *older*, truncated struct gets nothing written past
//!    its `size`, one with a *newer*, padded struct gets only the library's
//!    bytes and learns how many from `size`, and an unset size is -EINVAL
//!    with nothing written (checked with canary bytes);
//! 3. RDMASAFE_VERSION_STRING / _MAJOR / _MINOR / _PATCH equal what
//!    `rdmasafe_version()` reports at run time and Cargo.toml's version.
//!
//! The input side (options read only up to `size`, -E2BIG for an unknown
//! field set) needs a completion channel: tests/c/cq_loop_test.c checks it
//! in the guest.

mod common;

use std::collections::BTreeMap;
use std::mem::{offset_of, size_of};
use std::process::Command;

use common::{ensure_library, profile_dir, root, run_logged};
use rdmasafe::*;

const PROGRAM: &str = r#"
#include <stdio.h>
#include <string.h>
#include <errno.h>
#include <stddef.h>
#include "rdmasafe.h"

#define LAYOUT(T, F) printf("layout " #T "." #F " %zu\n", offsetof(struct T, F))
#define SIZE(T) printf("layout " #T " %zu\n", sizeof(struct T))

static int failed;
#define CHECK(c, ...) do { if (c) printf("ok   "); else { printf("FAIL "); failed++; } \
	printf(__VA_ARGS__); printf("\n"); } while (0)

int main(void)
{
	SIZE(rdmasafe_cm_counters); LAYOUT(rdmasafe_cm_counters, size);
	LAYOUT(rdmasafe_cm_counters, copied); LAYOUT(rdmasafe_cm_counters, slots_allocated);
	SIZE(rdmasafe_cq_loop_stats); LAYOUT(rdmasafe_cq_loop_stats, size);
	LAYOUT(rdmasafe_cq_loop_stats, wakeups); LAYOUT(rdmasafe_cq_loop_stats, cycle_time_us);
	SIZE(rdmasafe_cq_loop_options); LAYOUT(rdmasafe_cq_loop_options, size);
	LAYOUT(rdmasafe_cq_loop_options, mode); LAYOUT(rdmasafe_cq_loop_options, watchdog_ms);
	LAYOUT(rdmasafe_cq_loop_options, timing_stats); LAYOUT(rdmasafe_cq_loop_stats, budget_yields);
	LAYOUT(rdmasafe_cq_loop_options, learn_latency_weight);
	LAYOUT(rdmasafe_cq_loop_stats, sleeps); LAYOUT(rdmasafe_cq_loop_stats, channel_reads_empty);
	SIZE(rdmasafe_async_event); LAYOUT(rdmasafe_async_event, size);
	LAYOUT(rdmasafe_async_event, element); LAYOUT(rdmasafe_async_event, port_num);

	union {
		struct rdmasafe_cm_counters c;
		unsigned char b[sizeof(struct rdmasafe_cm_counters) + 32];
	} u;
	size_t old = offsetof(struct rdmasafe_cm_counters, freed), i;
	int clean = 1;

	memset(&u, 0xAA, sizeof u);
	u.c.size = old;
	CHECK(rdmasafe_cm_get_counters(&u.c) == 0, "counters into an older struct of %zu bytes", old);
	CHECK(u.c.size == old, "older struct: size stays %zu (got %u)", old, u.c.size);
	CHECK(u.c.copied != 0xAAAAAAAAAAAAAAAAull, "older struct: the field it has was written");
	for (i = old; i < sizeof u; i++)
		clean &= u.b[i] == 0xAA;
	CHECK(clean, "older struct: no byte written past its size");

	memset(&u, 0xAA, sizeof u);
	u.c.size = sizeof u;
	CHECK(rdmasafe_cm_get_counters(&u.c) == 0, "counters into a newer struct of %zu bytes", sizeof u);
	CHECK(u.c.size == sizeof(struct rdmasafe_cm_counters), "newer struct: size says %zu filled (got %u)",
	      sizeof(struct rdmasafe_cm_counters), u.c.size);
	clean = 1;
	for (i = sizeof(struct rdmasafe_cm_counters); i < sizeof u; i++)
		clean &= u.b[i] == 0xAA;
	CHECK(clean, "newer struct: nothing written past the library's struct");

	memset(&u, 0xAA, sizeof u);
	u.c.size = 0;
	CHECK(rdmasafe_cm_get_counters(&u.c) == -EINVAL, "counters with size 0 (never set) -> -EINVAL");
	clean = 1;
	for (i = sizeof u.c.size; i < sizeof u; i++)
		clean &= u.b[i] == 0xAA;
	CHECK(clean && u.c.size == 0, "size 0: nothing written");

	int ma = -1, mi = -1, pa = -1;
	const char *v = rdmasafe_version(&ma, &mi, &pa);
	CHECK(v && strcmp(v, RDMASAFE_VERSION_STRING) == 0, "rdmasafe_version() \"%s\" == RDMASAFE_VERSION_STRING \"%s\"",
	      v ? v : "(null)", RDMASAFE_VERSION_STRING);
	CHECK(ma == RDMASAFE_VERSION_MAJOR && mi == RDMASAFE_VERSION_MINOR && pa == RDMASAFE_VERSION_PATCH,
	      "rdmasafe_version parts %d.%d.%d == header %d.%d.%d", ma, mi, pa, RDMASAFE_VERSION_MAJOR,
	      RDMASAFE_VERSION_MINOR, RDMASAFE_VERSION_PATCH);
	printf("version %s\n", RDMASAFE_VERSION_STRING);
	printf("failed %d\n", failed);
	return failed != 0;
}
"#;

#[test]
fn sized_structs_and_version_from_c() {
    let profile = profile_dir();
    let lib = ensure_library(&profile);
    let dir = profile.join("abi-structs");
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("structs.c");
    std::fs::write(&src, PROGRAM).unwrap();
    let exe = dir.join("structs");
    let libdir = lib.parent().unwrap();
    run_logged(
        "cc structs.c",
        Command::new("cc")
            .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-o"])
            .arg(&exe)
            .arg(&src)
            .arg("-I")
            .arg(root().join("include"))
            .arg(format!("-L{}", libdir.display()))
            .arg(format!("-Wl,-rpath,{}", libdir.display()))
            .args(["-lrdmasafe", "-lrdmacm", "-libverbs"]),
    );
    let out = Command::new(&exe).output().expect("run the C program");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    println!("{text}");
    assert!(out.status.success(), "the C program failed:\n{text}\n{}", String::from_utf8_lossy(&out.stderr));
    let fails: Vec<&str> = text.lines().filter(|l| l.starts_with("FAIL")).collect();
    assert!(fails.is_empty(), "{fails:#?}");
    assert!(text.lines().filter(|l| l.starts_with("ok   ")).count() >= 11, "{text}");

    let c: BTreeMap<&str, usize> = text
        .lines()
        .filter_map(|l| l.strip_prefix("layout "))
        .filter_map(|l| l.rsplit_once(' '))
        .map(|(k, v)| (k, v.parse().unwrap()))
        .collect();
    let rust: BTreeMap<&str, usize> = BTreeMap::from([
        ("rdmasafe_cm_counters", size_of::<rdmasafe_cm_counters>()),
        ("rdmasafe_cm_counters.size", offset_of!(rdmasafe_cm_counters, size)),
        ("rdmasafe_cm_counters.copied", offset_of!(rdmasafe_cm_counters, copied)),
        ("rdmasafe_cm_counters.slots_allocated", offset_of!(rdmasafe_cm_counters, slots_allocated)),
        ("rdmasafe_cq_loop_stats", size_of::<rdmasafe_cq_loop_stats>()),
        ("rdmasafe_cq_loop_stats.size", offset_of!(rdmasafe_cq_loop_stats, size)),
        ("rdmasafe_cq_loop_stats.wakeups", offset_of!(rdmasafe_cq_loop_stats, wakeups)),
        ("rdmasafe_cq_loop_stats.cycle_time_us", offset_of!(rdmasafe_cq_loop_stats, cycle_time_us)),
        ("rdmasafe_cq_loop_options", size_of::<rdmasafe_cq_loop_options>()),
        ("rdmasafe_cq_loop_options.size", offset_of!(rdmasafe_cq_loop_options, size)),
        ("rdmasafe_cq_loop_options.mode", offset_of!(rdmasafe_cq_loop_options, mode)),
        ("rdmasafe_cq_loop_options.watchdog_ms", offset_of!(rdmasafe_cq_loop_options, watchdog_ms)),
        ("rdmasafe_cq_loop_options.timing_stats", offset_of!(rdmasafe_cq_loop_options, timing_stats)),
        ("rdmasafe_cq_loop_options.learn_latency_weight", offset_of!(rdmasafe_cq_loop_options, learn_latency_weight)),
        ("rdmasafe_cq_loop_stats.budget_yields", offset_of!(rdmasafe_cq_loop_stats, budget_yields)),
        ("rdmasafe_cq_loop_stats.sleeps", offset_of!(rdmasafe_cq_loop_stats, sleeps)),
        ("rdmasafe_cq_loop_stats.channel_reads_empty", offset_of!(rdmasafe_cq_loop_stats, channel_reads_empty)),
        ("rdmasafe_async_event", size_of::<rdmasafe_async_event>()),
        ("rdmasafe_async_event.size", offset_of!(rdmasafe_async_event, size)),
        ("rdmasafe_async_event.element", offset_of!(rdmasafe_async_event, element)),
        ("rdmasafe_async_event.port_num", offset_of!(rdmasafe_async_event, port_num)),
    ]);
    assert_eq!(c, rust, "C vs Rust layout of the sized structs");
    assert!(c.iter().filter(|(k, _)| k.ends_with(".size")).all(|(_, v)| *v == 0), "size is the first field");
    assert!(text.contains(&format!("version {}\n", env!("CARGO_PKG_VERSION"))), "{text}");
}
