//! The CQs of a loop: a slab with generations (a reference to a removed
//! CQ's slot can never reach the CQ that reuses it) and an index by CQ
//! address, so an event finds its CQ in O(1): first the slot the last
//! lookup found (checked against the CQ's address: no hashing when the
//! same CQ fires again, as in a ping-pong), then the index.

use std::cell::Cell;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use super::handle::LiveCq;
use super::options::CqOptions;
use super::Handler;

/// One multiply instead of SipHash per event: keys are CQ addresses.
#[derive(Default, Clone, Copy)]
pub(crate) struct AddrHasher(u64);

impl Hasher for AddrHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0.rotate_left(8) ^ *b as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_usize(&mut self, v: usize) {
        // Allocations are 16-byte aligned: drop the zero bits, then spread.
        self.0 = ((v as u64) >> 4).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

pub(crate) type AddrMap<V> = HashMap<usize, V, BuildHasherDefault<AddrHasher>>;

/// A slot and the generation of the entry that was put there.
pub(crate) type Ref = (usize, u64);

pub(crate) struct Entry {
    pub(crate) cq: LiveCq,
    /// Called where it is (the loop's state is held while it runs).
    pub(crate) handler: Handler,
    pub(crate) opts: CqOptions,
    pub(crate) pending_acks: u32,
    pub(crate) armed: bool,
    /// In the fired / ready / unarmed lists (at most once each).
    pub(crate) in_fired: bool,
    pub(crate) in_ready: bool,
    pub(crate) in_unarmed: bool,
    /// Learning mode: the event cycle ([`super::learn::Learn::event_cycles`])
    /// this solicited-only CQ's completions were last counted in.
    pub(crate) learn_counted: u64,
    gen: u64,
}

impl Entry {
    pub(crate) fn new(cq: LiveCq, opts: CqOptions, handler: Handler) -> Entry {
        Entry {
            cq,
            handler,
            opts,
            pending_acks: 0,
            armed: false,
            in_fired: false,
            in_ready: false,
            in_unarmed: false,
            learn_counted: 0,
            gen: 0,
        }
    }
}

#[derive(Default)]
pub(crate) struct Entries {
    slots: Vec<Option<Entry>>,
    free: Vec<usize>,
    by_cq: AddrMap<usize>,
    next_gen: u64,
    /// The slot the last `find` found (a hint: always checked).
    last: Cell<usize>,
}

impl Entries {
    pub(crate) fn len(&self) -> usize {
        self.by_cq.len()
    }

    pub(crate) fn insert(&mut self, mut e: Entry) -> Ref {
        self.next_gen += 1;
        e.gen = self.next_gen;
        let key = e.cq.addr();
        let i = match self.free.pop() {
            Some(i) => {
                self.slots[i] = Some(e);
                i
            }
            None => {
                self.slots.push(Some(e));
                self.slots.len() - 1
            }
        };
        self.by_cq.insert(key, i);
        (i, self.next_gen)
    }

    #[inline]
    pub(crate) fn find(&self, cq: usize) -> Option<Ref> {
        let i = self.index_of(cq)?;
        self.slots[i].as_ref().map(|e| (i, e.gen))
    }

    /// [`Entries::find`] with the entry: one lookup where the caller
    /// changes the entry it found.
    #[inline]
    pub(crate) fn find_mut(&mut self, cq: usize) -> Option<(Ref, &mut Entry)> {
        let i = self.index_of(cq)?;
        let e = self.slots[i].as_mut()?;
        Some(((i, e.gen), e))
    }

    /// The slot of `cq`'s entry: the last one found, else from the index.
    #[inline]
    fn index_of(&self, cq: usize) -> Option<usize> {
        let i = self.last.get();
        if let Some(Some(e)) = self.slots.get(i) {
            if e.cq.addr() == cq {
                return Some(i);
            }
        }
        self.find_indexed(cq).map(|r| r.0)
    }

    #[inline(never)]
    fn find_indexed(&self, cq: usize) -> Option<Ref> {
        let i = *self.by_cq.get(&cq)?;
        self.last.set(i);
        self.slots[i].as_ref().map(|e| (i, e.gen))
    }

