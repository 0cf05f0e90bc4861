//! The Soft-RoCE test bed with a guest that never comes up: seen once in CI,
//! a TCG guest that printed nothing and never reached its /init, so the test
//! binary it was booted for waited out the whole 900 s job timeout and
//! failed. tests/bed/vm-run and vm-run2 now bound each boot
//! (RDMASAFE_BED_BOOT_TIMEOUT), kill a boot that did not bring rxe0 up in
//! time and boot a new guest, up to RDMASAFE_BED_BOOTS boots.
//!
//! The hung boot here is a real guest whose virtual CPUs never start (QEMU
//! -S, through the bed's test hook RDMASAFE_BED_TEST_STALLED_BOOTS): to the
//! host it looks exactly like the guest seen in CI, no console output and
//! no rxe0. The binary runs on the host (its name does not start with
//! `rxe_`) and boots its guests itself.

mod common;

use std::process::{Command, Output};

use common::host::{repo, run, stderr, stdout};

/// Long enough for a real boot on a busy 2-core machine (4-10 s seen, 15 s
/// with three guests on two cores); a boot that takes longer only costs
/// another boot (three in all).
const BOOT_TIMEOUT: &str = "45";

fn vm_run(stalled: u32, boots: u32, boot_timeout: &str, script: &str) -> Output {
    run(
        &format!("vm-run, {stalled} stalled boot(s) of {boots}"),
        Command::new(repo().join("tests/bed/vm-run"))
            .env("RDMASAFE_BED_TEST_STALLED_BOOTS", stalled.to_string())
            .env("RDMASAFE_BED_BOOTS", boots.to_string())
            .env("RDMASAFE_BED_BOOT_TIMEOUT", boot_timeout)
            .args(["--timeout", "300", "--", "bash", "-c", script]),
    )
}

fn vm_run2(stalled: u32, boots: u32, boot_timeout: &str) -> Output {
    run(
        &format!("vm-run2, guest b's first {stalled} boot(s) stalled, {boots} boots"),
        Command::new(repo().join("tests/bed/vm-run2"))
            .env("RDMASAFE_BED_TEST_STALLED_BOOTS", stalled.to_string())
            .env("RDMASAFE_BED_BOOTS", boots.to_string())
            .env("RDMASAFE_BED_BOOT_TIMEOUT", boot_timeout)
            .args(["--timeout", "300", "--a", "echo a ran on $RDMASAFE_TEST_DEVICE", "--b", "echo b ran; exit 3"]),
    )
}

/// The lines of `text` equal to `line`.
fn count(text: &str, line: &str) -> usize {
    text.lines().filter(|l| *l == line).count()
}

#[test]
fn a_guest_that_never_comes_up_is_killed_and_a_new_one_runs_the_job_once() {
    let out = vm_run(1, 3, BOOT_TIMEOUT, "echo job ran on $RDMASAFE_TEST_DEVICE; exit 4");
    let (o, e) = (stdout(&out), stderr(&out));
    assert!(
        e.contains(&format!("[bed] boot 1 of 3: the guest did not bring rxe0 up in {BOOT_TIMEOUT} s; killed")),
        "the stalled boot was killed at its limit"
    );
    assert_eq!(count(&o, "job ran on rxe0"), 1, "the job ran exactly once, on a guest with rxe0: {o:?}");
    assert_eq!(out.status.code(), Some(4), "the job's own exit status came back");
}

#[test]
fn no_guest_coming_up_is_a_bed_failure_and_runs_no_job() {
    // (3 s: shorter than any real boot, so every boot here fails, stalled
    // or not)
    let out = vm_run(2, 2, "3", "echo job ran");
    let (o, e) = (stdout(&out), stderr(&out));
    assert!(e.contains("[bed] boot 2 of 2: the guest did not bring rxe0 up in 3 s; killed"), "both boots killed");
    assert!(e.contains("[bed] FAILED: no guest came up in 2 boots of 3 s each"), "the failure is named");
    assert_eq!(count(&o, "job ran"), 0, "no job ran: {o:?}");
    assert_eq!(out.status.code(), Some(125), "a bed failure, as a guest that stops without a job status");
}

#[test]
fn a_second_guest_that_never_comes_up_is_booted_again_while_the_first_waits() {
    let out = vm_run2(1, 3, BOOT_TIMEOUT);
    let (o, e) = (stdout(&out), stderr(&out));
    assert!(
        e.contains(&format!("[bed2] guest b: boot 1 of 3 did not bring its link up in {BOOT_TIMEOUT} s; killed")),
        "guest b's stalled boot was killed at its limit"
    );
    assert_eq!(count(&o, "[a] a ran on rxe0"), 1, "guest a ran its job once: {o:?}");
    assert_eq!(count(&o, "[b] b ran"), 1, "guest b ran its job once: {o:?}");
    assert!(e.contains("[bed2] status a=0 b=3"), "both statuses came back");
    assert_eq!(out.status.code(), Some(3), "vm-run2 exits with b's status");
}

#[test]
fn a_pair_whose_guest_never_comes_up_is_a_bed_failure_and_runs_no_job() {
    let out = vm_run2(2, 2, "3");
    let (o, e) = (stdout(&out), stderr(&out));
    // (which guest gives up first depends on timing: b's boots are
    // stalled, and at 3 s a's real boots do not come up either)
    assert!(e.contains("did not come up in 2 boots of 3 s each"), "the failure is named");
    let status = e.lines().find(|l| l.starts_with("[bed2] status ")).expect("a status line");
    assert!(status.contains("=no-boot"), "a guest is reported as never up: {status}");
    assert!(!o.contains(" ran"), "no job ran: {o:?}");
    assert_eq!(out.status.code(), Some(125), "a bed failure");
}
