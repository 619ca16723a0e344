//! WGSL generation. Each kernel is a function of its specialisation (shapes, dtypes, how a KV
//! buffer is split into chunks) that returns a [`Kernel`]: the source with every such constant
//! baked in, and its binding list. The dispatcher caches pipelines by source, so a
//! specialisation compiles once per backend.
//!
//! Conventions of every generated kernel: bindings are storage buffers `@group(0)
//! @binding(i)` in the order of [`Kernel::bindings`], each bound whole; the entry point is
//! `main`; small per-call values (row counts, scales as f32 bits) come in a `params:
//! array<u32>` binding; grids of more than 65,535 workgroups fold into `y` (see [`grid`]).

pub mod attention;
pub mod dense;
pub mod store;

use std::fmt::Write as _;

/// How a kernel uses a binding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// `var<storage, read>`.
    Read,
    /// `var<storage, read_write>`.
    ReadWrite,
}

/// One storage binding of a kernel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Binding {
    /// The WGSL variable name.
    pub name: String,
    /// Read or read-write.
    pub access: Access,
}

/// A generated kernel: its WGSL (the pipeline cache key) and bindings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Kernel {
    /// Short name for labels and errors.
    pub name: &'static str,
    /// The complete WGSL source.
    pub source: String,
    /// What each `@binding(i)` is, in order: the bind group layout is built from it, and a
    /// dispatch passes its buffers in the same order.
    pub bindings: Vec<Binding>,
}

/// Threads per workgroup of the one-dimensional (element-wise) kernels.
pub const WG_1D: u32 = 256;

/// Workgroups for `threads` threads of a one-dimensional kernel with [`WG_1D`] threads per
/// workgroup, folded into `y` beyond 65,535 (the kernels compute the linear index from
/// `num_workgroups`).
pub fn grid(threads: u64) -> [u32; 3] {
    let groups = threads.div_ceil(WG_1D as u64);
    if groups <= 65_535 {
        [groups as u32, 1, 1]
    } else {
        [65_535, groups.div_ceil(65_535) as u32, 1]
    }
}

/// The linear thread index of a one-dimensional kernel (needs `gid` and `nwg` builtins).
pub(crate) const LINEAR_INDEX: &str = "gid.x + gid.y * nwg.x * 256u";

/// The entry point signature of a one-dimensional kernel.
pub(crate) const MAIN_1D: &str = "@compute @workgroup_size(256)\n\
     fn main(@builtin(global_invocation_id) gid: vec3<u32>, \
     @builtin(num_workgroups) nwg: vec3<u32>) {\n";

/// A WGSL source under construction.
pub(crate) struct Wgsl {
    name: &'static str,
    header: String,
    f16: bool,
    decls: String,
    body: String,
    bindings: Vec<Binding>,
}

impl Wgsl {
    /// A kernel named `name`; `what` (its specialisation) goes into the header comment.
    pub(crate) fn new(name: &'static str, what: &str) -> Self {
        Wgsl {
            name,
            header: format!("// kvserve {name}: {what}\n"),
            f16: false,
            decls: String::new(),
            body: String::new(),
            bindings: Vec::new(),
        }
    }

    /// Declares `name: array<ty>` as the next binding.
    pub(crate) fn buffer(&mut self, name: &str, ty: &str, access: Access) {
        if ty == "f16" {
            self.f16 = true;
        }
        let mode = match access {
            Access::Read => "read",
            Access::ReadWrite => "read_write",
        };
        let _ = writeln!(
            self.decls,
            "@group(0) @binding({}) var<storage, {mode}> {name}: array<{ty}>;",
            self.bindings.len()
        );
        self.bindings.push(Binding {
            name: name.to_string(),
            access,
        });
    }

    /// Declares `const name: u32 = value;`.
    pub(crate) fn const_u32(&mut self, name: &str, value: u32) {
        let _ = writeln!(self.body, "const {name}: u32 = {value}u;");
    }

    /// Appends WGSL to the kernel's body, after the constants declared so far.
    pub(crate) fn push(&mut self, code: &str) {
        self.body.push_str(code);
    }

    /// The kernel: `enable f16;` when needed, the header (bindings), then the body.
    pub(crate) fn finish(self) -> Kernel {
        let mut source = self.header;
        if self.f16 {
            source.push_str("enable f16;\n");
        }
        source.push('\n');
        source.push_str(&self.decls);
        source.push('\n');
        source.push_str(&self.body);
        Kernel {
            name: self.name,
            source,
            bindings: self.bindings,
        }
    }
}

/// Element type of a KV store buffer on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StoreElem {
    /// `f32`.
    F32,
    /// `f16` (needs the adapter's SHADER_F16 for typed access; raw access uses `u32` words).
    F16,
}

