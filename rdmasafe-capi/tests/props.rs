//! Property tests over the event-copy path and the C argument checks, on
//! stable: the same functions the cargo-fuzz targets in tests/fuzz drive
//! (rdmasafe::fuzzing), fed by proptest, plus a replay of the committed
//! fuzz corpus so CI runs every input the fuzzer kept.

use proptest::prelude::*;
use rdmasafe::fuzzing::{c_args_case, event_copy_case};

/// `event_copy_case` frees a copy twice and expects the second free to be
/// refused, which holds while fewer than the quarantine's 64 copies are
/// made in between: process-wide, so the two tests that run it take turns.
fn event_copy_case_alone(data: &[u8]) {
    static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    event_copy_case(data);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn event_copies_are_exact_owned_and_freed_once(data in proptest::collection::vec(any::<u8>(), 0..400)) {
        event_copy_case_alone(&data);
    }

    #[test]
    fn c_argument_checks_return_documented_errors(data in proptest::collection::vec(any::<u8>(), 0..64)) {
        c_args_case(&data);
    }
}

fn replay(dir: &str, f: fn(&[u8])) -> usize {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fuzz/corpus").join(dir);
    let mut n = 0;
    for entry in std::fs::read_dir(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())) {
        let p = entry.unwrap().path();
        f(&std::fs::read(&p).unwrap());
        n += 1;
    }
    n
}

#[test]
fn committed_fuzz_corpus_replays_clean() {
    let a = replay("event_copy", event_copy_case_alone);
    let b = replay("c_args", c_args_case);
    println!("replayed {a} event_copy and {b} c_args corpus inputs");
    assert!(a > 0 && b > 0, "the corpus is committed");
}
