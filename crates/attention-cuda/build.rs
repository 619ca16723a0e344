//! With feature `rocm`: links `libhiprtc` where the HIP install has one (ROCm 6 and later moved
//! hipRTC out of `libamdhip64`, which hip-sys links). Nothing otherwise.

fn main() {
    println!("cargo:rerun-if-env-changed=HIP_PATH");
    if std::env::var_os("CARGO_FEATURE_ROCM").is_none() {
        return;
    }
    let Some(root) = std::env::var_os("HIP_PATH") else {
        return;
    };
    let root = std::path::PathBuf::from(root);
    for lib in ["lib", "lib64"] {
        let dir = root.join(lib);
        if dir.join("libhiprtc.so").exists() {
            println!("cargo:rustc-link-search=native={}", dir.display());
            println!("cargo:rustc-link-lib=dylib=hiprtc");
            return;
        }
    }
}
