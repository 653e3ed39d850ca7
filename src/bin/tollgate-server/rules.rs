//! The rules: read from their files, and read again when what the files hold changes.
//!
//! Changes are found by content, not by modification times: a Kubernetes ConfigMap's update
//! swaps a symlink (`..data`) to a new directory, leaving every file's own time as it was; a
//! file copied in with its old time is a change too. Every `reload_every` the files are read
//! and hashed; when the hash differs from the last one, the rules are parsed, checked and
//! swapped in at once, or kept as they were (and the reason logged) when one file is wrong.

use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tollgate::rls::RlsConfig;

use crate::settings::RuleSource;

/// The files' contents, in a stable order: the name and the text of each.
pub(crate) type Files = Vec<(PathBuf, String)>;

/// Reads the files `source` names now. A directory with no rule file in it is an error:
/// rules that vanish (a ConfigMap mounted wrong, a half-made directory) are not "no limits".
pub(crate) fn read(source: &RuleSource) -> Result<Files, String> {
    let paths = match source {
        RuleSource::File(file) => vec![file.clone()],
        RuleSource::Dir(dir) => list(dir, true)?,
        RuleSource::Runtime(dir) => list(dir, false)?,
    };
    if paths.is_empty() {
        return Err(format!("no rule files in {}", source_name(source)));
    }
    paths
        .into_iter()
        .map(|p| {
            std::fs::read_to_string(&p)
                .map(|text| (p.clone(), text))
                .map_err(|e| format!("{}: {e}", p.display()))
        })
        .collect()
}

/// Where the rules come from, for messages.
pub(crate) fn source_name(source: &RuleSource) -> String {
    match source {
        RuleSource::File(f) => format!("RULES_FILE {}", f.display()),
        RuleSource::Dir(d) => format!("RULES_DIR {}", d.display()),
        RuleSource::Runtime(d) => format!("the runtime directory {}", d.display()),
    }
}

/// The files of `dir`, sorted: names starting with a dot are skipped (a ConfigMap's `..data`
/// and `..2026_…` entries; editors' swap files), and so are directories. `yaml_only`: only
/// `.yaml` and `.yml` files (`RULES_DIR`); envoyproxy/ratelimit's layout takes every file.
fn list(dir: &Path, yaml_only: bool) -> Result<Vec<PathBuf>, String> {
    let entries = std::fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut files = Vec::new();
    for entry in entries {
        let path = entry.map_err(|e| format!("{}: {e}", dir.display()))?.path();
        let hidden = path
            .file_name()
            .and_then(|n| n.to_str())
            .is_none_or(|n| n.starts_with('.'));
        let yaml = path.extension().is_some_and(|e| e == "yaml" || e == "yml");
        // `is_file` follows symlinks: a ConfigMap's files are links into `..data`.
        if !hidden && (yaml || !yaml_only) && path.is_file() {
            files.push(path);
        }
    }
    files.sort();
    Ok(files)
}

/// A hash of what the files hold (names and texts), to see whether anything changed.
pub(crate) fn fingerprint(files: &Files) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    files.hash(&mut h);
    h.finish()
}

/// Parses every file: one domain each. The first file that is wrong names itself.
pub(crate) fn parse(files: &Files) -> Result<Vec<RlsConfig>, String> {
    files
        .iter()
        .map(|(path, text)| {
            RlsConfig::from_yaml(text).map_err(|e| format!("{}: {e}", path.display()))
        })
        .collect()
}

/// The rules as loaded, for `/rlconfig`: per domain, each limit's name and quotas, one line
/// each, as envoyproxy/ratelimit's `/rlconfig` lists them.
pub(crate) fn describe(configs: &[RlsConfig]) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    for config in configs {
        for policy in config.policies() {
            let quotas: Vec<String> = policy.quotas().iter().map(ToString::to_string).collect();
            let _ = writeln!(
                out,
                "{}: {}{}",
                policy.name(),
                quotas.join(" and "),
                if policy.is_shadow() {
                    ", shadow_mode: true"
                } else {
                    ""
                }
            );
        }
    }
    out
}

/// What the server knows of its rules: when they last loaded, and why the last attempt failed.
#[derive(Debug, Default)]
pub(crate) struct RulesState {
    /// The fingerprint of the files now served (`None`: none loaded yet).
    pub(crate) loaded: Option<u64>,
    /// The domains served.
    pub(crate) domains: Vec<String>,
    /// Why the files as they are now are not served (`None` when they are).
    pub(crate) error: Option<String>,
    /// The fingerprint of the files last tried.
    pub(crate) tried: Option<u64>,
}