impl StoreElem {
    /// Bytes per element in the store (raw access moves `u32` words of two f16s).
    pub fn bytes(self) -> u32 {
        match self {
            StoreElem::F32 => 4,
            StoreElem::F16 => 2,
        }
    }
    fn wgsl(self) -> &'static str {
        match self {
            StoreElem::F32 => "f32",
            StoreElem::F16 => "f16",
        }
    }
}

/// How one per-layer KV buffer (K, V or labels of one layer) sits on the device: rows of
/// `row_elems` elements, `rows_per_chunk` rows per wgpu buffer, `chunks` buffers. Kernels
/// address a row across chunks with a generated `switch`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct StoreView {
    /// How the rows' elements are stored (the store's dtype on the device).
    pub elem: StoreElem,
    /// Elements per row (slot).
    pub row_elems: u32,
    /// Rows in each chunk but the last.
    pub rows_per_chunk: u32,
    /// Number of chunk buffers (`≥ 1`).
    pub chunks: u32,
}

/// How a kernel touches a store buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StoreAccess {
    /// `NAME_load(row, e) -> f32` over typed chunks.
    Load,
    /// `NAME_store(row, e, x: f32)`, converting to the element type.
    Store,
    /// `NAME_get(row, e) -> u32`: the element's bits (16 for f16) over `u32` words.
    GetBits,
    /// `NAME_set(row, e, bits)`: writes the element's bits (atomics for f16, whose two
    /// elements share a word).
    SetBits,
}

/// Declares the chunk bindings `NAME0..` of `view` and the accessor function for `access`.
pub(crate) fn store_accessor(w: &mut Wgsl, name: &str, view: StoreView, access: StoreAccess) {
    let ty = match (access, view.elem) {
        (StoreAccess::Load | StoreAccess::Store, e) => e.wgsl(),
        (StoreAccess::GetBits, _) | (StoreAccess::SetBits, StoreElem::F32) => "u32",
        (StoreAccess::SetBits, StoreElem::F16) => "atomic<u32>",
    };
    let mode = match access {
        StoreAccess::Load | StoreAccess::GetBits => Access::Read,
        StoreAccess::Store | StoreAccess::SetBits => Access::ReadWrite,
    };
    for c in 0..view.chunks {
        w.buffer(&format!("{name}{c}"), ty, mode);
    }
    let (sig, ret, decl) = match access {
        StoreAccess::Load => ("row: u32, e: u32) -> f32", "return r;", "var r: f32;"),
        StoreAccess::Store => ("row: u32, e: u32, x: f32)", "", ""),
        StoreAccess::GetBits => ("row: u32, e: u32) -> u32", "return r;", "var r: u32;"),
        StoreAccess::SetBits => ("row: u32, e: u32, bits: u32)", "", ""),
    };
    let fname = match access {
        StoreAccess::Load => "load",
        StoreAccess::Store => "store",
        StoreAccess::GetBits => "get",
        StoreAccess::SetBits => "set",
    };
    let op = |buf: &str| -> String {
        match (access, view.elem) {
            (StoreAccess::Load, _) => format!("r = f32({buf}[i]);"),
            (StoreAccess::Store, e) => format!("{buf}[i] = {}(x);", e.wgsl()),
            (StoreAccess::GetBits, StoreElem::F32) => format!("r = {buf}[i];"),
            (StoreAccess::GetBits, StoreElem::F16) => {
                format!("r = ({buf}[i >> 1u] >> ((i & 1u) * 16u)) & 0xffffu;")
            }
            (StoreAccess::SetBits, StoreElem::F32) => format!("{buf}[i] = bits;"),
            (StoreAccess::SetBits, StoreElem::F16) => format!(
                "let sh = (i & 1u) * 16u; atomicAnd(&{buf}[i >> 1u], ~(0xffffu << sh)); \
                 atomicOr(&{buf}[i >> 1u], (bits & 0xffffu) << sh);"
            ),
        }
    };
    let mut f = format!("fn {name}_{fname}({sig} {{\n");
    if !decl.is_empty() {
        let _ = writeln!(f, "    {decl}");
    }
    if view.chunks == 1 {
        let _ = writeln!(f, "    let i = row * {}u + e;", view.row_elems);
        let _ = writeln!(f, "    {}", op(&format!("{name}0")));
    } else {
        let _ = writeln!(f, "    let c = row / {}u;", view.rows_per_chunk);
        let _ = writeln!(
            f,
            "    let i = (row - c * {}u) * {}u + e;",
            view.rows_per_chunk, view.row_elems
        );
        f.push_str("    switch c {\n");
        for c in 0..view.chunks {
            let label = if c + 1 == view.chunks {
                "default".to_string()
            } else {
                format!("case {c}u")
            };
            let _ = writeln!(f, "        {label}: {{ {} }}", op(&format!("{name}{c}")));
        }
        f.push_str("    }\n");
    }
    if !ret.is_empty() {
        let _ = writeln!(f, "    {ret}");
    }
    f.push_str("}\n\n");
    w.push(&f);
}
