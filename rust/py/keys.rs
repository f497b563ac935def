//! Bindings of `keys`: `stride_keys`, `Namespace`, `layout_fingerprint`.

use super::convert::{non_negative, optional_non_negative, to_value, type_name, value_error};
use crate::keys;
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PySequence};

#[pyfunction]
#[pyo3(signature = (block_hashes, hashes_per_chunk, start_chunk = 0))]
pub(super) fn stride_keys<'py>(
    py: Python<'py>,
    block_hashes: &Bound<'py, PyAny>,
    hashes_per_chunk: i64,
    start_chunk: i64,
) -> PyResult<Bound<'py, PyList>> {
    let k = non_negative("hashes_per_chunk", hashes_per_chunk)? as usize;
    let start = non_negative("start_chunk", start_chunk)? as usize;
    let seq = block_hashes
        .cast::<PySequence>()
        .map_err(|_| PyTypeError::new_err("block_hashes must be a sequence of bytes"))?;
    for i in 0..seq.len()? {
        let item = seq.get_item(i)?;
        if !item.is_instance_of::<PyBytes>() {
            return Err(PyTypeError::new_err(format!(
                "block_hashes[{i}] is a {}, not bytes",
                type_name(&item)
            )));
        }
    }
    let picked = keys::stride_indices(seq.len()?, k, start);
    let items: PyResult<Vec<Bound<'py, PyAny>>> =
        picked.into_iter().map(|i| seq.get_item(i)).collect();
    PyList::new(py, items?)
}

#[pyclass(module = "kvstride._core", frozen)]
#[derive(Clone)]
pub(super) struct Namespace {
    pub(super) inner: keys::Namespace,
}

#[pymethods]
impl Namespace {
    #[new]
    #[pyo3(signature = (model, *, cache_prefix = None, fingerprint = None, tp_rank = None,
                        pcp_rank = 0, dcp_rank = 0, pp_rank = None))]
    fn new(
        model: String,
        cache_prefix: Option<String>,
        fingerprint: Option<String>,
        tp_rank: Option<i64>,
        pcp_rank: i64,
        dcp_rank: i64,
        pp_rank: Option<i64>,
    ) -> PyResult<Self> {
        let inner = keys::Namespace {
            model,
            cache_prefix,
            fingerprint,
            tp_rank: optional_non_negative("tp_rank", tp_rank)?,
            pcp_rank: non_negative("pcp_rank", pcp_rank)?,
            dcp_rank: non_negative("dcp_rank", dcp_rank)?,
            pp_rank: optional_non_negative("pp_rank", pp_rank)?,
        };
        inner.validate().map_err(value_error)?;
        Ok(Namespace { inner })
    }

    #[pyo3(signature = (tp_rank = None, dcp_rank = None))]
    fn text(&self, tp_rank: Option<i64>, dcp_rank: Option<i64>) -> PyResult<String> {
        let tp = optional_non_negative("tp_rank", tp_rank)?;
        let dcp = optional_non_negative("dcp_rank", dcp_rank)?;
        Ok(self.inner.text_with(
            tp.unwrap_or(self.own_tp_rank()),
            dcp.unwrap_or(self.inner.dcp_rank),
        ))
    }

    fn __str__(&self) -> String {
        self.inner.text(self.own_tp_rank())
    }

    fn __repr__(&self) -> String {
        format!("Namespace({:?})", self.inner.text(self.own_tp_rank()))
    }
}

impl Namespace {
    fn own_tp_rank(&self) -> u64 {
        self.inner.tp_rank.unwrap_or(0)
    }
}

#[pyfunction]
pub(super) fn layout_fingerprint(description: &Bound<'_, PyDict>) -> PyResult<String> {
    Ok(keys::layout_fingerprint(&to_value(
        description.as_any(),
        0,
    )?))
}
