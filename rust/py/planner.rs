//! Bindings of `planner`: `KeyPlanner` and its plans (`SavePlan`, `TailPlan`, `LoadPlan`),
//! `dedup_gets`.

use super::convert::{
    block_tables, block_tables_from, extract_bools, extract_exists, extract_groups, extract_handoffs,
    extract_hashes, extract_hashes_from, group_index, hash_slices, items_len, non_negative,
    optional_non_negative, positive, transfers, type_name, value_error, PyTransfer,
};
use super::groups::GroupSpec;
use super::keys::Namespace;
use crate::keys;
use crate::planner::{self, NamespaceSpec, PlannerConfig};
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyString};

#[pyclass(module = "kvstride._core", frozen, get_all)]
pub(super) struct TailPlan {
    outcome: &'static str,
    boundary: Option<u64>,
    puts: Vec<PyTransfer>,
}

#[pymethods]
impl TailPlan {
    fn __repr__(&self) -> String {
        format!(
            "TailPlan(outcome={:?}, boundary={:?}, puts={} keys)",
            self.outcome,
            self.boundary,
            self.puts.len()
        )
    }
}

#[pyclass(module = "kvstride._core", frozen, get_all)]
pub(super) struct SavePlan {
    end: u64,
    puts: Vec<PyTransfer>,
}

#[pymethods]
impl SavePlan {
    fn __repr__(&self) -> String {
        format!("SavePlan(end={}, puts={} keys)", self.end, self.puts.len())
    }
}

#[pyclass(module = "kvstride._core", frozen, get_all)]
pub(super) struct LoadPlan {
    hit: u64,
    start: u64,
    gets: Vec<PyTransfer>,
    missing: Vec<(usize, u64)>,
}

#[pymethods]
impl LoadPlan {
    fn __repr__(&self) -> String {
        format!(
            "LoadPlan(hit={}, start={}, gets={} keys, missing={:?})",
            self.hit,
            self.start,
            self.gets.len(),
            self.missing
        )
    }
}

#[pyclass(module = "kvstride._core", frozen)]
pub(super) struct KeyPlanner {
    inner: planner::KeyPlanner,
}