/// The rules' state, shared by the watcher and the health check.
pub(crate) type SharedRules = Arc<std::sync::Mutex<RulesState>>;

/// Reads the files and, when they changed since the last attempt, swaps their rules in with
/// `apply`. Returns what happened, for the log: `None` when nothing changed.
pub(crate) fn reload(
    source: &RuleSource,
    state: &SharedRules,
    apply: impl FnOnce(Vec<RlsConfig>) -> Result<(), String>,
) -> Option<Result<Vec<String>, String>> {
    let files = read(source);
    let print = match &files {
        Ok(files) => fingerprint(files),
        // A failed read is a state of its own: logged once, not every second.
        Err(e) => {
            let mut h = std::collections::hash_map::DefaultHasher::new();
            e.hash(&mut h);
            h.finish() ^ 1
        }
    };
    let mut s = state.lock().unwrap_or_else(|e| e.into_inner());
    if s.tried == Some(print) {
        return None;
    }
    s.tried = Some(print);
    let outcome = files.and_then(|files| {
        let configs = parse(&files)?;
        let domains: Vec<String> = configs.iter().map(|c| c.domain().to_owned()).collect();
        apply(configs)?;
        Ok(domains)
    });
    match &outcome {
        Ok(domains) => {
            s.loaded = Some(print);
            s.domains = domains.clone();
            s.error = None;
        }
        Err(e) => s.error = Some(e.clone()),
    }
    Some(outcome)
}

#[cfg(test)]
mod tests {
    use super::*;

    const EDGE: &str = "domain: edge\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 5}\n";

    /// Found by content: the same file rewritten with other rules is a change, whatever
    /// its time (a ConfigMap's swap keeps every file's; tests/server.rs swaps one).
    #[test]
    fn a_change_is_found_by_content() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("edge.yaml");
        std::fs::write(&file, EDGE).unwrap();
        let source = RuleSource::File(file.clone());
        let state = SharedRules::default();
        let first = reload(&source, &state, |c| {
            assert_eq!(describe(&c), "edge.k: 5/s fixed\n");
            Ok(())
        });
        assert_eq!(first, Some(Ok(vec!["edge".to_owned()])));
        // Nothing changed: nothing applied.
        assert_eq!(reload(&source, &state, |_| unreachable!()), None);
        let modified = std::fs::metadata(&file).unwrap().modified().unwrap();
        std::fs::write(&file, EDGE.replace('5', "7")).unwrap();
        std::fs::File::options()
            .write(true)
            .open(&file)
            .unwrap()
            .set_modified(modified)
            .unwrap();
        let second = reload(&source, &state, |c| {
            assert_eq!(describe(&c), "edge.k: 7/s fixed\n");
            Ok(())
        });
        assert_eq!(second, Some(Ok(vec!["edge".to_owned()])));
        // A rule file named with a dot first is skipped in a directory.
        std::fs::write(dir.path().join(".edge.yaml.swp"), "not yaml: [").unwrap();
        let files = read(&RuleSource::Dir(dir.path().to_owned())).unwrap();
        assert_eq!(files.len(), 1);
    }

    #[test]
    fn a_wrong_file_keeps_the_rules_and_says_why_once() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("edge.yaml"), EDGE).unwrap();
        let source = RuleSource::Dir(dir.path().to_owned());
        let state = SharedRules::default();
        assert!(matches!(reload(&source, &state, |_| Ok(())), Some(Ok(_))));
        let loaded = state.lock().unwrap().loaded;
        std::fs::write(
            dir.path().join("edge.yaml"),
            "domain: edge\ndescriptors: [oops",
        )
        .unwrap();
        let Some(Err(why)) = reload(&source, &state, |_| unreachable!()) else {
            panic!("a wrong file must be refused")
        };
        assert!(why.contains("edge.yaml"), "{why}");
        assert_eq!(state.lock().unwrap().loaded, loaded);
        assert_eq!(state.lock().unwrap().error.as_deref(), Some(why.as_str()));
        // Said once.
        assert_eq!(reload(&source, &state, |_| unreachable!()), None);
        // Not yaml: not read in RULES_DIR.
        std::fs::write(dir.path().join("edge.yaml"), EDGE).unwrap();
        std::fs::write(dir.path().join("notes.txt"), "not rules").unwrap();
        assert!(matches!(reload(&source, &state, |_| Ok(())), Some(Ok(_))));
        assert_eq!(state.lock().unwrap().error, None);
    }

    #[test]
    fn an_empty_directory_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let e = read(&RuleSource::Runtime(dir.path().to_owned())).unwrap_err();
        assert!(e.contains("no rule files"), "{e}");
    }
}
