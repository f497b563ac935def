//! kvstride core: the key and boundary arithmetic for offloading hybrid-model KV caches.
//! Pure Rust; it takes hashes, block tables and existence answers and returns plans.
//! Semantics: SEMANTICS.md (§ numbers in the module docs).

pub mod cbor;
pub mod error;
pub mod groups;
pub mod hashing;
pub mod keys;
pub mod payload;
pub mod planner;
pub mod regions;
pub mod secret;

#[cfg(test)]
mod planner_tests;

#[cfg(feature = "python")]
mod py;

pub use error::{Error, Result};
pub use groups::{resolve_block_sizes, GroupKind, GroupSpec, MambaMode};
pub use hashing::{BlockHash, BlockHasher, HashAlgo};
pub use keys::{stride_keys, Namespace};
pub use planner::{
    KeyPlanner, LoadPlan, NamespaceSpec, PlannerConfig, SavePlan, TailOutcome, TailPlan, Transfer,
};
