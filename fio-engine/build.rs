//! Generates the bindings to fio's ioengine interface from the headers of the fio the engine will be loaded
//! into, at build time (fio is GPL-2.0: its code is never in this repository).
//!
//! The source is found at `FIO_DIR` (a fio checkout, configured), or else where scripts/fio-source.sh puts the
//! installed fio's Debian source package: `${NVPOLL_FIO_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/nvpoll-fio}/
//! fio-VERSION`, VERSION from `fio --version`. Without it the crate builds without the engine (cfg
//! `fio_headers` unset) and says so in a warning.

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo::rustc-check-cfg=cfg(fio_headers)");
    for v in [
        "FIO_DIR",
        "NVPOLL_FIO_CACHE",
        "XDG_CACHE_HOME",
        "HOME",
        "PATH",
        "LIBCLANG_PATH",
        "LLVM_CONFIG_PATH",
    ] {
        println!("cargo:rerun-if-env-changed={v}");
    }
    let dir = match find_source() {
        Ok(d) => d,
        Err((looked, why)) => {
            // Looked for again on the next build once it appears (a missing path makes cargo rerun this).
            // Where fio itself is missing there is no version to name the folder by: watch the cache folder
            // that scripts/fio-source.sh fills (installing fio changes no file this script could watch).
            match (looked, cache_root()) {
                (Some(d), _) => println!(
                    "cargo:rerun-if-changed={}",
                    d.join("config-host.h").display()
                ),
                (None, Some(root)) => println!("cargo:rerun-if-changed={}", root.display()),
                (None, None) => {}
            }
            println!(
                "cargo:warning=nvpoll-fio: the fio ioengine is not built: {why}. \
                 Run scripts/fio-source.sh (it fetches the installed fio's source), or set FIO_DIR \
                 to a configured fio checkout."
            );
            return;
        }
    };
    for f in [
        "config-host.h",
        "fio.h",
        "ioengines.h",
        "io_u.h",
        "file.h",
        "thread_options.h",
    ] {
        println!("cargo:rerun-if-changed={}", dir.join(f).display());
    }
    let version = fio_version(&dir);
    // bindgen panics when it cannot load libclang: ask first, and build without the engine (as without fio's
    // source) rather than fail the whole workspace.
    if let Err(e) = clang_sys::load() {
        skip(&format!(
            "libclang, which generates the bindings to fio's headers in {}, cannot be loaded ({e})",
            dir.display()
        ));
        return;
    }
    let generated = bindgen::Builder::default()
        .header_contents(
            "nvpoll-fio.h",
            "#include \"fio.h\"\n#include \"optgroup.h\"\n",
        )
        .clang_arg(format!("-I{}", dir.display()))
        .clang_arg(format!("-include{}", dir.join("config-host.h").display()))
        .clang_args([
            "-D_GNU_SOURCE",
            "-D_LARGEFILE_SOURCE",
            "-D_FILE_OFFSET_BITS=64",
        ])
        .allowlist_type("thread_data|io_u|fio_file|ioengine_ops|fio_option|fio_q_status")
        .allowlist_type("fio_ddir|fio_ioengine_flags|fio_opt_type|opt_category|opt_category_group")
        .allowlist_var("FIO_IOOPS_VERSION")
        .allowlist_function("log_err|log_info")
        .rustified_enum("fio_ddir|fio_q_status")
        // A packed structure with an aligned member, which Rust cannot lay out as C does; the engine never
        // looks inside it, so it is an opaque blob of clang's size and alignment.
        .opaque_type("thread_stat")
        .derive_default(true)
        // Compile-time checks that every generated structure has clang's size, alignment and offsets: a
        // header the bindings would get wrong fails the build instead of corrupting fio's memory.
        .layout_tests(true)
        .generate_comments(false)
        .generate();
    let bindings = match generated {
        Ok(b) => b,
        Err(e) => {
            skip(&format!(
                "bindgen failed on fio's headers in {} ({e}; without clang's own headers, stddef.h is \
                 missing)",
                dir.display()
            ));
            return;
        }
    };
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    bindings
        .write_to_file(out.join("fio.rs"))
        .expect("writing the fio bindings");
    println!("cargo:rustc-cfg=fio_headers");
    // fio dlclose()s the engine when its last job ends; the engine's admin-queue thread may still run, so the
    // library stays mapped for the life of the process.
    println!("cargo:rustc-cdylib-link-arg=-Wl,-z,nodelete");
    println!("cargo:rustc-env=NVPOLL_FIO_BUILT_FOR={version}");
    println!("cargo:rustc-env=NVPOLL_FIO_SOURCE={}", dir.display());
}

/// Builds the crate without the engine, saying why and what to install.
fn skip(why: &str) {
    println!(
        "cargo:warning=nvpoll-fio: the fio ioengine is not built: {why}. Install libclang and clang's \
         headers (Debian: apt-get install libclang-dev), or point LIBCLANG_PATH at a directory holding \
         libclang.so."
    );
}

/// The configured fio source to build against, or where it was looked for (if anywhere) and why there is
/// none.
fn find_source() -> Result<PathBuf, (Option<PathBuf>, String)> {
    if let Some(d) = env::var_os("FIO_DIR") {
        let d = PathBuf::from(d);
        return check(&d).map(|()| d.clone()).map_err(|e| (Some(d), e));
    }
    let out = Command::new("fio").arg("--version").output().map_err(|e| {
        (
            None,
            format!("fio is not installed ({e}) and FIO_DIR is not set"),
        )
    })?;
    let text = String::from_utf8_lossy(&out.stdout);
    let ver = text.trim().strip_prefix("fio-").ok_or_else(|| {
        (
            None,
            format!(
                "cannot read the installed fio's version from `{}`",
                text.trim()
            ),
        )
    })?;
    let Some(cache) = cache_root() else {
        return Err((None, "HOME is not set".into()));
    };
    let d = cache.join(format!("fio-{ver}"));
    check(&d).map(|()| d.clone()).map_err(|e| (Some(d), e))
}

/// The folder scripts/fio-source.sh unpacks fio's source into (one `fio-VERSION` folder per version).
fn cache_root() -> Option<PathBuf> {
    match (
        env::var_os("NVPOLL_FIO_CACHE"),
        env::var_os("XDG_CACHE_HOME"),
    ) {
        (Some(c), _) => Some(PathBuf::from(c)),
        (None, Some(x)) => Some(PathBuf::from(x).join("nvpoll-fio")),
        (None, None) => env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/nvpoll-fio")),
    }
}

fn check(d: &Path) -> Result<(), String> {
    if !d.join("ioengines.h").is_file() {
        return Err(format!("no fio source at {}", d.display()));
    }
    if !d.join("config-host.h").is_file() {
        return Err(format!(
            "fio's source at {} is not configured (no config-host.h; run its ./configure)",
            d.display()
        ));
    }
    Ok(())
}

/// fio's version as its source names it (`fio-3.33`): FIO-VERSION-FILE if made, else FIO-VERSION-GEN's default.
fn fio_version(d: &Path) -> String {
    if let Ok(t) = std::fs::read_to_string(d.join("FIO-VERSION-FILE")) {
        if let Some(v) = t.split('=').nth(1) {
            return v.trim().to_string();
        }
    }
    std::fs::read_to_string(d.join("FIO-VERSION-GEN"))
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("DEF_VER=").map(|v| v.trim().to_string()))
        })
        .unwrap_or_else(|| "fio-unknown".into())
}
