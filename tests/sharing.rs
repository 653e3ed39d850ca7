//! Which layers share buckets: same store, same policy name and quotas. Two layers built
//! separately that share are warned about; clones share silently; other stores never share.

use std::sync::{Arc, Mutex};

use tollgate::backend::LocalBackend;
use tollgate::key::Global;
use tollgate::{Policy, Quota, RateLimitLayer};

#[derive(Clone, Default)]
struct Logs(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Logs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Logs {
    fn warnings(&self) -> usize {
        String::from_utf8_lossy(&self.0.lock().unwrap())
            .lines()
            .filter(|l| l.contains("share its buckets"))
            .count()
    }
}

fn layer(backend: &LocalBackend, policy: Policy) -> RateLimitLayer<Global, LocalBackend> {
    RateLimitLayer::builder()
        .key(Global)
        .backend(backend.clone())
        .policy(policy)
        .build()
        .unwrap()
}

#[test]
fn separately_built_layers_sharing_buckets_are_warned_about() {
    let logs = Logs::default();
    let writer = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    let api = || Policy::new("api", Quota::per_second(5));

    let shared = LocalBackend::new();
    let first = layer(&shared, api());
    // A clone is the explicit way to share: no warning.
    let clone = first.clone();
    assert_eq!(logs.warnings(), 0);
    // Another backend is another store: nothing shared, no warning.
    let _other = layer(&LocalBackend::new(), api());
    // The same name with other quotas has buckets of its own.
    let _different = layer(&shared, Policy::new("api", Quota::per_second(6)));
    assert_eq!(logs.warnings(), 0);
    // Built separately on one store, with the same policy: they share, and the log says so.
    let second = layer(&shared, api());
    assert_eq!(logs.warnings(), 1);
    drop((first, clone, second));
    // Once the earlier layers are gone, nothing is shared any more.
    let _third = layer(&shared, api());
    assert_eq!(logs.warnings(), 1);
}
