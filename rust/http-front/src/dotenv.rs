//! Where a server finds its settings before it parses its flags: `.env` in the working folder, then in the
//! repository holding the executable.

use std::path::{Path, PathBuf};

/// The repository holding this executable: the nearest folder above it with a `pyproject.toml`.
pub fn repository() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?.canonicalize().ok()?;
    exe.ancestors()
        .skip(1)
        .find(|dir| dir.join("pyproject.toml").is_file())
        .map(Path::to_path_buf)
}

/// `KEY=VALUE` lines of `.env` in the working folder, then in the repository, into the environment;
/// a variable already set (in the environment, or by the first file) keeps its value.
pub fn load_dotenv() {
    let mut files = vec![PathBuf::from(".env")];
    if let Some(root) = repository() {
        files.push(root.join(".env"));
    }
    for file in files {
        if let Ok(text) = std::fs::read_to_string(&file) {
            for (key, value) in parse_dotenv(&text) {
                if std::env::var_os(&key).is_none() {
                    std::env::set_var(key, value);
                }
            }
        }
    }
}

/// The assignments of a `.env` text: `KEY=VALUE`, optional `export `, `#` comments, quoted values.
fn parse_dotenv(text: &str) -> Vec<(String, String)> {
    let mut pairs = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let line = line.strip_prefix("export ").unwrap_or(line);
        let (key, value) = match line.split_once('=') {
            Some((key, value)) => (key.trim(), value.trim()),
            None => continue,
        };
        if key.is_empty() || !key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            continue;
        }
        let quoted = value.len() >= 2
            && ((value.starts_with('"') && value.ends_with('"'))
                || (value.starts_with('\'') && value.ends_with('\'')));
        let value = if quoted {
            value[1..value.len() - 1].to_string()
        } else {
            value.split(" #").next().unwrap_or("").trim().to_string()
        };
        pairs.push((key.to_string(), value));
    }
    pairs
}

#[cfg(test)]
mod tests {
    use super::parse_dotenv;

    #[test]
    fn dotenv_lines() {
        let text =
            "# comment\nexport A=1\nB = \"two words\"\nC='x # y'\nD=3 # note\nbad line\n=5\n";
        let pairs = parse_dotenv(text);
        let expected = [("A", "1"), ("B", "two words"), ("C", "x # y"), ("D", "3")];
        assert_eq!(pairs.len(), expected.len());
        for ((key, value), (k, v)) in pairs.iter().zip(expected.iter()) {
            assert_eq!((key.as_str(), value.as_str()), (*k, *v));
        }
    }
}
