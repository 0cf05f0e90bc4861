//! Logging, chosen once from `RDMASAFE_LOG=error|warn|info|debug|trace`.
//! When a level is off, a log site costs one relaxed atomic load and a
//! branch.

use std::sync::atomic::{AtomicU8, Ordering::Relaxed};

/// Log levels, lowest = most important.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
#[repr(u8)]
pub enum Level {
    /// Off.
    Off = 0,
    /// Errors.
    Error = 1,
    /// Warnings.
    Warn = 2,
    /// Information.
    Info = 3,
    /// Debugging.
    Debug = 4,
    /// Every CM event copied, every CQ wakeup.
    Trace = 5,
}

const UNSET: u8 = u8::MAX;
static LEVEL: AtomicU8 = AtomicU8::new(UNSET);

fn parse(s: &str) -> Level {
    match s.trim().to_ascii_lowercase().as_str() {
        "error" => Level::Error,
        "warn" | "warning" => Level::Warn,
        "info" => Level::Info,
        "debug" => Level::Debug,
        "trace" => Level::Trace,
        _ => Level::Off,
    }
}

/// The current level (read from the environment on first use).
pub fn level() -> Level {
    let v = LEVEL.load(Relaxed);
    if v != UNSET {
        // SAFETY-free conversion: only valid discriminants are ever stored.
        return [Level::Off, Level::Error, Level::Warn, Level::Info, Level::Debug, Level::Trace][v as usize];
    }
    let l = std::env::var("RDMASAFE_LOG").map(|s| parse(&s)).unwrap_or(Level::Off);
    LEVEL.store(l as u8, Relaxed);
    l
}

/// Overrides the level.
pub fn set_level(l: Level) {
    LEVEL.store(l as u8, Relaxed);
}

/// True if messages at `l` are printed.
#[inline]
pub fn enabled(l: Level) -> bool {
    let v = LEVEL.load(Relaxed);
    if v == UNSET {
        return level() >= l;
    }
    v >= l as u8
}

/// Prints a message at `l` to stderr if enabled.
pub fn log(l: Level, msg: std::fmt::Arguments<'_>) {
    if enabled(l) {
        eprintln!("rdmasafe[{l:?}]: {msg}");
    }
}

#[inline]
pub(crate) fn trace_cm_event(t: crate::cm::EventType, status: i32) {
    if enabled(Level::Trace) {
        log(Level::Trace, format_args!("copied and acked CM event {t} status {status}"));
    }
}

#[inline]
pub(crate) fn trace_cq_wakeup(completions: usize) {
    if enabled(Level::Trace) {
        log(Level::Trace, format_args!("CQ loop wakeup: {completions} completions"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn parses_levels() {
        assert_eq!(parse("TRACE"), Level::Trace);
        assert_eq!(parse("warn"), Level::Warn);
        assert_eq!(parse("nonsense"), Level::Off);
        assert!(Level::Trace > Level::Error);
    }
}