#[pymethods]
impl KeyPlanner {
    #[new]
    #[pyo3(signature = (groups, *, hash_block_size, scheduler_block_size, namespace,
                        partial_hits = None, dcp = 1, tp_size = 1, tp_rank = None,
                        pp_rank = None, secret = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        groups: &Bound<'_, PyAny>,
        hash_block_size: i64,
        scheduler_block_size: i64,
        namespace: &Bound<'_, PyAny>,
        partial_hits: Option<bool>,
        dcp: i64,
        tp_size: i64,
        tp_rank: Option<i64>,
        pp_rank: Option<i64>,
        secret: Option<Vec<u8>>,
    ) -> PyResult<Self> {
        let groups = extract_groups(groups)?;
        let tp_rank = optional_non_negative("tp_rank", tp_rank)?;
        let pp_rank = optional_non_negative("pp_rank", pp_rank)?;
        let (namespace, tp_rank) = if let Ok(text) = namespace.cast::<PyString>() {
            if pp_rank.unwrap_or(0) != 0 {
                return Err(PyValueError::new_err(format!(
                    "pp_rank={} with a fixed namespace string: the string carries its own \
                     pp_rank; pass a kvstride.Namespace to key per PP rank",
                    pp_rank.unwrap_or(0)
                )));
            }
            (
                NamespaceSpec::Fixed(text.to_cow()?.into_owned()),
                tp_rank.unwrap_or(0),
            )
        } else if let Ok(ns) = namespace.cast::<Namespace>() {
            let parts = ns
                .get()
                .inner
                .with_ranks(tp_rank, pp_rank)
                .map_err(value_error)?;
            let tp_rank = parts.tp_rank.unwrap_or(0);
            (NamespaceSpec::Parts(parts), tp_rank)
        } else {
            return Err(PyTypeError::new_err(format!(
                "namespace must be a str or a kvstride.Namespace; got {}",
                type_name(namespace)
            )));
        };
        let config = PlannerConfig {
            groups,
            hash_block_size: positive("hash_block_size", hash_block_size)?,
            scheduler_block_size: positive("scheduler_block_size", scheduler_block_size)?,
            namespace,
            partial_hits,
            dcp: positive("dcp", dcp)?,
            tp_size: positive("tp_size", tp_size)?,
            tp_rank,
        };
        let mut inner = planner::KeyPlanner::new(config).map_err(value_error)?;
        if let Some(secret) = secret {
            inner = inner.with_secret(&secret).map_err(value_error)?;
        }
        Ok(KeyPlanner { inner })
    }

    /// True when keys are keyed with a deployment secret (SEMANTICS §3, "Keyed keys").
    #[getter]
    fn keyed(&self) -> bool {
        self.inner.has_secret()
    }

    #[getter]
    fn hashes_per_block(&self) -> Vec<u64> {
        self.inner.hashes_per_block().to_vec()
    }
    #[getter]
    fn hash_block_size(&self) -> u64 {
        self.inner.hash_block_size()
    }
    #[getter]
    fn scheduler_block_size(&self) -> u64 {
        self.inner.scheduler_block_size()
    }
    #[getter]
    fn partial_hits(&self) -> bool {
        self.inner.partial_hits()
    }
    #[getter]
    fn alignment(&self) -> u64 {
        self.inner.alignment()
    }
    #[getter]
    fn groups(&self) -> Vec<GroupSpec> {
        self.inner
            .groups()
            .iter()
            .map(|g| GroupSpec { inner: g.clone() })
            .collect()
    }

    fn replication(&self, group: i64) -> PyResult<u64> {
        Ok(self.inner.replication(group_index(group, self.inner.groups().len())?))
    }

    fn key(&self, group: i64, block_hash: &[u8]) -> PyResult<String> {
        Ok(self.inner.key(group_index(group, self.inner.groups().len())?, block_hash))
    }

    fn key_bytes<'py>(
        &self,
        py: Python<'py>,
        group: i64,
        block_hash: &[u8],
    ) -> PyResult<Bound<'py, PyBytes>> {
        let g = group_index(group, self.inner.groups().len())?;
        Ok(PyBytes::new(py, &keys::key_bytes(g as u32, block_hash)))
    }

    #[pyo3(signature = (block_hashes, block_ids, num_tokens, *, saved_offset = 0, exists = None, boundaries = None))]
    #[allow(clippy::too_many_arguments)]
    fn plan_save(
        &self,
        py: Python<'_>,
        block_hashes: &Bound<'_, PyAny>,
        block_ids: &Bound<'_, PyAny>,
        num_tokens: i64,
        saved_offset: i64,
        exists: Option<&Bound<'_, PyAny>>,
        boundaries: Option<Vec<i64>>,
    ) -> PyResult<SavePlan> {
        let n = non_negative("num_tokens", num_tokens)?;
        let offset = non_negative("saved_offset", saved_offset)?;
        let boundaries = boundaries
            .map(|bs| bs.into_iter().map(|x| non_negative("boundary", x)).collect::<PyResult<Vec<u64>>>())
            .transpose()?;
        // Only what the plan reads is converted: a step costs the same at any context length.
        // (Inputs shorter than the base, or not lists, are converted whole.)
        let base = self.inner.save_base_for(offset, items_len(block_hashes));
        let (first_hash, rows) = self.inner.rows_at(base);
        let hashes = extract_hashes_from(block_hashes, first_hash)?;
        let tables = block_tables_from(block_ids, self.inner.groups().len(), &rows)?;
        let exists = extract_exists(exists)?;
        let slices = hash_slices(&hashes);
        let inner = &self.inner;
        let plan = py
            .detach(|| {
                inner.plan_admitted_save_from(base, &slices, &tables, n, offset, boundaries.as_deref(), &|k| {
                    exists.contains(k)
                })
            })
            .map_err(value_error)?;
        Ok(SavePlan {
            end: plan.end,
            puts: transfers(plan.puts),
        })
    }

    #[pyo3(signature = (block_hashes, block_ids, handoffs, *, saved_offset = 0, exists = None))]
    fn plan_tail(
        &self,
        py: Python<'_>,
        block_hashes: &Bound<'_, PyAny>,
        block_ids: &Bound<'_, PyAny>,
        handoffs: &Bound<'_, PyAny>,
        saved_offset: i64,
        exists: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<TailPlan> {
        let hashes = extract_hashes(block_hashes)?;
        let tables = block_tables(block_ids, self.inner.groups().len())?;
        let handoffs = extract_handoffs(handoffs, self.inner.groups().len())?;
        let offset = non_negative("saved_offset", saved_offset)?;
        let exists = extract_exists(exists)?;
        let slices = hash_slices(&hashes);
        let inner = &self.inner;
        let plan = py
            .detach(|| {
                inner.plan_tail(&slices, &tables, &handoffs, offset, &|k| exists.contains(k))
            })
            .map_err(value_error)?;
        Ok(TailPlan {
            outcome: plan.outcome.name(),
            boundary: plan.boundary,
            puts: transfers(plan.puts),
        })
    }

    fn lookup_keys<'py>(
        &self,
        py: Python<'py>,
        block_hashes: &Bound<'py, PyAny>,
        num_tokens: i64,
    ) -> PyResult<Bound<'py, PyList>> {
        let hashes = extract_hashes(block_hashes)?;
        let n = non_negative("num_tokens", num_tokens)?;
        let slices = hash_slices(&hashes);
        // Straight into Python str objects: no Rust String per key (this is the hot path of
        // every scheduler lookup, and the work is a few ns per key, so the GIL stays held).
        // Each hash is hexed once (the planner caches it across groups), the list is created
        // at its final size and filled in place.
        let candidates = self.inner.lookup_candidates(&slices, n);
        let count = self.inner.lookup_key_count(&candidates);
        if self.inner.has_secret() {
            // Keyed keys cost a keyed BLAKE3 each (~0.3 us): computed with the GIL released.
            let keys = py.detach(|| {
                let mut keys = Vec::with_capacity(count);
                self.inner
                    .for_each_candidate_key(&slices, &candidates, |key| keys.push(key.to_owned()));
                keys
            });
            return PyList::new(py, keys);
        }
        // SAFETY: PyList_New(count) returns a new list of `count` NULL slots (or NULL with an
        // exception set); slots 0..count are filled at most once each, with a new reference
        // that PyList_SetItem steals. The list reaches Python only when every slot is filled
        // (a list dropped with NULL slots is safe: its dealloc skips them).
        unsafe {
            use pyo3::ffi;
            let list = Bound::from_owned_ptr_or_err(py, ffi::PyList_New(count as ffi::Py_ssize_t))?;
            let mut emitted = 0usize;
            let mut failed = false;
            self.inner
                .for_each_candidate_key(&slices, &candidates, |key| {
                    emitted += 1;
                    if failed || emitted > count {
                        return;
                    }
                    let s = ffi::PyUnicode_FromStringAndSize(
                        key.as_ptr().cast(),
                        key.len() as ffi::Py_ssize_t,
                    );
                    if s.is_null() {
                        failed = true;
                        return;
                    }
                    ffi::PyList_SetItem(list.as_ptr(), (emitted - 1) as ffi::Py_ssize_t, s);
                });
            if failed {
                return Err(PyErr::fetch(py));
            }
            // Checked in every build, not only in debug ones: a count that disagrees with the
            // keys emitted would leave NULL slots (a crash on access) or drop keys.
            if emitted != count {
                return Err(PyRuntimeError::new_err(format!(
                    "kvstride bug: lookup_keys emitted {emitted} keys for a list of {count}"
                )));
            }
            Ok(list.cast_into_unchecked())
        }
    }

    fn longest_hit(
        &self,
        py: Python<'_>,
        block_hashes: &Bound<'_, PyAny>,
        num_tokens: i64,
        present: &Bound<'_, PyAny>,
    ) -> PyResult<u64> {
        let hashes = extract_hashes(block_hashes)?;
        let n = non_negative("num_tokens", num_tokens)?;
        let present = extract_exists(Some(present))?;
        let slices = hash_slices(&hashes);
        let inner = &self.inner;
        Ok(py.detach(|| inner.longest_hit(&slices, n, &|k| present.contains(k))))
    }

    /// §8: the boundaries whose window tails a prompt's saves keep (None: every one).
    #[pyo3(signature = (num_prompt_tokens, *, retention_interval, seen = None))]
    fn hit_boundaries(
        &self,
        num_prompt_tokens: i64,
        retention_interval: Option<i64>,
        seen: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Option<Vec<u64>>> {
        let n = non_negative("num_prompt_tokens", num_prompt_tokens)?;
        let interval = optional_non_negative("retention_interval", retention_interval)?;
        let seen = match seen {
            Some(seen) => extract_bools(seen)?,
            None => Vec::new(),
        };
        Ok(self.inner.hit_boundaries(n, interval, &seen))
    }

    /// §8: the block hash naming each boundary `a, 2a, …` up to `num_tokens` (a junction is
    /// the deepest one seen before).
    fn boundary_hashes<'py>(
        &self,
        py: Python<'py>,
        block_hashes: &Bound<'py, PyAny>,
        num_tokens: i64,
    ) -> PyResult<Bound<'py, PyList>> {
        let hashes = extract_hashes(block_hashes)?;
        let n = non_negative("num_tokens", num_tokens)?;
        let picked = self.inner.boundary_hash_indices(hashes.len(), n).into_iter().map(|i| hashes[i].clone());
        PyList::new(py, picked)
    }

    fn longest_hit_bitmap(
        &self,
        py: Python<'_>,
        block_hashes: &Bound<'_, PyAny>,
        num_tokens: i64,
        bitmap: &Bound<'_, PyAny>,
    ) -> PyResult<u64> {
        let hashes = extract_hashes(block_hashes)?;
        let n = non_negative("num_tokens", num_tokens)?;
        let bits = extract_bools(bitmap)?;
        let slices = hash_slices(&hashes);
        let inner = &self.inner;
        py.detach(|| inner.longest_hit_bitmap(&slices, n, &bits))
            .map_err(value_error)
    }

    #[pyo3(signature = (block_hashes, block_ids, hit_tokens, *, local_tokens = 0))]
    fn plan_load(
        &self,
        py: Python<'_>,
        block_hashes: &Bound<'_, PyAny>,
        block_ids: &Bound<'_, PyAny>,
        hit_tokens: i64,
        local_tokens: i64,
    ) -> PyResult<LoadPlan> {
        let hashes = extract_hashes(block_hashes)?;
        let tables = block_tables(block_ids, self.inner.groups().len())?;
        let hit = non_negative("hit_tokens", hit_tokens)?;
        let local = non_negative("local_tokens", local_tokens)?;
        let slices = hash_slices(&hashes);
        let inner = &self.inner;
        let plan = py
            .detach(|| inner.plan_load(&slices, &tables, hit, local))
            .map_err(value_error)?;
        Ok(LoadPlan {
            hit: plan.hit,
            start: plan.start,
            gets: transfers(plan.gets),
            missing: plan.missing,
        })
    }

    /// §7: per group, the values a hit of `hit_tokens` loads with nothing local.
    fn hit_set_blocks(&self, hit_tokens: i64) -> PyResult<Vec<u64>> {
        Ok(self.inner.hit_set_blocks(non_negative("hit_tokens", hit_tokens)?))
    }

    fn saved_offset_after_load(&self, hit_tokens: i64) -> PyResult<u64> {
        Ok(self
            .inner
            .saved_offset_after_load(non_negative("hit_tokens", hit_tokens)?))
    }

    fn __repr__(&self) -> String {
        format!(
            "KeyPlanner(groups={}, hash_block_size={}, scheduler_block_size={}, partial_hits={})",
            self.inner.groups().len(),
            self.inner.hash_block_size(),
            self.inner.scheduler_block_size(),
            if self.inner.partial_hits() {
                "True"
            } else {
                "False"
            }
        )
    }
}

#[pyfunction]
pub(super) fn dedup_gets(
    gets: Vec<(String, Bound<'_, PyAny>, Bound<'_, PyAny>)>,
) -> (Vec<String>, Vec<Vec<usize>>) {
    let keys: Vec<&str> = gets.iter().map(|g| g.0.as_str()).collect();
    planner::dedup_gets(&keys)
}
