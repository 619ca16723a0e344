//! `--config FILE.toml`: flags from a TOML file, as vLLM's and SGLang's `--config` read theirs.
//!
//! The file is a flat table whose keys are the subcommand's long flags, spelled with dashes or
//! underscores (`model-path` or `model_path`):
//!
//! ```toml
//! model-path = "/models/Llama-3.2-1B-Instruct"
//! page-size = 16
//! max-total-tokens = 262144
//! schedule-policy = "lpm"
//! disable-radix-cache = false
//! ```
//!
//! [`expand_config`] turns each entry into the flag it names and inserts those flags right after
//! the subcommand, so the file goes through the same parser and the same validation as the
//! command line (an unknown key is clap's "unexpected argument"; a bad value names its flag). A
//! flag given on the command line wins over the file. Values: strings and numbers become the
//! flag's value, `true` gives a switch and `false` leaves it off, and arrays are joined with
//! commas (for list flags such as `--policy`). Nested tables are refused.

use std::ffi::OsString;
use std::path::Path;

use crate::error::{EngineError, Result};

/// The flag that names the file.
pub const CONFIG_FLAG: &str = "--config";

/// Returns `args` (the whole command line, program name first) with the flags of the
/// `--config FILE` it contains inserted after the subcommand; unchanged when there is none.
pub fn expand_config(args: Vec<OsString>) -> Result<Vec<OsString>> {
    let Some(path) = config_path(&args)? else {
        return Ok(args);
    };
    let text = std::fs::read_to_string(&path).map_err(|source| EngineError::Io {
        path: path.clone(),
        source,
    })?;
    let given: Vec<String> = args
        .iter()
        .filter_map(|a| a.to_str())
        .filter(|a| a.starts_with("--"))
        .map(|a| a.split('=').next().unwrap_or(a).to_string())
        .collect();
    let flags = flags_from_toml(&text, Path::new(&path))?
        .into_iter()
        .filter(|(flag, _)| !given.contains(flag))
        .flat_map(|(flag, value)| std::iter::once(flag).chain(value))
        .map(OsString::from);
    // Program name, subcommand, the file's flags, then the command line's own.
    let mut out: Vec<OsString> = args.iter().take(2).cloned().collect();
    out.extend(flags);
    out.extend(args.into_iter().skip(2));
    Ok(out)
}

/// The `FILE` of `--config FILE` or `--config=FILE`, if present.
fn config_path(args: &[OsString]) -> Result<Option<String>> {
    let mut it = args.iter().skip(1);
    while let Some(a) = it.next() {
        let Some(a) = a.to_str() else { continue };
        if a == "--" {
            break;
        }
        if let Some(v) = a.strip_prefix("--config=") {
            return Ok(Some(v.to_string()));
        }
        if a == CONFIG_FLAG {
            let v = it.next().and_then(|v| v.to_str()).ok_or_else(|| {
                EngineError::arg(CONFIG_FLAG, "expects a TOML file path after it")
            })?;
            return Ok(Some(v.to_string()));
        }
    }
    Ok(None)
}

/// The `(--flag, value)` pairs a config file's text stands for, sorted by key (the order of
/// flags does not matter to the parser).
pub fn flags_from_toml(text: &str, path: &Path) -> Result<Vec<(String, Option<String>)>> {
    let bad =
        |message: String| EngineError::arg(CONFIG_FLAG, format!("{}: {message}", path.display()));
    let table: toml::Table = text
        .parse()
        .map_err(|e: toml::de::Error| bad(e.to_string()))?;
    let mut flags = Vec::with_capacity(table.len());
    for (key, value) in table {
        let flag = format!("--{}", key.replace('_', "-"));
        if flag == CONFIG_FLAG {
            return Err(bad("a config file cannot name another config file".into()));
        }
        let scalar = |v: &toml::Value| -> Result<String> {
            match v {
                toml::Value::String(s) => Ok(s.clone()),
                toml::Value::Integer(i) => Ok(i.to_string()),
                toml::Value::Float(f) => Ok(f.to_string()),
                toml::Value::Boolean(b) => Ok(b.to_string()),
                other => Err(bad(format!(
                    "{key}: expected a string, number or boolean, got {}",
                    other.type_str()
                ))),
            }
        };
        match &value {
            toml::Value::Boolean(true) => flags.push((flag, None)),
            toml::Value::Boolean(false) => {}
            toml::Value::Array(items) => {
                let parts = items.iter().map(scalar).collect::<Result<Vec<_>>>()?;
                flags.push((flag, Some(parts.join(","))));
            }
            toml::Value::Table(_) => {
                return Err(bad(format!(
                    "{key}: sections are not supported; write the flags as top-level keys"
                )))
            }
            v => flags.push((flag, Some(scalar(v)?))),
        }
    }
    Ok(flags)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn os(args: &[&str]) -> Vec<OsString> {
        args.iter().map(OsString::from).collect()
    }

    #[test]
    fn values_become_flags() {
        let text = r#"
model_path = "/m"
page-size = 16
mem-fraction-static = 0.5
disable-radix-cache = true
enable-mixed-chunk = false
policy = ["lru", "lfu"]
"#;
        let flags = flags_from_toml(text, Path::new("c.toml")).unwrap();
        let rendered: Vec<String> = flags
            .iter()
            .map(|(f, v)| format!("{f} {}", v.as_deref().unwrap_or("(switch)")))
            .collect();
        assert_eq!(
            rendered,
            [
                "--disable-radix-cache (switch)",
                "--mem-fraction-static 0.5",
                "--model-path /m",
                "--page-size 16",
                "--policy lru,lfu"
            ]
        );
    }

    #[test]
    fn bad_files_are_errors_naming_the_file() {
        for (text, needle) in [
            ("page-size = ", "c.toml"),
            ("[engine]\npage-size = 1", "sections are not supported"),
            ("config = \"x.toml\"", "another config file"),
            ("policy = [[1]]", "expected a string"),
        ] {
            let e = flags_from_toml(text, Path::new("c.toml")).unwrap_err();
            let msg = e.to_string();
            assert!(msg.contains("--config"), "{msg}");
            assert!(msg.contains(needle), "{text:?}: {msg}");
        }
    }

    #[test]
    fn command_line_flags_win_and_the_file_goes_after_the_subcommand() {
        let dir = std::env::temp_dir().join(format!("kvserve-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("serve.toml");
        std::fs::write(&file, "port = 1\npage-size = 32\n").unwrap();
        let args = os(&[
            "kvserve",
            "serve",
            "--config",
            file.to_str().unwrap(),
            "--port=2",
        ]);
        let out = expand_config(args).unwrap();
        let out: Vec<&str> = out.iter().map(|a| a.to_str().unwrap()).collect();
        assert_eq!(
            out,
            [
                "kvserve",
                "serve",
                "--page-size",
                "32",
                "--config",
                file.to_str().unwrap(),
                "--port=2"
            ]
        );
        assert!(expand_config(os(&["kvserve", "serve", "--config"])).is_err());
        let missing = expand_config(os(&["kvserve", "serve", "--config", "/nonexistent.toml"]));
        assert!(missing
            .unwrap_err()
            .to_string()
            .contains("/nonexistent.toml"));
        assert_eq!(
            expand_config(os(&["kvserve", "serve", "--port", "3"])).unwrap(),
            os(&["kvserve", "serve", "--port", "3"])
        );
    }
}
