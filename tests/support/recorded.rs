//! What a test's own metrics recorder recorded (feature `metrics`).

use std::future::Future;

use metrics_util::CompositeKey;
use metrics_util::debugging::{DebugValue, DebuggingRecorder};

/// Everything a recorder recorded: a snapshot drains the recorder, so it is taken once.
pub struct Recorded(pub Vec<(CompositeKey, DebugValue)>);

/// Runs `f` with a fresh recorder on this thread (a current-thread runtime, so that the
/// backends' tasks record there too); returns what was recorded.
pub fn recorded<F: Future<Output = ()>>(f: impl FnOnce() -> F) -> Recorded {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::with_local_recorder(&recorder, || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(f())
    });
    Recorded(
        (snapshotter.snapshot().into_vec().into_iter())
            .map(|(key, _, _, value)| (key, value))
            .collect(),
    )
}

/// The value of metric `name` whose labels include all of `labels`, if it was recorded.
pub fn value<'a>(s: &'a Recorded, name: &str, labels: &[(&str, &str)]) -> Option<&'a DebugValue> {
    s.0.iter()
        .find(|(key, _)| {
            let key = key.key();
            key.name() == name
                && labels
                    .iter()
                    .all(|(k, v)| key.labels().any(|l| l.key() == *k && l.value() == *v))
        })
        .map(|(_, v)| v)
}

/// The counter `name` with all of `labels`: 0 if it was not recorded.
pub fn count(s: &Recorded, name: &str, labels: &[(&str, &str)]) -> u64 {
    match value(s, name, labels) {
        Some(DebugValue::Counter(n)) => *n,
        None => 0,
        other => panic!("{name}: {other:?}"),
    }
}
