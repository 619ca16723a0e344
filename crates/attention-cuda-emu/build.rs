//! Compiles attention-cuda's kernel sources for the CPU: one C++ translation unit per
//! specialisation (its #defines, common.cuh and the source inside a namespace of its own, over
//! emu/emu.h), the fiber runtime, and a dispatcher `kvs_emu_launch(spec, kernel, …)`. Without a
//! C++20 compiler it compiles nothing and sets `kvs_emu_missing`, and the crate's device
//! reports why.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

#[allow(dead_code)]
mod specs {
    include!("../attention-cuda/src/specs.rs");
}

fn main() {
    println!("cargo:rustc-check-cfg=cfg(kvs_emu_missing)");
    println!(
        "cargo:rustc-env=KVS_EMU_HEAD_DIMS={}",
        EMULATED_HEAD_DIMS.map(|d| d.to_string()).join(", ")
    );
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    let kernels = manifest.join("../attention-cuda/kernels");
    let emu = manifest.join("emu");
    println!("cargo:rerun-if-changed=../attention-cuda/kernels");
    println!("cargo:rerun-if-changed=../attention-cuda/src/specs.rs");
    println!("cargo:rerun-if-changed=emu");
    println!("cargo:rerun-if-env-changed=CXX");
    println!("cargo:rerun-if-env-changed=RUSTC_WORKSPACE_WRAPPER");

    // Under clippy (`cargo clippy` runs its driver as the workspace wrapper) nothing is linked,
    // so the kernels are not compiled: the crate is checked against the same declarations, and
    // CI's clippy pass does not spend minutes of a core on C++ the test build compiles again
    // (a later build without the wrapper runs this script again: the variable is declared
    // above).
    let clippy = std::env::var("RUSTC_WORKSPACE_WRAPPER").is_ok_and(|w| {
        Path::new(&w)
            .file_stem()
            .is_some_and(|s| s == "clippy-driver")
    });
    if clippy {
        return;
    }

    let cxx = std::env::var("CXX").unwrap_or_else(|_| "g++".into());
    let found = Command::new(&cxx)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !found {
        println!("cargo:rustc-cfg=kvs_emu_missing");
        println!(
            "cargo:rustc-env=KVS_EMU_MISSING=no C++ compiler ({cxx}) was found when \
             attention-cuda-emu was built (apt-get install g++)"
        );
        return;
    }

    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap());
    let mut build = cc::Build::new();
    build
        .cpp(true)
        .compiler(&cxx)
        .std("c++20")
        // -O1: a third less compile time than -O2, and the emulated suites run as fast.
        .opt_level(1)
        .include(&emu)
        .warnings(false)
        .file(emu.join("runtime.cpp"));
    let mut dispatch = String::from("#include <string.h>\n");
    let mut table = String::new();
    for spec in specs::all_specs().into_iter().filter(emulated) {
        let name = spec.name();
        let file = out.join(format!("{name}.cpp"));
        std::fs::write(&file, unit(&spec, &kernels)).unwrap();
        build.file(&file);
        writeln!(
            dispatch,
            "int kvs_emu_launch_{name}(const char*, const unsigned int*, unsigned int, void**, \
             unsigned int);"
        )
        .unwrap();
        writeln!(
            table,
            "    if (strcmp(spec, \"{name}\") == 0) return kvs_emu_launch_{name}(kernel, grid, \
             block, params, nparams);"
        )
        .unwrap();
    }
    write!(
        dispatch,
        "extern \"C\" int kvs_emu_launch(const char* spec, const char* kernel, const unsigned \
         int* grid, unsigned int block, void** params, unsigned int nparams) {{\n{table}    \
         return -2;\n}}\n"
    )
    .unwrap();
    // The emulator's own test kernels, as one more specialisation named "selftest".
    let selftest = format!(
        "#include \"emu.h\"\n#define KVS_EMU_SHARED_SECTION \"kvs_sh_selftest\"\n\
         KVS_EMU_SHARED_UNIT(selftest)\nnamespace kvs_selftest {{\n#include \"{}\"\n#include \"{}\"\n}}\n\
         #include <string.h>\nextern \"C\" int kvs_emu_selftest(const char* \
         kernel, const unsigned int* grid, unsigned int block, void** params, unsigned int \
         nparams) {{\n    static pthread_mutex_t m = PTHREAD_MUTEX_INITIALIZER;\n    kvs_emu::LaunchLock lock(&m);\n{}    \
         return -1;\n}}\n",
        kernels.join("common.cuh").display(),
        emu.join("selftest.cu").display(),
        [
            "shfl_xor_table",
            "block_reduce",
            "decode_tables",
            "syncthreads_or",
            "store_at",
            "shared_before_write",
            "mismatched_barriers"
        ]
        .iter()
        .map(|k| format!(
            "    if (strcmp(kernel, \"{k}\") == 0) return kvs_emu::launch(&kvs_selftest::{k}, \
                 grid, block, params, nparams, &kvs_emu_poison_shared);\n"
        ))
        .collect::<String>()
    );
    let selftest_file = out.join("kvs_emu_selftest.cpp");
    std::fs::write(&selftest_file, selftest).unwrap();
    build.file(&selftest_file);
    let dispatch_file = out.join("kvs_emu_dispatch.cpp");
    std::fs::write(&dispatch_file, dispatch).unwrap();
    build.file(&dispatch_file);
    build.compile("kvs_emu_kernels");
}

