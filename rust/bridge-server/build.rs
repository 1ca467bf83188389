//! Link the interpreter `PYO3_PYTHON` names (the project's venv Python) with its library folder as the
//! binary's run path, so the built server starts without LD_LIBRARY_PATH or a wrapper script.
fn main() {
    println!("cargo:rerun-if-env-changed=PYO3_PYTHON");
    if let Some(dir) = &pyo3_build_config::get().lib_dir {
        println!("cargo:rustc-link-arg-bins=-Wl,-rpath,{}", dir);
    }
}
