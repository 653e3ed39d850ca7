//! Where a bucket lives in Redis.
//!
//! A quota's key is `<prefix>:{<policy>:<key>}:<quota index><algorithm><parameters>` (for GCRA
//! `g<emission ns>x<burst>`):
//!
//! - the part in braces is the Redis Cluster hash tag, the same for every quota of one decision,
//!   so that the script's keys live in one slot (Redis Cluster refuses scripts whose keys span
//!   slots), while different clients and policies spread over the cluster;
//! - `<policy>` and `<key>` are percent-escaped: every byte outside `[A-Za-z0-9._-]` becomes
//!   `%XX`. The escaping is injective and produces no `{`, `}` or `:`, so no key material can
//!   close the hash tag, inject a separator, or spell another tenant's key; `<key>` is
//!   [`Key::encode`], which is itself unambiguous and bounded (at most 1 047 bytes, so at most
//!   3 141 characters escaped);
//! - the suffix after the hash tag names the quota by the stored format, its algorithm and its
//!   identity in the policy, not its values (see [`quota_keys`]).

use crate::quota::{QuotaKind, QuotaParams};
use crate::{ConfigError, Key};

/// The key bytes before the escaped client key: `<prefix>:{<policy>:`.
pub(crate) fn policy_prefix(prefix: &str, policy: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(prefix.len() + policy.len() + 3);
    out.extend_from_slice(prefix.as_bytes());
    out.extend_from_slice(b":{");
    escape(policy.as_bytes(), &mut out);
    out.push(b':');
    out
}

/// Checks a user-chosen key prefix: non-empty, printable, no braces (which would move the hash
/// tag), bounded.
pub(crate) fn validate_prefix(prefix: &str) -> Result<(), ConfigError> {
    let ok = !prefix.is_empty()
        && prefix.len() <= 64
        && prefix
            .bytes()
            .all(|b| b.is_ascii_graphic() && b != b'{' && b != b'}');
    if ok {
        Ok(())
    } else {
        Err(ConfigError::Invalid {
            option: "prefix",
            reason: format!(
                "{prefix:?}: use 1 to 64 visible ASCII characters without `{{` or `}}`"
            ),
        })
    }
}

/// The keys of one decision, one per quota.
#[cfg(test)]
fn bucket_keys(policy_prefix: &[u8], key: &Key, suffixes: &[Box<[u8]>]) -> Vec<Vec<u8>> {
    let mut base = Vec::new();
    key_base(policy_prefix, key, &mut base);
    suffixes
        .iter()
        .map(|suffix| {
            let mut k = Vec::with_capacity(base.len() + suffix.len());
            k.extend_from_slice(&base);
            k.extend_from_slice(suffix);
            k
        })
        .collect()
}

/// Writes the part of a decision's keys shared by its quotas, `<prefix>:{<policy>:<key>}:`,
/// into `out` (cleared first); each quota's key is this followed by its suffix.
pub(crate) fn key_base(policy_prefix: &[u8], key: &Key, out: &mut Vec<u8>) {
    // The encoding is escaped byte by byte straight into `out`.
    let mut encoded = smallvec::SmallVec::<[u8; 64]>::new();
    key.encode_into(&mut encoded);
    out.clear();
    out.reserve(policy_prefix.len() + 3 * encoded.len() + 2);
    out.extend_from_slice(policy_prefix);
    escape(&encoded, out);
    out.extend_from_slice(b"}:");
}

/// The stored format the Redis and SQL stores write: their keys' suffixes start with `2.`, and
/// every value (Redis) or rate quota's row (SQL) ends with the format's number (see
/// `gcra.lua`, `postgres.sql`, `mysql.sql`). Format 1 (the release before) named a quota's
/// values in its keys, `<index><algorithm><parameters>`; those keys are never read.
pub(crate) const FORMAT: u8 = 2;

