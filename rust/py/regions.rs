//! Bindings of `regions`: kvstride's own raw-memory copies and digests (`kvstride.arena`,
//! `kvstride.transfer`). The binding borrows the address arrays and checks their shapes; the
//! unsafe work is the core's (`regions`), called with the GIL released.

use super::convert::{region_slice, value_error};
use super::secret::StoreSecret;
use crate::regions;
use numpy::{PyArray1, PyReadonlyArray1};
use pyo3::prelude::*;

/// The rows of a `_save_rows` / `_load_rows` batch, borrowed from its arrays and checked.
fn arena_rows<'a>(
    src: &'a PyReadonlyArray1<'_, u64>,
    dst: &'a PyReadonlyArray1<'_, u64>,
    lengths: &'a PyReadonlyArray1<'_, u64>,
    row_start: &'a PyReadonlyArray1<'_, u64>,
    secret: Option<&'a crate::secret::Secret>,
) -> PyResult<regions::Rows<'a>> {
    let rows = regions::Rows {
        src: region_slice(src)?,
        dst: region_slice(dst)?,
        len: region_slice(lengths)?,
        row_start: region_slice(row_start)?,
        secret,
    };
    rows.check().map_err(value_error)?;
    Ok(rows)
}

/// `_save_rows(src, dst, lengths, row_start) -> numpy uint64`: copy each row's regions and
/// return the XXH3-64 of each row's bytes (its regions in order); GIL released. Unchecked raw
/// memory access: only for kvstride's own copies (`kvstride.arena`, `kvstride.transfer`),
/// which derive every address from tensors and buffers they hold. With `secret` (a
/// `StoreSecret`) each row's digest is its keyed payload tag instead.
#[pyfunction]
#[pyo3(signature = (src, dst, lengths, row_start, secret = None))]
pub(super) fn _save_rows<'py>(
    py: Python<'py>,
    src: PyReadonlyArray1<'py, u64>,
    dst: PyReadonlyArray1<'py, u64>,
    lengths: PyReadonlyArray1<'py, u64>,
    row_start: PyReadonlyArray1<'py, u64>,
    secret: Option<PyRef<'py, StoreSecret>>,
) -> PyResult<Bound<'py, PyArray1<u64>>> {
    let secret = secret.as_ref().map(|s| s.inner.clone());
    let rows = arena_rows(&src, &dst, &lengths, &row_start, secret.as_ref())?;
    // SAFETY: the contract in the docstring: live, non-overlapping regions.
    let digests = py.detach(|| unsafe { regions::save_rows(&rows) });
    Ok(PyArray1::from_vec(py, digests))
}

/// `_load_rows(src, dst, lengths, row_start, expected) -> numpy bool`: XXH3-64 each row's
/// source bytes and copy the row only when it equals `expected`; GIL released. Same contract
/// as `_save_rows` (and `secret` as there).
#[pyfunction]
#[pyo3(signature = (src, dst, lengths, row_start, expected, secret = None))]
pub(super) fn _load_rows<'py>(
    py: Python<'py>,
    src: PyReadonlyArray1<'py, u64>,
    dst: PyReadonlyArray1<'py, u64>,
    lengths: PyReadonlyArray1<'py, u64>,
    row_start: PyReadonlyArray1<'py, u64>,
    expected: PyReadonlyArray1<'py, u64>,
    secret: Option<PyRef<'py, StoreSecret>>,
) -> PyResult<Bound<'py, PyArray1<bool>>> {
    let secret = secret.as_ref().map(|s| s.inner.clone());
    let rows = arena_rows(&src, &dst, &lengths, &row_start, secret.as_ref())?;
    let expected = region_slice(&expected)?;
    rows.check_expected(expected).map_err(value_error)?;
    // SAFETY: as `_save_rows`.
    let ok = py.detach(|| unsafe { regions::load_rows(&rows, expected) });
    Ok(PyArray1::from_vec(py, ok))
}

/// `_copy_regions(src, dst, lengths)`: copy `lengths[i]` bytes from address `src[i]` to
/// `dst[i]` with the GIL released (no torch thread pool: it runs beside vLLM's bound OpenMP
/// threads from any thread). Same contract as `_save_rows`.
#[pyfunction]
pub(super) fn _copy_regions(
    py: Python<'_>,
    src: PyReadonlyArray1<'_, u64>,
    dst: PyReadonlyArray1<'_, u64>,
    lengths: PyReadonlyArray1<'_, u64>,
) -> PyResult<()> {
    let (s, d, l) = (region_slice(&src)?, region_slice(&dst)?, region_slice(&lengths)?);
    regions::check_same_lengths(&[s, d, l]).map_err(value_error)?;
    // SAFETY: as `_save_rows`.
    py.detach(|| unsafe { regions::copy_regions(s, d, l) });
    Ok(())
}

/// `_xxh3_64_regions(addrs, lengths) -> numpy.ndarray[uint64]`: the XXH3-64 of each raw region,
/// with the GIL released. Same contract as `_save_rows`.
#[pyfunction]
pub(super) fn _xxh3_64_regions<'py>(
    py: Python<'py>,
    addrs: PyReadonlyArray1<'py, u64>,
    lengths: PyReadonlyArray1<'py, u64>,
) -> PyResult<Bound<'py, PyArray1<u64>>> {
    let (a, l) = (region_slice(&addrs)?, region_slice(&lengths)?);
    regions::check_same_lengths(&[a, l]).map_err(value_error)?;
    // SAFETY: as `_save_rows`.
    let digests = py.detach(|| unsafe { regions::xxh3_regions(a, l) });
    Ok(PyArray1::from_vec(py, digests))
}
