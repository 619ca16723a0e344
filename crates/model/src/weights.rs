//! Checkpoint loading: memory-mapped safetensors files (single or sharded with an index), and
//! an in-memory tensor map (the `tiny` preset, tests). Every tensor is converted to f32 on the
//! host, the element type [`Backend::upload`](attention::Backend::upload) takes.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::tensor::Metadata;
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;

use crate::error::{ModelError, Result};

/// A tensor on the host: row-major f32 data and its shape.
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    /// Dimensions, outermost first.
    pub shape: Vec<usize>,
    /// Elements, row-major (`shape.iter().product()` of them).
    pub data: Vec<f32>,
}

/// Where named weights come from.
pub trait TensorSource {
    /// Every tensor name, sorted.
    fn names(&self) -> Vec<String>;
    /// The shape and stored element type (`"BF16"`, `"F32"`, …) of a tensor, if present.
    fn info(&self, name: &str) -> Option<(Vec<usize>, String)>;
    /// Reads a tensor, converted to f32. A missing tensor is [`ModelError::MissingTensor`].
    fn load(&self, name: &str) -> Result<HostTensor>;

    /// Reads a tensor and checks its shape against `expected`
    /// ([`ModelError::TensorShape`] otherwise).
    fn load_shaped(&self, name: &str, expected: &[usize]) -> Result<HostTensor> {
        match self.info(name) {
            None => Err(ModelError::MissingTensor { name: name.into() }),
            Some((shape, _)) if shape != expected => Err(ModelError::TensorShape {
                name: name.into(),
                expected: expected.to_vec(),
                got: shape,
            }),
            Some(_) => self.load(name),
        }
    }

    /// A readable inventory: one line per tensor with its dtype and shape.
    fn inventory(&self) -> String {
        let mut out = String::new();
        for name in self.names() {
            if let Some((shape, dtype)) = self.info(&name) {
                out.push_str(&format!("{name:<48} {dtype:<5} {shape:?}\n"));
            }
        }
        out
    }
}

/// Tensors held in memory, by name (the `tiny` preset and tests).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TensorMap {
    tensors: BTreeMap<String, HostTensor>,
}

impl TensorMap {
    /// An empty map.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds (or replaces) a tensor; its data length must match its shape.
    pub fn insert(&mut self, name: impl Into<String>, tensor: HostTensor) -> Result<()> {
        let name = name.into();
        let n: usize = tensor.shape.iter().product();
        if n != tensor.data.len() {
            return Err(ModelError::TensorShape {
                name,
                expected: tensor.shape.clone(),
                got: vec![tensor.data.len()],
            });
        }
        self.tensors.insert(name, tensor);
        Ok(())
    }

    /// Removes a tensor (tests use this to build broken checkpoints).
    pub fn remove(&mut self, name: &str) -> Option<HostTensor> {
        self.tensors.remove(name)
    }

    /// The tensor called `name`.
    pub fn get(&self, name: &str) -> Option<&HostTensor> {
        self.tensors.get(name)
    }

    /// Iterates over the tensors in name order.
    pub fn iter(&self) -> impl Iterator<Item = (&String, &HostTensor)> {
        self.tensors.iter()
    }
}

impl TensorSource for TensorMap {
    fn names(&self) -> Vec<String> {
        self.tensors.keys().cloned().collect()
    }
    fn info(&self, name: &str) -> Option<(Vec<usize>, String)> {
        self.tensors
            .get(name)
            .map(|t| (t.shape.clone(), "F32".to_string()))
    }
    fn load(&self, name: &str) -> Result<HostTensor> {
        self.tensors
            .get(name)
            .cloned()
            .ok_or_else(|| ModelError::MissingTensor { name: name.into() })
    }
}

/// One memory-mapped safetensors file with its parsed header.
#[derive(Debug)]
struct MappedFile {
    path: PathBuf,
    mmap: Mmap,
    header_len: usize,
    meta: Metadata,
}

impl MappedFile {
    fn open(path: &Path) -> Result<Self> {
        let io = |source| ModelError::Io {
            path: path.display().to_string(),
            source,
        };
        let file = File::open(path).map_err(io)?;
        // SAFETY: mapping a file is only sound while no one modifies or truncates it: the
        // mapping aliases the page cache, so a concurrent writer would change bytes behind
        // `&[u8]` borrows (and truncation would make reads fault). Checkpoint directories are
        // treated as read-only inputs for the lifetime of the loaded model; the loader only
        // reads, and every offset it uses was validated against the mapped length first.
        let mmap = unsafe { Mmap::map(&file) }.map_err(io)?;
        let (header_len, meta) =
            SafeTensors::read_metadata(&mmap).map_err(|e| ModelError::CorruptCheckpoint {
                file: path.display().to_string(),
                reason: format!("{e:?}"),
            })?;
        Ok(MappedFile {
            path: path.to_path_buf(),
            mmap,
            header_len,
            meta,
        })
    }
}

/// A Hugging Face safetensors checkpoint: `model.safetensors`, or shards listed by
/// `model.safetensors.index.json`, all memory-mapped. Headers are validated on open
/// (`read_metadata` checks that offsets cover the file exactly, so truncation is caught then);
/// tensor data is read and converted on [`load`](TensorSource::load).
#[derive(Debug)]
pub struct SafetensorsCheckpoint {
    files: Vec<MappedFile>,
    by_name: HashMap<String, usize>,
}

