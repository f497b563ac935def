//! Bindings of `secret`: `StoreSecret` (the value MAC of a deployment secret).

use super::convert::{value_error, values_parts};
use crate::regions;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

/// `StoreSecret(secret: bytes)`: the value MAC of a deployment secret (the key part
/// is `KeyPlanner(..., secret=)`). `payload_tags(values)`: each value's keyed payload tag (a
/// u64, where `xxh3_64_batch` gives the XXH3-64), GIL released, over rayon's threads for big
/// batches; `header_macs(keys, lengths, tags)`: the 16-byte MAC of each value's header.
#[pyclass(module = "kvstride._core", frozen)]
pub(super) struct StoreSecret {
    pub(super) inner: crate::secret::Secret,
}

#[pymethods]
impl StoreSecret {
    #[new]
    fn new(secret: Vec<u8>) -> PyResult<Self> {
        Ok(StoreSecret {
            inner: crate::secret::Secret::new(&secret).map_err(value_error)?,
        })
    }

    fn payload_tags(&self, py: Python<'_>, values: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
        let mut keep = Vec::new();
        let values = values_parts(values, &mut keep)?;
        let secret = &self.inner;
        // SAFETY: every part is the data of a C-contiguous array held in `keep` for the call.
        let tags = py.detach(|| unsafe { regions::value_digests(&values, Some(secret)) });
        drop(keep);
        Ok(tags)
    }

    fn header_macs<'py>(
        &self,
        py: Python<'py>,
        keys: Vec<String>,
        lengths: Vec<u64>,
        tags: Vec<u64>,
    ) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        let secret = &self.inner;
        let macs = py
            .detach(|| secret.header_macs(&keys, &lengths, &tags))
            .map_err(value_error)?;
        Ok(macs.iter().map(|m| PyBytes::new(py, m)).collect())
    }

    fn __repr__(&self) -> &'static str {
        "StoreSecret(..)"
    }
}
