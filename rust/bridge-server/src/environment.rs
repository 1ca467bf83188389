//! Where the server finds the project's Python environment, before Python starts (its `.env` settings: http-front).

use std::path::PathBuf;

pub use http_front::dotenv::{load_dotenv, repository};

/// The Python the server embeds: `COSYVOICE_VENV`, else `.venv` in the repository holding the executable.
pub struct PythonEnvironment {
    pub venv: PathBuf,
    pub repository: Option<PathBuf>,
}

pub fn find_python() -> Result<PythonEnvironment, String> {
    let repository = repository();
    let venv = match std::env::var_os("COSYVOICE_VENV") {
        Some(venv) => PathBuf::from(venv),
        None => match &repository {
            Some(root) => root.join(".venv"),
            None => {
                return Err("no Python environment: this executable is not inside the project's repository; \
                            set COSYVOICE_VENV to the project's virtual environment"
                    .to_string())
            }
        },
    };
    let venv = venv.canonicalize().unwrap_or(venv);
    if !venv.join("bin").join("python").exists() || !venv.join("pyvenv.cfg").is_file() {
        return Err(format!(
            "no Python environment at {}: create it with scripts/setup.sh, or set COSYVOICE_VENV",
            venv.display()
        ));
    }
    Ok(PythonEnvironment { venv, repository })
}
