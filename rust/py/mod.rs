//! The pyo3 bindings (`kvstride._core`): Python objects in, core calls with the GIL released,
//! Python objects out. Bad arguments raise `ValueError` (wrong values) or `TypeError` (wrong
//! types) before any core work starts. Each module binds one core module and only converts:
//! `convert` holds the Python <-> Rust conversions they share; this file registers the module.

mod convert;
mod groups;
mod hashing;
mod keys;
mod planner;
mod regions;
mod secret;

use crate::groups::GroupKind;
use crate::hashing::HashAlgo;
use pyo3::prelude::*;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<hashing::BlockHasher>()?;
    m.add_class::<groups::GroupSpec>()?;
    m.add_class::<keys::Namespace>()?;
    m.add_class::<planner::KeyPlanner>()?;
    m.add_class::<planner::TailPlan>()?;
    m.add_class::<planner::SavePlan>()?;
    m.add_class::<planner::LoadPlan>()?;
    m.add_class::<secret::StoreSecret>()?;
    m.add_function(wrap_pyfunction!(hashing::cbor_encode, m)?)?;
    m.add_function(wrap_pyfunction!(groups::resolve_block_sizes, m)?)?;
    m.add_function(wrap_pyfunction!(groups::hashes_per_block, m)?)?;
    m.add_function(wrap_pyfunction!(keys::stride_keys, m)?)?;
    m.add_function(wrap_pyfunction!(keys::layout_fingerprint, m)?)?;
    m.add_function(wrap_pyfunction!(planner::dedup_gets, m)?)?;
    m.add_function(wrap_pyfunction!(hashing::xxh3_64_parts, m)?)?;
    m.add_function(wrap_pyfunction!(hashing::xxh3_64_batch, m)?)?;
    m.add_function(wrap_pyfunction!(regions::_save_rows, m)?)?;
    m.add_function(wrap_pyfunction!(regions::_copy_regions, m)?)?;
    m.add_function(wrap_pyfunction!(regions::_load_rows, m)?)?;
    m.add_function(wrap_pyfunction!(regions::_xxh3_64_regions, m)?)?;
    m.add("HASH_ALGOS", HashAlgo::NAMES.to_vec())?;
    m.add("GROUP_KINDS", GroupKind::NAMES.to_vec())?;
    Ok(())
}