/// The per-quota key suffixes of stored format 2 (Redis keys, SQL rows): `2.<algorithm><quota>`, the
/// algorithm a letter (`g` GCRA, `f` fixed window, `s` sliding window, `c` requests in
/// flight) and the quota its identity in the policy (`Policy::quota_id`: its place, or `-`
/// and its escaped name), then `2.b` for the policy's blocks when it has them. A quota's
/// values are not in its key: a changed quota keeps its buckets, whose values say what they
/// were counted under (see [`OnChange`](crate::quota::OnChange)); a changed algorithm is
/// another key, and starts afresh.
pub(crate) fn quota_keys(policy: &crate::Policy, params: &[QuotaParams]) -> Vec<Box<[u8]>> {
    let mut out: Vec<Box<[u8]>> = params
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let letter = match p.kind {
                QuotaKind::Gcra => b'g',
                QuotaKind::FixedWindow { .. } => b'f',
                QuotaKind::SlidingWindow { .. } => b's',
                QuotaKind::Concurrent { .. } => b'c',
                #[cfg(feature = "calendar")]
                QuotaKind::Calendar { .. } => b'd',
            };
            let mut k = vec![b'0' + FORMAT, b'.', letter];
            escape(policy.quota_id(i).as_bytes(), &mut k);
            k.into_boxed_slice()
        })
        .collect();
    if policy.block().is_some() {
        out.push(vec![b'0' + FORMAT, b'.', b'b'].into_boxed_slice());
    }
    out
}

/// The key suffixes stored format 1 gave the same quotas (the release before this one):
/// `<index><algorithm><parameters>`, the values in the name (`0g200000000x10`), then
/// `b<block µs>` for blocks. Read and written beside format 2's during a rolling upgrade
/// ([`upgrade_from_format_1`](crate::backend::redis::RedisBackendBuilder::upgrade_from_format_1)).
#[cfg(feature = "redis")]
pub(crate) fn format_1_keys(params: &[QuotaParams], block_us: Option<u64>) -> Vec<Box<[u8]>> {
    let quotas = params.iter().enumerate().map(|(i, p)| {
        let limit = p.burst;
        match p.kind {
            QuotaKind::Gcra => format!("{i}g{}x{limit}", p.emission_ns),
            QuotaKind::FixedWindow { window_us } => format!("{i}f{window_us}x{limit}"),
            QuotaKind::SlidingWindow { slice_us, slices } => {
                format!("{i}s{slice_us}x{slices}x{limit}")
            }
            QuotaKind::Concurrent { lease_ms } => format!("{i}c{lease_ms}x{limit}"),
            // Format 1 had no calendar quotas: a name it never wrote.
            #[cfg(feature = "calendar")]
            QuotaKind::Calendar { calendar } => format!("{i}d{}x{limit}", calendar.clock().id()),
        }
    });
    (quotas.chain(block_us.map(|us| format!("b{us}"))))
        .map(|k| k.into_bytes().into_boxed_slice())
        .collect()
}

/// Whether a key suffix of [`quota_keys`] is a concurrent quota's (its slots in flight):
/// `reset` leaves those, whose requests still run and give their slots back when they end.
pub(crate) fn holds_slots(suffix: &[u8]) -> bool {
    matches!(suffix, [v, b'.', b'c', ..] if *v == b'0' + FORMAT)
}

