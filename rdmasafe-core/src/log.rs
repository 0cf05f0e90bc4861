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

/// Where messages go: stderr by default, or a sink the app installs.
pub type Sink = Box<dyn Fn(Level, &str) + Send + Sync>;

fn sink() -> &'static std::sync::RwLock<Option<Sink>> {
    static S: std::sync::OnceLock<std::sync::RwLock<Option<Sink>>> = std::sync::OnceLock::new();
    S.get_or_init(Default::default)
}

/// Sends messages to `f` instead of stderr (`None`: back to stderr).
pub fn set_sink(f: Option<Sink>) {
    *sink().write().unwrap_or_else(|e| e.into_inner()) = f;
}

/// Emits a message at `l` if enabled (formatting happens only then).
pub fn log(l: Level, msg: std::fmt::Arguments<'_>) {
    if !enabled(l) {
        return;
    }
    let s = sink().read().unwrap_or_else(|e| e.into_inner());
    match s.as_ref() {
        Some(f) => f(l, &msg.to_string()),
        None => eprintln!("rdmasafe[{l:?}]: {msg}"),
    }
}

/// The level for a number (0 off ... 5 trace), `None` outside 0..=5.
pub fn level_from_i32(v: i32) -> Option<Level> {
    [Level::Off, Level::Error, Level::Warn, Level::Info, Level::Debug, Level::Trace]
        .get(usize::try_from(v).ok()?)
        .copied()
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
        assert_eq!(level_from_i32(5), Some(Level::Trace));
        assert_eq!(level_from_i32(6), None);
        assert_eq!(level_from_i32(-1), None);
    }

    #[test]
    fn sink_receives_enabled_messages_only() {
        use std::sync::{Arc, Mutex};
        let got: Arc<Mutex<Vec<(Level, String)>>> = Arc::default();
        let g = got.clone();
        set_sink(Some(Box::new(move |l, m| g.lock().unwrap().push((l, m.to_string())))));
        set_level(Level::Warn);
        log(Level::Error, format_args!("bad {}", 1));
        log(Level::Trace, format_args!("not shown"));
        set_level(Level::Off);
        set_sink(None);
        assert_eq!(*got.lock().unwrap(), [(Level::Error, "bad 1".to_string())]);
    }
}
