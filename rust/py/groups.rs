//! Bindings of `groups`: `GroupSpec`, `resolve_block_sizes`, `hashes_per_block`.

use super::convert::{extract_groups, positive, value_error};
use crate::groups::{self, GroupKind, MambaMode};
use pyo3::prelude::*;

#[pyclass(module = "kvstride._core", frozen, eq)]
#[derive(Clone, PartialEq)]
pub(super) struct GroupSpec {
    pub(super) inner: groups::GroupSpec,
}

#[pymethods]
impl GroupSpec {
    #[new]
    #[pyo3(signature = (kind, block_size, *, window = None, mamba_mode = "align",
                        prefix_cacheable = None, num_kv_heads = None))]
    fn new(
        kind: &str,
        block_size: i64,
        window: Option<i64>,
        mamba_mode: &str,
        prefix_cacheable: Option<bool>,
        num_kv_heads: Option<i64>,
    ) -> PyResult<Self> {
        let kind = GroupKind::parse(kind).map_err(value_error)?;
        let block_size = positive("block_size", block_size)?;
        let window = window.map(|w| positive("window", w)).transpose()?;
        let mamba_mode = MambaMode::parse(mamba_mode).map_err(value_error)?;
        let num_kv_heads = num_kv_heads
            .map(|h| positive("num_kv_heads", h))
            .transpose()?;
        let inner = groups::GroupSpec::new(
            kind,
            block_size,
            window,
            mamba_mode,
            prefix_cacheable,
            num_kv_heads,
        )
        .map_err(value_error)?;
        Ok(GroupSpec { inner })
    }

    #[getter]
    fn kind(&self) -> &'static str {
        self.inner.kind.name()
    }
    #[getter]
    fn block_size(&self) -> u64 {
        self.inner.block_size
    }
    #[getter]
    fn window(&self) -> Option<u64> {
        self.inner.window
    }
    #[getter]
    fn mamba_mode(&self) -> &'static str {
        self.inner.mamba_mode.name()
    }
    #[getter]
    fn prefix_cacheable(&self) -> bool {
        self.inner.prefix_cacheable
    }
    #[getter]
    fn num_kv_heads(&self) -> Option<u64> {
        self.inner.num_kv_heads
    }

    fn __repr__(&self) -> String {
        let g = &self.inner;
        let mut out = format!("GroupSpec({:?}, {}", g.kind.name(), g.block_size);
        if let Some(w) = g.window {
            out.push_str(&format!(", window={w}"));
        }
        if g.kind == GroupKind::Mamba {
            out.push_str(&format!(", mamba_mode={:?}", g.mamba_mode.name()));
        }
        if g.prefix_cacheable != g.kind.default_prefix_cacheable() {
            out.push_str(&format!(
                ", prefix_cacheable={}",
                if g.prefix_cacheable { "True" } else { "False" }
            ));
        }
        if let Some(h) = g.num_kv_heads {
            out.push_str(&format!(", num_kv_heads={h}"));
        }
        out.push(')');
        out
    }

    fn __hash__(&self) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        self.inner.hash(&mut hasher);
        hasher.finish()
    }
}

#[pyfunction]
#[pyo3(signature = (groups, *, prefix_match_unit = None, dcp = 1))]
pub(super) fn resolve_block_sizes(
    groups: &Bound<'_, PyAny>,
    prefix_match_unit: Option<i64>,
    dcp: i64,
) -> PyResult<(u64, u64)> {
    let groups = extract_groups(groups)?;
    let unit = prefix_match_unit
        .map(|u| positive("prefix_match_unit", u))
        .transpose()?;
    let dcp = positive("dcp", dcp)?;
    groups::resolve_block_sizes(&groups, unit, dcp).map_err(value_error)
}

#[pyfunction]
#[pyo3(signature = (groups, hash_block_size, *, dcp = 1))]
pub(super) fn hashes_per_block(
    groups: &Bound<'_, PyAny>,
    hash_block_size: i64,
    dcp: i64,
) -> PyResult<Vec<u64>> {
    let groups = extract_groups(groups)?;
    let h = positive("hash_block_size", hash_block_size)?;
    let dcp = positive("dcp", dcp)?;
    groups::hashes_per_block(&groups, h, dcp).map_err(value_error)
}
