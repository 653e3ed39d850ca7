//! Keeping credentials out of errors, logs and `Debug` output.
//!
//! Every URL the backend shows goes through [`url`], which replaces the password of its
//! userinfo (`redis://user:***@host:6379/0`) and query parameters holding secrets (`pass` and
//! `password` of Unix socket URLs, tokens); user names are shown. Texts that come from redis-rs
//! go through [`Secrets::scrub`], which also removes the passwords themselves, wherever they
//! appear: redis-rs error texts may echo a URL or a part of it.
//!
//! Both work on any string, parsable or not: a URL that redis-rs refused is shown redacted too.

use std::borrow::Cow;

/// What replaces a secret.
const MASK: &str = "***";

/// `url` with its secrets replaced by `***`: the password of the userinfo, and the values of
/// query parameters that hold secrets (`password`, `pass`, `token`, `secret`, `api_key`, ...).
/// User names are not secrets: `postgres://app@db/x` is shown as it is, so that an error can
/// say which user was meant.
pub(crate) fn url(url: &str) -> String {
    let (scheme, rest) = split_scheme(url);
    let mut out = String::with_capacity(url.len());
    out.push_str(scheme);
    let rest = match userinfo_end(scheme, rest) {
        Some(at) => {
            match rest[..at].split_once(':') {
                Some((user, _password)) => {
                    out.push_str(user);
                    out.push(':');
                    out.push_str(MASK);
                }
                None => out.push_str(&rest[..at]),
            }
            out.push('@');
            &rest[at + 1..]
        }
        None => rest,
    };
    match rest.split_once('?') {
        Some((before, query)) => {
            out.push_str(before);
            out.push('?');
            for (i, pair) in query.split('&').enumerate() {
                if i > 0 {
                    out.push('&');
                }
                match pair.split_once('=') {
                    Some((name, _value)) if is_secret_param(name) => {
                        out.push_str(name);
                        out.push('=');
                        out.push_str(MASK);
                    }
                    _ => out.push_str(pair),
                }
            }
        }
        None => out.push_str(rest),
    }
    out
}

/// `scheme://` and what follows; no scheme for strings without `://`.
fn split_scheme(url: &str) -> (&str, &str) {
    match url.find("://") {
        Some(i) => url.split_at(i + 3),
        None => ("", url),
    }
}

/// Where the userinfo of a URL without its scheme ends (its `@`), if it has one: at the last
/// `@`, since a password may hold `@`, `/` or `#` (unescaped, which makes the URL unparsable,
/// but it must still not be shown). Unix socket URLs have none (they carry the password in the
/// query, where an `@` may then be).
fn userinfo_end(scheme: &str, rest: &str) -> Option<usize> {
    if scheme.to_ascii_lowercase().contains("unix") {
        return None;
    }
    rest.rfind('@')
}

/// Whether a query parameter holds a secret: a password, a token, a key or a secret by name
/// (`password`, `sslpassword`, `pass`, `token`, `access_token`, `secret`, `api_key`, `apikey`,
/// `auth`).
fn is_secret_param(name: &str) -> bool {
    let name = name.to_ascii_lowercase();
    ["pass", "token", "secret"].iter().any(|s| name.contains(s))
        || ["auth", "key", "apikey", "api_key", "api-key"].contains(&name.as_str())
}

/// The passwords of some URLs, to be removed from any text shown to the user.
#[derive(Default, Clone)]
pub(crate) struct Secrets(Vec<String>);

impl Secrets {
    /// The secrets of `urls`, as written and percent-decoded (redis-rs sends the decoded form).
    pub(crate) fn of<'a>(urls: impl IntoIterator<Item = &'a str>) -> Self {
        let mut secrets = Vec::new();
        for url in urls {
            for secret in secrets_of(url) {
                let decoded = percent_decode(secret);
                for s in [secret.to_owned(), decoded] {
                    if !s.is_empty() && !secrets.contains(&s) {
                        secrets.push(s);
                    }
                }
            }
        }
        // Longest first: a secret that contains another is removed whole.
        secrets.sort_by_key(|s| std::cmp::Reverse(s.len()));
        Secrets(secrets)
    }

    /// `text` with every URL's credentials and every known secret replaced by `***`.
    pub(crate) fn scrub<'t>(&self, text: &'t str) -> Cow<'t, str> {
        let mut text = Cow::Borrowed(text);
        if text.contains("://") && text.contains('@') {
            text = Cow::Owned(
                text.split(' ')
                    .map(|word| {
                        if word.contains("://") && word.contains('@') {
                            Cow::Owned(url(word))
                        } else {
                            Cow::Borrowed(word)
                        }
                    })
                    .collect::<Vec<_>>()
                    .join(" "),
            );
        }
        for secret in &self.0 {
            if text.contains(secret.as_str()) {
                text = Cow::Owned(text.replace(secret.as_str(), MASK));
            }
        }
        text
    }
}

