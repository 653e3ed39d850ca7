//! What the SQL backends' builders share: the connection (a URL or a pool), the table, the
//! prefix, the pool's size and the sweep, checked and built into a [`SqlStore`] the same way.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use super::store::{Dialect, SqlStore, sweep_batch};
use super::sweep::{SWEEP_BATCH, SWEEP_EVERY, Sweeper};
use crate::ConfigError;
use crate::backend::remote::redact::{self, Secrets};
use crate::backend::remote::{Options, Remote, keys};

/// Where a SQL backend connects: a URL, from which it makes its pool, or a pool handed over.
pub(crate) enum Target<P> {
    Url(String),
    Pool(P),
}

/// The options both SQL builders have (the remote options, `opts`, are beside it, for
/// [`options_methods`](crate::backend::remote::options_methods)).
pub(crate) struct Config<P> {
    pub(crate) target: Option<Target<P>>,
    pub(crate) schema: Option<String>,
    pub(crate) table: String,
    pub(crate) prefix: String,
    pub(crate) pool_size: usize,
    pub(crate) sweep_every: Option<Duration>,
    pub(crate) sweep_batch: u32,
}

impl<P> Default for Config<P> {
    fn default() -> Self {
        Config {
            target: None,
            schema: None,
            table: "tollgate_buckets".to_owned(),
            prefix: "tollgate".to_owned(),
            pool_size: 8,
            sweep_every: Some(SWEEP_EVERY),
            sweep_batch: SWEEP_BATCH,
        }
    }
}

/// How long a new connection may take for a decision timeout of `timeout`: 5 times it,
/// between 250 ms and 2 s.
fn connect_timeout(timeout: Duration) -> Duration {
    timeout
        .saturating_mul(5)
        .clamp(Duration::from_millis(250), Duration::from_secs(2))
}

/// What a URL gives: the pool made from it, and where it points, password left out.
pub(crate) type FromUrl<P> = Result<(P, String), String>;

impl<P: Clone + Send + Sync + 'static> Config<P> {
    /// Checks the options and builds the store: `names` quotes the schema and table,
    /// `from_url` makes a pool from a URL with a connect timeout (its error is shown with the
    /// URL, password masked).
    pub(crate) fn build<D: Dialect<Pool = P>>(
        self,
        opts: Options,
        names: impl FnOnce(Option<&str>, &str) -> D::Names,
        from_url: impl FnOnce(&str, Duration) -> FromUrl<P>,
    ) -> Result<Remote<SqlStore<D>>, ConfigError> {
        keys::validate_prefix(&self.prefix)?;
        identifier("table", &self.table)?;
        if let Some(schema) = &self.schema {
            identifier("schema", schema)?;
        }
        let connect_timeout = connect_timeout(opts.timeout);
        let (pool, endpoint, who, secrets, size) = match self.target {
            None => {
                return Err(ConfigError::Invalid {
                    option: "connection",
                    reason: format!("no {} configured: call `url(..)` or `pool(..)`", D::NAME),
                });
            }
            Some(Target::Url(url)) => {
                let secrets = Secrets::of([url.as_str()]);
                let (pool, endpoint) =
                    from_url(&url, connect_timeout).map_err(|e| ConfigError::Invalid {
                        option: "url",
                        reason: format!("{:?}: {}", redact::url(&url), secrets.scrub(&e)),
                    })?;
                let who = format!("{} at {endpoint}", D::NAME);
                (pool, endpoint, who, secrets, self.pool_size)
            }
            Some(Target::Pool(pool)) => {
                let size = D::pool_size(&pool).unwrap_or(self.pool_size);
                let who = format!("{} (through the pool given)", D::NAME);
                (pool, "pool".to_owned(), who, Secrets::default(), size)
            }
        };
        let names = Arc::new(names(self.schema.as_deref(), &self.table));
        let sweeper = Arc::new(Sweeper::new(
            self.sweep_every,
            self.sweep_batch,
            sweep_batch::<D>(pool.clone(), names.clone(), connect_timeout),
        ));
        let store = SqlStore {
            pool,
            endpoint,
            prefix: self.prefix,
            names,
            // Up to half of the connections decide at once: the probe, the sweep and a reset
            // find one.
            in_flight: (size / 2).max(1),
            connect_timeout,
            sweeper,
            conflicts: AtomicU64::new(0),
        };
        Ok(Remote::new(store, who, secrets, opts))
    }

    /// The options in a builder's `Debug`, password masked.
    pub(crate) fn fields(&self, d: &mut fmt::DebugStruct<'_, '_>) {
        let target = match &self.target {
            None => "none".to_owned(),
            Some(Target::Url(url)) => redact::url(url),
            Some(Target::Pool(_)) => "pool".to_owned(),
        };
        d.field("target", &target)
            .field("schema", &self.schema)
            .field("table", &self.table)
            .field("prefix", &self.prefix)
            .field("pool_size", &self.pool_size);
    }
}

