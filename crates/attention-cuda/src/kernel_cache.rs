//! [`KernelCache`]: the loaded kernels of a GPU device, shared by `CudarcDevice` and
//! `HipDevice`. A specialisation is compiled (NVRTC / hipRTC) and its module loaded the first
//! time one of its kernels is launched; every kernel of the module is then kept by
//! (specialisation, kernel name), so later launches only look it up.

use std::collections::HashMap;
use std::sync::Mutex;

use attention::{AttentionError, Result};

use crate::specs::Spec;

/// Loaded kernels of type `F` (a driver's function handle) by specialisation and name.
#[derive(Debug)]
pub struct KernelCache<F> {
    functions: Mutex<HashMap<(String, String), F>>,
}

impl<F> Default for KernelCache<F> {
    fn default() -> Self {
        KernelCache {
            functions: Mutex::new(HashMap::new()),
        }
    }
}

impl<F: Clone> KernelCache<F> {
    /// Kernel `kernel` of `spec`. On the first call for `spec`, `load` compiles and loads its
    /// module and returns the functions of `spec.kernels()`, in that order. The lock is
    /// held while loading, so a module is loaded once however many threads launch.
    pub fn get_or_load(
        &self,
        spec: &Spec,
        kernel: &str,
        load: impl FnOnce(&[&'static str]) -> Result<Vec<F>>,
    ) -> Result<F> {
        let key = (spec.name(), kernel.to_string());
        let mut cache = self
            .functions
            .lock()
            .map_err(|_| AttentionError::Device("kernel cache poisoned".into()))?;
        if let Some(f) = cache.get(&key) {
            return Ok(f.clone());
        }
        let names = spec.kernels();
        let loaded = load(&names)?;
        if loaded.len() != names.len() {
            return Err(AttentionError::Device(format!(
                "{}: loaded {} kernels, the source has {}",
                key.0,
                loaded.len(),
                names.len()
            )));
        }
        for (name, f) in names.iter().zip(loaded) {
            cache.insert((key.0.clone(), name.to_string()), f);
        }
        cache
            .get(&key)
            .cloned()
            .ok_or_else(|| AttentionError::Device(format!("{} has no kernel {kernel}", key.0)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels;

    #[test]
    fn a_module_is_loaded_once_and_every_kernel_kept() {
        let cache = KernelCache::default();
        let spec = kernels::dense();
        let mut loads = 0;
        for kernel in ["rms_norm", "matmul", "rms_norm"] {
            let f = cache
                .get_or_load(&spec, kernel, |names| {
                    loads += 1;
                    Ok(names.iter().map(|n| format!("fn {n}")).collect())
                })
                .unwrap();
            assert_eq!(f, format!("fn {kernel}"));
        }
        assert_eq!(loads, 1);
    }

    #[test]
    fn load_failures_and_unknown_kernels_are_typed_errors() {
        let cache = KernelCache::<u32>::default();
        let spec = kernels::dense();
        let fail = cache.get_or_load(&spec, "matmul", |_| {
            Err(AttentionError::Device("compile failed".into()))
        });
        assert!(matches!(fail, Err(AttentionError::Device(m)) if m == "compile failed"));
        let short = cache.get_or_load(&spec, "matmul", |_| Ok(vec![1]));
        assert!(matches!(short, Err(AttentionError::Device(m)) if m.contains("loaded 1 kernels")));
        let all = |names: &[&str]| Ok((0..names.len() as u32).collect());
        let unknown = cache.get_or_load(&spec, "no_such_kernel", all);
        assert!(
            matches!(unknown, Err(AttentionError::Device(m)) if m.ends_with("no kernel no_such_kernel"))
        );
        // The module loaded by that call serves its real kernels without loading again.
        let again = cache.get_or_load(&spec, "matmul", |_| panic!("loaded twice"));
        assert_eq!(again.unwrap(), 0);
    }
}