/// The secret parts of one URL, as written: the userinfo's password (not its user name), and
/// the values of query parameters that hold secrets.
fn secrets_of(url: &str) -> Vec<&str> {
    let (scheme, rest) = split_scheme(url);
    let mut found = Vec::new();
    let query_from = match userinfo_end(scheme, rest) {
        Some(at) => {
            if let Some((_, password)) = rest[..at].split_once(':') {
                found.push(password);
            }
            at + 1
        }
        None => 0,
    };
    if let Some((_, query)) = rest[query_from..].split_once('?') {
        let query = query.split_once('#').map_or(query, |(q, _)| q);
        for pair in query.split('&') {
            if let Some((name, value)) = pair.split_once('=')
                && is_secret_param(name)
            {
                found.push(value);
            }
        }
    }
    found
}

/// `%XX` sequences decoded (invalid ones kept as they are); invalid UTF-8 replaced.
fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        if bytes[i] == b'%'
            && let (Some(hi), Some(lo)) = (
                bytes.get(i + 1).copied().and_then(hex),
                bytes.get(i + 2).copied().and_then(hex),
            )
        {
            // Two hex digits: at most 255.
            out.push((hi * 16 + lo) as u8);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_masked_in_urls() {
        let cases = [
            ("redis://127.0.0.1:6379", "redis://127.0.0.1:6379"),
            (
                "redis://:s3cret@127.0.0.1:6379/2",
                "redis://:***@127.0.0.1:6379/2",
            ),
            ("rediss://user:s3cret@host/0", "rediss://user:***@host/0"),
            ("redis://app@host", "redis://app@host"),
            (
                "postgres://postgres@127.0.0.1:5432/x",
                "postgres://postgres@127.0.0.1:5432/x",
            ),
            (
                "postgres://h/db?user=app&sslpassword=k&access_token=t",
                "postgres://h/db?user=app&sslpassword=***&access_token=***",
            ),
            ("redis://:p@ss/w#rd@host:1/0", "redis://:***@host:1/0"),
            (
                "redis+unix:///tmp/r.sock?db=1&pass=s3cret",
                "redis+unix:///tmp/r.sock?db=1&pass=***",
            ),
            (":s3cret@host", ":***@host"),
            ("unix:///s?pass=p@ss", "unix:///s?pass=***"),
            ("", ""),
            ("://@", "://@"),
            ("://:@", "://:***@"),
        ];
        for (given, shown) in cases {
            assert_eq!(url(given), shown, "{given}");
        }
    }

    #[test]
    fn secrets_are_scrubbed_from_any_text() {
        let s = Secrets::of([
            "redis://user:p%40ss@host:1",
            "redis+unix:///s?pass=unixpw",
            "redis://127.0.0.1",
        ]);
        assert_eq!(
            s.scrub("failed: redis://user:p%40ss@host:1 said p@ss and unixpw"),
            "failed: redis://user:***@host:1 said *** and ***"
        );
        assert!(matches!(s.scrub("nothing here"), Cow::Borrowed(_)));
        // A user name is not a secret: not removed from texts that name it elsewhere.
        let s = Secrets::of(["postgres://postgres@127.0.0.1:5432/x"]);
        assert_eq!(
            s.scrub("Unsupported connection URL scheme `postgres'"),
            "Unsupported connection URL scheme `postgres'"
        );
        assert_eq!(Secrets::default().scrub("x://a:b@c"), "x://a:***@c");
    }

    #[test]
    fn percent_decoding_never_panics() {
        assert_eq!(percent_decode("a%41%4"), "aA%4");
        assert_eq!(percent_decode("%zz%"), "%zz%");
        assert_eq!(percent_decode("%ff"), "\u{fffd}");
    }
}
