//! Bindings of `hashing`, `cbor` and `payload`: `BlockHasher`, `cbor_encode`, and the XXH3-64
//! of store values given as parts (`xxh3_64_parts`, `xxh3_64_batch`).

use super::convert::{
    extract_extra_keys, extract_tokens, hashes_to_py, payload_parts, positive, to_value,
    value_error, values_parts, TokenBuf,
};
use crate::hashing::{self, HashAlgo, TokenSlice};
use crate::{cbor, regions};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

#[pyfunction]
pub(super) fn cbor_encode<'py>(py: Python<'py>, value: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyBytes>> {
    let value = to_value(value, 0)?;
    Ok(PyBytes::new(py, &cbor::encode(&value)))
}

// ---- hashing ------------------------------------------------------------------------------

#[pyclass(module = "kvstride._core", frozen)]
pub(super) struct BlockHasher {
    inner: hashing::BlockHasher,
}

#[pymethods]
impl BlockHasher {
    #[new]
    #[pyo3(signature = (algo = "sha256_cbor", seed = None))]
    fn new(algo: &str, seed: Option<&str>) -> PyResult<Self> {
        let algo = HashAlgo::parse(algo).map_err(value_error)?;
        let inner = hashing::BlockHasher::new(algo, seed).map_err(value_error)?;
        Ok(BlockHasher { inner })
    }

    #[getter]
    fn algo(&self) -> &'static str {
        self.inner.algo().name()
    }

    #[getter]
    fn none_hash<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, self.inner.none_hash())
    }

    #[getter]
    fn digest_size(&self) -> usize {
        self.inner.algo().digest_size()
    }

    #[pyo3(signature = (token_ids, block_size, *, parent = None, extra_keys = None))]
    fn hash_blocks<'py>(
        &self,
        py: Python<'py>,
        token_ids: &Bound<'py, PyAny>,
        block_size: i64,
        parent: Option<&Bound<'py, PyBytes>>,
        extra_keys: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyList>> {
        let block_size = positive("block_size", block_size)? as usize;
        let tokens = extract_tokens(token_ids)?;
        let extra = extra_keys.map(extract_extra_keys).transpose()?;
        let parent = parent.map(|p| p.as_bytes());
        if let Some(p) = parent {
            if p.len() > 32 {
                return Err(PyValueError::new_err(format!(
                    "parent is {} bytes; a block hash is at most 32",
                    p.len()
                )));
            }
        }
        let hasher = &self.inner;
        let ids = tokens.slice();
        let hashes = py
            .detach(|| hasher.hash_token_slice(ids, block_size, parent, extra.as_deref()))
            .map_err(value_error)?;
        Ok(hashes_to_py(py, &hashes))
    }

    #[pyo3(signature = (requests, block_size, *, parents = None))]
    fn hash_blocks_batch<'py>(
        &self,
        py: Python<'py>,
        requests: &Bound<'py, PyAny>,
        block_size: i64,
        parents: Option<Vec<Option<Vec<u8>>>>,
    ) -> PyResult<Bound<'py, PyList>> {
        let block_size = positive("block_size", block_size)? as usize;
        let buffers: Vec<TokenBuf> = requests
            .try_iter()?
            .map(|r| extract_tokens(&r?))
            .collect::<PyResult<_>>()?;
        let parents = parents.unwrap_or_default();
        if parents.iter().flatten().any(|p| p.len() > 32) {
            return Err(PyValueError::new_err("a parent hash is at most 32 bytes"));
        }
        let hasher = &self.inner;
        let slices: Vec<TokenSlice<'_>> = buffers.iter().map(TokenBuf::slice).collect();
        let all = py
            .detach(|| {
                let parents: Vec<Option<&[u8]>> = parents.iter().map(|p| p.as_deref()).collect();
                hasher.hash_blocks_batch(&slices, block_size, &parents)
            })
            .map_err(value_error)?;
        PyList::new(py, all.iter().map(|h| hashes_to_py(py, h)))
    }

    fn __repr__(&self) -> String {
        format!("BlockHasher(algo={:?})", self.inner.algo().name())
    }
}

// ---- store payload hashing (kvstride.stores verified reads) -------------------------------

/// `xxh3_64_parts(parts) -> int`: the XXH3-64 of one value given as parts (numpy arrays or
/// buffers), equal to `xxhash.xxh3_64_intdigest(b"".join(parts))`; hashed with the GIL released.
#[pyfunction]
pub(super) fn xxh3_64_parts(py: Python<'_>, parts: &Bound<'_, PyAny>) -> PyResult<u64> {
    let mut keep = Vec::new();
    let parts = payload_parts(parts, &mut keep)?;
    // SAFETY: every part is the data of a C-contiguous array held in `keep` for the call.
    let digest = py.detach(|| unsafe { regions::value_digest(&parts, None) });
    drop(keep);
    Ok(digest)
}

/// `xxh3_64_batch(values) -> list[int]`: `xxh3_64_parts` of each value, with the GIL released
/// and the values spread over rayon's threads once the batch holds 1 MiB or more.
#[pyfunction]
pub(super) fn xxh3_64_batch(py: Python<'_>, values: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    let mut keep = Vec::new();
    let values = values_parts(values, &mut keep)?;
    // SAFETY: as `xxh3_64_parts`.
    let digests = py.detach(|| unsafe { regions::value_digests(&values, None) });
    drop(keep);
    Ok(digests)
}
