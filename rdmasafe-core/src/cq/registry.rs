//! Process-wide bookkeeping that keeps loops from stepping on each other:
//! a completion channel has one loop (its only reader), a CQ is in one
//! loop at a time. Touched on create / add / remove only.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Mutex, MutexGuard, OnceLock};

/// A number naming one loop for its whole life (never reused).
pub(crate) fn next_loop_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Relaxed)
}

#[derive(Default)]
struct Maps {
    /// CQ address -> id of the loop it is in (or being added to).
    cqs: HashMap<usize, u64>,
    /// Channel address -> id of its loop.
    channels: HashMap<usize, u64>,
}

fn maps() -> MutexGuard<'static, Maps> {
    static M: OnceLock<Mutex<Maps>> = OnceLock::new();
    M.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner())
}

/// Claims `chan` for loop `id`; false if another loop has it.
pub(crate) fn claim_channel(chan: usize, id: u64) -> bool {
    let mut m = maps();
    if m.channels.contains_key(&chan) {
        return false;
    }
    m.channels.insert(chan, id);
    true
}

pub(crate) fn release_channel(chan: usize, id: u64) {
    let mut m = maps();
    if m.channels.get(&chan) == Some(&id) {
        m.channels.remove(&chan);
    }
}

/// Claims `cq` for loop `id`; `Err(other)` with the loop that has it.
pub(crate) fn claim_cq(cq: usize, id: u64) -> Result<(), u64> {
    let mut m = maps();
    match m.cqs.get(&cq) {
        Some(other) => Err(*other),
        None => {
            m.cqs.insert(cq, id);
            Ok(())
        }
    }
}

/// True if `cq` is in (or being added to) loop `id`.
pub(crate) fn cq_in(cq: usize, id: u64) -> bool {
    maps().cqs.get(&cq) == Some(&id)
}

pub(crate) fn release_cq(cq: usize, id: u64) {
    let mut m = maps();
    if m.cqs.get(&cq) == Some(&id) {
        m.cqs.remove(&cq);
    }
}

/// Releases every CQ of loop `id` (the loop is gone).
pub(crate) fn release_loop(id: u64) {
    let mut m = maps();
    m.cqs.retain(|_, l| *l != id);
    m.channels.retain(|_, l| *l != id);
}