/// The MHA/GQA head dims whose attention specialisations are compiled for the CPU: those the
/// shared conformance suite and the tiny decoders use. The others (96, 256) are compiled by
/// NVRTC and hipRTC in CI like every specialisation, but no emulated test launches them, and
/// leaving them out takes 60 of the ~157 C++ units (over a minute of CI's build) away.
const EMULATED_HEAD_DIMS: [u32; 2] = [64, 128];

/// Whether `spec` is compiled for the emulation: every store and dense specialisation, every
/// MLA one, and attention at [`EMULATED_HEAD_DIMS`].
fn emulated(spec: &specs::Spec) -> bool {
    let define = |key| {
        spec.defines
            .iter()
            .find(|(k, _)| *k == key)
            .map(|&(_, v)| v)
    };
    define("MLA") == Some(1) || define("HEAD_DIM").is_none_or(|d| EMULATED_HEAD_DIMS.contains(&d))
}

/// The translation unit of one specialisation.
fn unit(spec: &specs::Spec, kernels: &Path) -> String {
    let name = spec.name();
    let mut s = String::from("#include \"emu.h\"\n");
    // The unit's __shared__ arrays in a section of its own, filled before every block.
    writeln!(s, "#define KVS_EMU_SHARED_SECTION \"kvs_sh_{name}\"").unwrap();
    writeln!(s, "KVS_EMU_SHARED_UNIT({name})").unwrap();
    writeln!(s, "namespace kvs_spec_{name} {{").unwrap();
    s.push_str(&spec.prelude());
    writeln!(s, "#include \"{}\"", kernels.join("common.cuh").display()).unwrap();
    writeln!(
        s,
        "#include \"{}\"",
        kernels.join(spec.source.file()).display()
    )
    .unwrap();
    writeln!(s, "}}  // namespace kvs_spec_{name}").unwrap();
    writeln!(
        s,
        "int kvs_emu_launch_{name}(const char* kernel, const unsigned int* grid, unsigned int \
         block, void** params, unsigned int nparams) {{\n    // The specialisation's __shared__ \
         arrays are static: one launch at a time.\n    static pthread_mutex_t m = \
         PTHREAD_MUTEX_INITIALIZER;\n    kvs_emu::LaunchLock lock(&m);"
    )
    .unwrap();
    for kernel in spec.kernels() {
        writeln!(
            s,
            "    if (strcmp(kernel, \"{kernel}\") == 0) return kvs_emu::launch(\
             &kvs_spec_{name}::{kernel}, grid, block, params, nparams, &kvs_emu_poison_shared);"
        )
        .unwrap();
    }
    s.push_str("    return -1;\n}\n");
    s
}