fn dtype_name(d: Dtype) -> String {
    format!("{d:?}")
}

impl SafetensorsCheckpoint {
    /// Opens the safetensors weights of the model directory `dir`: the index file if present,
    /// else `model.safetensors`.
    pub fn open_dir(dir: &Path) -> Result<Self> {
        let index = dir.join("model.safetensors.index.json");
        if index.exists() {
            Self::open_index(&index)
        } else {
            Self::open_files(&[dir.join("model.safetensors")])
        }
    }

    /// Opens the given files as one checkpoint (a tensor may appear in only one of them).
    pub fn open_files(paths: &[PathBuf]) -> Result<Self> {
        let mut files = Vec::with_capacity(paths.len());
        let mut by_name = HashMap::new();
        for (i, path) in paths.iter().enumerate() {
            let f = MappedFile::open(path)?;
            for name in f.meta.tensors().keys() {
                if by_name.insert(name.clone(), i).is_some() {
                    return Err(ModelError::CorruptCheckpoint {
                        file: path.display().to_string(),
                        reason: format!("tensor `{name}` appears in more than one file"),
                    });
                }
            }
            files.push(f);
        }
        Ok(SafetensorsCheckpoint { files, by_name })
    }

    /// Opens a sharded checkpoint through its `model.safetensors.index.json` (`weight_map`:
    /// tensor name → shard file, relative to the index's directory). Every tensor the index
    /// names must be in the shard it names.
    pub fn open_index(index: &Path) -> Result<Self> {
        let file = index.display().to_string();
        let text = std::fs::read_to_string(index).map_err(|source| ModelError::Io {
            path: file.clone(),
            source,
        })?;
        let v: Value = serde_json::from_str(&text).map_err(|e| ModelError::Json {
            file: file.clone(),
            reason: e.to_string(),
        })?;
        let map = v
            .get("weight_map")
            .and_then(Value::as_object)
            .ok_or_else(|| ModelError::Json {
                file: file.clone(),
                reason: "missing object `weight_map`".into(),
            })?;
        let dir = index.parent().unwrap_or(Path::new("."));
        let mut shards: Vec<String> = Vec::new();
        let mut wanted: Vec<(String, String)> = Vec::new();
        for (name, shard) in map {
            let shard = shard.as_str().ok_or_else(|| ModelError::Json {
                file: file.clone(),
                reason: format!("weight_map[`{name}`] is not a file name"),
            })?;
            if !shards.iter().any(|s| s == shard) {
                shards.push(shard.to_string());
            }
            wanted.push((name.clone(), shard.to_string()));
        }
        shards.sort();
        let paths: Vec<PathBuf> = shards.iter().map(|s| dir.join(s)).collect();
        let ckpt = Self::open_files(&paths)?;
        for (name, shard) in wanted {
            let i = shards.iter().position(|s| *s == shard).unwrap_or(0);
            if ckpt.by_name.get(&name) != Some(&i) {
                return Err(ModelError::CorruptCheckpoint {
                    file: dir.join(&shard).display().to_string(),
                    reason: format!("the index places tensor `{name}` here, but it is not in it"),
                });
            }
        }
        Ok(ckpt)
    }

    /// The files of the checkpoint.
    pub fn files(&self) -> Vec<&Path> {
        self.files.iter().map(|f| f.path.as_path()).collect()
    }
}

fn convert(name: &str, dtype: Dtype, bytes: &[u8]) -> Result<Vec<f32>> {
    let out = match dtype {
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        Dtype::F16 => bytes
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        Dtype::BF16 => bytes
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        other => {
            return Err(ModelError::TensorDtype {
                name: name.into(),
                dtype: dtype_name(other),
            })
        }
    };
    Ok(out)
}

impl TensorSource for SafetensorsCheckpoint {
    fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.by_name.keys().cloned().collect();
        names.sort();
        names
    }

    fn info(&self, name: &str) -> Option<(Vec<usize>, String)> {
        let f = &self.files[*self.by_name.get(name)?];
        let info = f.meta.info(name)?;
        Some((info.shape.clone(), dtype_name(info.dtype)))
    }

    fn load(&self, name: &str) -> Result<HostTensor> {
        let missing = || ModelError::MissingTensor { name: name.into() };
        let f = &self.files[*self.by_name.get(name).ok_or_else(missing)?];
        let info = f.meta.info(name).ok_or_else(missing)?;
        let start = 8 + f.header_len + info.data_offsets.0;
        let end = 8 + f.header_len + info.data_offsets.1;
        let corrupt = |reason: String| ModelError::CorruptCheckpoint {
            file: f.path.display().to_string(),
            reason,
        };
        let bytes = f
            .mmap
            .get(start..end)
            .ok_or_else(|| corrupt(format!("tensor `{name}` lies outside the file")))?;
        let data = convert(name, info.dtype, bytes)?;
        let n: usize = info.shape.iter().product();
        if data.len() != n {
            return Err(corrupt(format!(
                "tensor `{name}` has {} elements for shape {:?}",
                data.len(),
                info.shape
            )));
        }
        Ok(HostTensor {
            shape: info.shape.clone(),
            data,
        })
    }
}