    pub(crate) fn get(&self, r: Ref) -> Option<&Entry> {
        self.slots.get(r.0)?.as_ref().filter(|e| e.gen == r.1)
    }

    pub(crate) fn get_mut(&mut self, r: Ref) -> Option<&mut Entry> {
        self.slots.get_mut(r.0)?.as_mut().filter(|e| e.gen == r.1)
    }

    pub(crate) fn remove(&mut self, r: Ref) -> Option<Entry> {
        self.get(r)?;
        let e = self.slots[r.0].take()?;
        self.by_cq.remove(&e.cq.addr());
        self.free.push(r.0);
        Some(e)
    }

    /// Slots ever used: `ref_at(0..slot_count())` visits every entry.
    pub(crate) fn slot_count(&self) -> usize {
        self.slots.len()
    }

    /// The reference of the entry in slot `i`, if it holds one.
    pub(crate) fn ref_at(&self, i: usize) -> Option<Ref> {
        self.slots.get(i)?.as_ref().map(|e| (i, e.gen))
    }

    /// Every live entry's reference (stop, teardown).
    pub(crate) fn refs(&self) -> Vec<Ref> {
        self.slots.iter().enumerate().filter_map(|(i, s)| s.as_ref().map(|e| (i, e.gen))).collect()
    }

    pub(crate) fn iter_mut(&mut self) -> impl Iterator<Item = &mut Entry> {
        self.slots.iter_mut().flatten()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::verbs::Cq;

    // Entries are only keyed by address here; a real CQ is not needed to
    // test the slab, so LiveCq values are made from dangling pointers that
    // are never called.
    fn fake(addr: usize) -> LiveCq {
        // SAFETY: the CQ is never polled, armed or acked in these tests.
        unsafe { LiveCq::borrowed(std::ptr::NonNull::new(addr as *mut _).unwrap()) }
    }

    #[test]
    fn a_stale_reference_never_reaches_the_entry_that_reuses_its_slot() {
        let _ = std::mem::size_of::<Cq>();
        let mut es = Entries::default();
        let noop: Handler = Box::new(|_, _| {});
        let a = es.insert(Entry::new(fake(0x1000), CqOptions::default(), noop));
        assert!(es.remove(a).is_some());
        let noop: Handler = Box::new(|_, _| {});
        let b = es.insert(Entry::new(fake(0x2000), CqOptions::default(), noop));
        assert_eq!(a.0, b.0, "the slot is reused");
        assert!(es.get(a).is_none() && es.remove(a).is_none(), "the stale reference is dead");
        assert!(es.get(b).is_some());
        assert_eq!(es.find(0x2000), Some(b));
        assert_eq!(es.find(0x1000), None);
        assert_eq!(es.len(), 1);
    }

    #[test]
    fn the_last_slot_found_is_a_hint_only() {
        let mut es = Entries::default();
        let noop = || -> Handler { Box::new(|_, _| {}) };
        let a = es.insert(Entry::new(fake(0x1000), CqOptions::default(), noop()));
        let b = es.insert(Entry::new(fake(0x2000), CqOptions::default(), noop()));
        for _ in 0..2 {
            assert_eq!(es.find(0x2000), Some(b));
            assert_eq!(es.find(0x1000), Some(a));
        }
        assert_eq!(es.find(0x1000), Some(a), "the same CQ again (the hint)");
        // The hinted slot is emptied, then reused by another CQ: neither
        // the removed CQ's address nor a stale generation is ever found.
        assert!(es.remove(a).is_some());
        assert_eq!(es.find(0x1000), None);
        let c = es.insert(Entry::new(fake(0x3000), CqOptions::default(), noop()));
        assert_eq!(c.0, a.0, "the slot is reused");
        assert_eq!(es.find(0x1000), None);
        assert_eq!(es.find(0x3000), Some(c));
        assert_eq!(es.find(0x2000), Some(b));
        assert_eq!(es.find(0x4000), None, "an unknown CQ");
        assert_eq!(es.find(0x3000), Some(c));
    }
}