/// The table's name and its routine's (`<table>_decide_2`), each quoted with `quote` and
/// qualified by `schema` when there is one.
pub(crate) fn qualified(schema: Option<&str>, table: &str, quote: char) -> (String, String) {
    let qualify = |name: &str| match schema {
        Some(schema) => format!("{quote}{schema}{quote}.{quote}{name}{quote}"),
        None => format!("{quote}{name}{quote}"),
    };
    (qualify(table), qualify(&format!("{table}_decide_2")))
}

/// Checks a table or schema name: a plain SQL identifier (letters, digits, `_`, not starting
/// with a digit, at most 48 bytes so that the routine's name derived from it fits), quoted
/// when used.
pub(crate) fn identifier(option: &'static str, name: &str) -> Result<(), ConfigError> {
    let ok = !name.is_empty()
        && name.len() <= 48
        && !name.starts_with(|c: char| c.is_ascii_digit())
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
    if ok {
        Ok(())
    } else {
        Err(ConfigError::Invalid {
            option,
            reason: format!(
                "{name:?}: use 1 to 48 ASCII letters, digits or `_`, not starting with a digit"
            ),
        })
    }
}

/// The SQL builders' methods for the options of [`Config`] (in a field `sql`) and the remote
/// options (in a field `opts`): the docs that differ per database are given, the rest are
/// written here once. `$routine` is what decides (`function`, `procedure`), `$db` the
/// database's name.
macro_rules! builder_methods {
    (
        $builder:ident, $backend:ident, $pool:ty, $routine:literal, $db:literal;
        $(#[$url:meta])* url;
        $(#[$pool_doc:meta])* pool;
        $(#[$schema:meta])* schema;
        $(#[$size:meta])* pool_size;
    ) => {
        $crate::backend::remote::options_methods!($builder, $db);

        impl $builder {
            $(#[$url])*
            pub fn url(mut self, url: impl Into<String>) -> Self {
                self.sql.target = Some($crate::backend::sql::Target::Url(url.into()));
                self
            }

            $(#[$pool_doc])*
            pub fn pool(mut self, pool: $pool) -> Self {
                self.sql.target = Some($crate::backend::sql::Target::Pool(pool));
                self
            }

            $(#[$schema])*
            pub fn schema(mut self, schema: impl Into<String>) -> Self {
                self.sql.schema = Some(schema.into());
                self
            }

            #[doc = concat!("The table holding the buckets (default `tollgate_buckets`); the ", $routine, " deciding")]
            /// is named after it (`tollgate_buckets_decide_2`). A plain identifier of at most 48
            /// bytes.
            pub fn table(mut self, table: impl Into<String>) -> Self {
                self.sql.table = table.into();
                self
            }

            /// The first part of every bucket's key (default `tollgate`), as for the Redis
            /// backend: backends with different prefixes share a table without sharing buckets.
            pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
                self.sql.prefix = prefix.into();
                self
            }

            $(#[$size])*
            pub fn pool_size(mut self, size: usize) -> Self {
                self.sql.pool_size = size.max(2);
                self
            }

            /// How often the background sweep deletes the rows of idle buckets (those equal to
            /// a fresh bucket), in batches of `batch` rows (default every 10 s, 1 000 rows; at
            /// most 100 batches per sweep). `None` turns it off (sweep yourself with
            #[doc = concat!("[`", stringify!($backend), "::sweep`], or with the SQL in the module docs).")]
            pub fn sweep(mut self, every: Option<std::time::Duration>, batch: u32) -> Self {
                self.sql.sweep_every = every.map(|e| e.max(std::time::Duration::from_millis(10)));
                self.sql.sweep_batch = batch.max(1);
                self
            }
        }
    };
}
pub(crate) use builder_methods;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers_are_plain() {
        assert!(identifier("table", "tollgate_buckets").is_ok());
        for bad in ["", "1x", "a-b", "a\"b", "a b", &"x".repeat(49)] {
            assert!(identifier("table", bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn names_are_quoted_and_qualified() {
        assert_eq!(
            qualified(Some("s"), "t", '"'),
            (r#""s"."t""#.to_owned(), r#""s"."t_decide_2""#.to_owned())
        );
        assert_eq!(
            qualified(None, "t", '`'),
            ("`t`".to_owned(), "`t_decide_2`".to_owned())
        );
    }

    #[test]
    fn connections_get_five_timeouts_within_bounds() {
        assert_eq!(
            connect_timeout(Duration::from_millis(10)),
            Duration::from_millis(250)
        );
        assert_eq!(
            connect_timeout(Duration::from_millis(100)),
            Duration::from_millis(500)
        );
        assert_eq!(
            connect_timeout(Duration::from_secs(9)),
            Duration::from_secs(2)
        );
    }
}
