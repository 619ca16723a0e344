//! ptxas's verbose report (`--ptxas-options=-v`) read into each kernel's resources: what
//! `nvrtc::assemble` (features `cuda-12`, `cuda-13`) returns for a specialisation assembled to
//! a real architecture's machine code, so tests check registers, spills and static shared
//! memory without a GPU. Plain text parsing, built without the CUDA features so its tests
//! always run.

/// ptxas's report on one kernel (entry point) assembled for a real architecture.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelResources {
    /// The entry point's name.
    pub kernel: String,
    /// Registers per thread.
    pub registers: u32,
    /// Bytes per thread spilled to local memory (stores; the loads mirror them).
    pub spill_store_bytes: u32,
    /// Static shared memory per block, in bytes.
    pub shared_bytes: u32,
}

/// Static shared memory a kernel may declare (48 KiB; more only as dynamic shared memory).
pub const STATIC_SHARED_LIMIT: u32 = 48 * 1024;

/// The kernels of ptxas's verbose report (`--ptxas-options=-v`), in its order: for each
/// `Compiling entry function 'NAME'`, the spill line of `Function properties for NAME` and the
/// `Used N registers, …, S bytes smem` line that follow. `Err` when an entry lacks either.
pub fn parse_ptxas_report(log: &str) -> Result<Vec<KernelResources>, String> {
    parse_report(log, true)
}

/// [`parse_ptxas_report`]; with `complete` false an entry's resources are kept as far as they
/// were reported (a failed assembly's report ends early) instead of refused.
pub(crate) fn parse_report(log: &str, complete: bool) -> Result<Vec<KernelResources>, String> {
    // The number just before `unit` in a comma-separated list (`"0 bytes spill stores"`,
    // `"Used 225 registers"`).
    fn count(line: &str, unit: &str) -> Option<u32> {
        line.split([',', ':']).find_map(|part| {
            let before = part.trim().strip_suffix(unit)?;
            before.split_whitespace().last()?.parse().ok()
        })
    }
    let mut kernels: Vec<KernelResources> = Vec::new();
    let mut open: Option<(KernelResources, bool, bool)> = None; // (kernel, spills, registers)
    let mut properties_of = String::new();
    let close = |open: Option<(KernelResources, bool, bool)>, kernels: &mut Vec<_>| match open {
        Some((k, spills, registers)) if (spills && registers) || !complete => {
            kernels.push(k);
            Ok(())
        }
        Some((k, _, _)) => Err(format!("ptxas's report on {} is incomplete", k.kernel)),
        None => Ok(()),
    };
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            close(open.take(), &mut kernels)?;
            let name = rest.split('\'').next().unwrap_or_default().to_string();
            open = Some((
                KernelResources {
                    kernel: name,
                    registers: 0,
                    spill_store_bytes: 0,
                    shared_bytes: 0,
                },
                false,
                false,
            ));
        } else if let Some(name) = line.split("Function properties for ").nth(1) {
            properties_of = name.trim().to_string();
        } else if let Some((k, spills, registers)) = open.as_mut() {
            if let Some(bytes) = count(line, "bytes spill stores") {
                if properties_of == k.kernel {
                    k.spill_store_bytes = bytes;
                    *spills = true;
                }
            } else if let Some(n) = count(line, "registers") {
                k.registers = n;
                k.shared_bytes = count(line, "bytes smem").unwrap_or(0);
                *registers = true;
            }
        }
    }
    close(open, &mut kernels)?;
    Ok(kernels)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// ptxas's report as NVRTC 13 logs it for an MLA specialisation (sm_90), trimmed.
    const REPORT: &str = "\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'merge_states' for 'sm_90'
ptxas info    : Function properties for merge_states
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 32 registers, used 0 barriers
ptxas info    : Compile time = 41.469 ms
ptxas info    : Compiling entry function 'paged_attention_pipelined' for 'sm_90'
ptxas info    : Function properties for paged_attention_pipelined
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 225 registers, used 1 barriers, 40964 bytes smem
ptxas info    : Compile time = 318.694 ms
ptxas info    : Compiling entry function 'paged_attention' for 'sm_90'
ptxas info    : Function properties for paged_attention
ptxas         .     288 bytes stack frame, 576 bytes spill stores, 572 bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers, 288 bytes cumulative stack size, 16004 bytes smem
ptxas info    : Compile time = 457.055 ms
";

    #[test]
    fn ptxas_reports_parse_into_each_kernels_resources() {
        let k = parse_ptxas_report(REPORT).unwrap();
        let rows: Vec<_> = k
            .iter()
            .map(|k| {
                (
                    k.kernel.as_str(),
                    k.registers,
                    k.spill_store_bytes,
                    k.shared_bytes,
                )
            })
            .collect();
        assert_eq!(
            rows,
            [
                ("merge_states", 32, 0, 0),
                ("paged_attention_pipelined", 225, 0, 40964),
                ("paged_attention", 168, 576, 16004),
            ]
        );
        assert_eq!(parse_ptxas_report("").unwrap(), vec![]);
        // An entry whose register line is missing is refused, not reported as zeros.
        let cut = &REPORT[..REPORT.find("Used 168").unwrap()];
        assert!(parse_ptxas_report(cut)
            .unwrap_err()
            .contains("paged_attention"));
        // A device function's properties between an entry's lines are not the entry's.
        let with_callee = REPORT.replace(
            "ptxas info    : Function properties for paged_attention\n",
            "ptxas info    : Function properties for callee\n\
             ptxas         .     0 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads\n\
             ptxas info    : Function properties for paged_attention\n",
        );
        assert_eq!(parse_ptxas_report(&with_callee).unwrap(), k);
        // A failed assembly's report keeps what it gave.
        let partial = parse_report(cut, false).unwrap();
        assert_eq!(partial.len(), 3);
        assert_eq!(
            (partial[2].registers, partial[2].spill_store_bytes),
            (0, 576)
        );
    }
}
