//! Which layers share buckets: same store, same policy name and quotas. Two layers built
//! separately that share are warned about; clones share silently; other stores never share.

mod support;

use tollgate::backend::LocalBackend;
use tollgate::key::Global;
use tollgate::{Policy, Quota, RateLimitLayer};

/// How many warnings about shared buckets were logged.
fn warnings(logs: &support::Logs) -> usize {
    logs.lines("WARN")
        .iter()
        .filter(|l| l.contains("share its buckets"))
        .count()
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
    let (logs, _guard) = support::Logs::capture();
    let api = || Policy::new("api", Quota::per_second(5));

    let shared = LocalBackend::new();
    let first = layer(&shared, api());
    // A clone is the explicit way to share: no warning.
    let clone = first.clone();
    assert_eq!(warnings(&logs), 0);
    // Another backend is another store: nothing shared, no warning.
    let _other = layer(&LocalBackend::new(), api());
    // The same name with other quotas has buckets of its own.
    let _different = layer(&shared, Policy::new("api", Quota::per_second(6)));
    // So does the same rate counted by another algorithm.
    let _fixed = layer(
        &shared,
        Policy::new("api", Quota::per_second(5).fixed_window()),
    );
    assert_eq!(warnings(&logs), 0);
    // Built separately on one store, with the same policy: they share, and the log says so.
    let second = layer(&shared, api());
    assert_eq!(warnings(&logs), 1);
    drop((first, clone, second));
    // Once the earlier layers are gone, nothing is shared any more.
    let _third = layer(&shared, api());
    assert_eq!(warnings(&logs), 1);
}