/// Appends `bytes` to `out` escaped as key material (see the module docs).
pub(crate) fn escape(bytes: &[u8], out: &mut Vec<u8>) {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    for &b in bytes {
        if b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-' {
            out.push(b);
        } else {
            out.extend_from_slice(&[b'%', HEX[usize::from(b >> 4)], HEX[usize::from(b & 15)]]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(policy: &str, key: &Key) -> Vec<String> {
        let p = crate::Policy::new("p", crate::Quota::per_second(5).burst(10))
            .and(crate::Quota::per_hour(100));
        let params = p.validate().unwrap();
        bucket_keys(
            &policy_prefix("tollgate", policy),
            key,
            &quota_keys(&p, &params),
        )
        .into_iter()
        .map(|k| String::from_utf8(k).unwrap())
        .collect()
    }

    #[test]
    fn format_2_names_quotas_by_identity_not_values() {
        let suffixes = |p: &crate::Policy| -> Vec<String> {
            let params = p.validate().unwrap();
            (quota_keys(p, &params).into_iter())
                .map(|k| String::from_utf8(k.into_vec()).unwrap())
                .collect()
        };
        let p = crate::Policy::new("p", crate::Quota::per_second(5).burst(10))
            .and(
                crate::Quota::per_hour(100)
                    .fixed_window()
                    .named("by:the/hour"),
            )
            .and(crate::Quota::concurrent(2))
            .block_for(std::time::Duration::from_secs(60));
        assert_eq!(suffixes(&p), ["2.g0", "2.f-by%3Athe%2Fhour", "2.c2", "2.b"]);
        // Other values, the same keys.
        let q = crate::Policy::new("p", crate::Quota::per_minute(7))
            .and(crate::Quota::per_day(9).fixed_window().named("by:the/hour"));
        assert_eq!(suffixes(&q)[..2], suffixes(&p)[..2]);
        assert!(holds_slots(b"2.c2") && !holds_slots(b"2.g0") && !holds_slots(b"2.b"));
    }

    #[test]
    fn layout() {
        let k = keys("api", &Key::from_bytes("alice").unwrap());
        assert_eq!(
            k,
            ["tollgate:{api:balice}:2.g0", "tollgate:{api:balice}:2.g1"]
        );
        let ip = keys("api", &Key::ip("127.0.0.1".parse().unwrap()));
        assert_eq!(ip[0], "tollgate:{api:4%7F%00%00%01}:2.g0");
    }

    #[test]
    fn no_key_material_escapes_its_slot() {
        // A client choosing its key cannot close the hash tag or forge another tenant's key.
        let evil = keys("api", &Key::from_bytes("x}:0:{api:bbob").unwrap());
        let bob = keys("api", &Key::from_bytes("bob").unwrap());
        assert_ne!(evil[0], bob[0]);
        assert_eq!(evil[0].matches('{').count(), 1);
        assert_eq!(evil[0].matches('}').count(), 1);
        // Policy names may hold braces too.
        let p = keys("a{b}", &Key::global());
        assert_eq!(p[0], "tollgate:{a%7Bb%7D:g}:2.g0");
    }

    #[test]
    fn windows_name_their_algorithm_outside_the_hash_tag() {
        let p = crate::Policy::new("p", crate::Quota::per_hour(100).fixed_window())
            .and(
                crate::Quota::per_minute(100)
                    .sliding_window()
                    .resolution(std::time::Duration::from_secs(5)),
            )
            .and(crate::Quota::per_second(10).sliding_window());
        let params = p.validate().unwrap();
        let k: Vec<String> = bucket_keys(
            &policy_prefix("tollgate", "api"),
            &Key::from_bytes("alice").unwrap(),
            &quota_keys(&p, &params),
        )
        .into_iter()
        .map(|k| String::from_utf8(k).unwrap())
        .collect();
        assert_eq!(
            k,
            [
                "tollgate:{api:balice}:2.f0",
                "tollgate:{api:balice}:2.s1",
                "tollgate:{api:balice}:2.s2",
            ]
        );
    }

    #[test]
    fn bounded_length() {
        let long = Key::from_bytes(vec![0xFF; Key::MAX_LEN]).unwrap();
        let k = keys("api", &Key::composite([&long, &long, &long]).unwrap());
        assert!(
            k[0].len() < 3 * 4 * (Key::MAX_LEN + 3) + 64,
            "{}",
            k[0].len()
        );
    }

    #[test]
    fn prefixes_are_checked() {
        assert!(validate_prefix("tollgate").is_ok());
        assert!(validate_prefix("app:rl").is_ok());
        for bad in ["", "a{b", "a}b", "a b", &"x".repeat(65)] {
            assert!(validate_prefix(bad).is_err(), "{bad:?}");
        }
    }
}
