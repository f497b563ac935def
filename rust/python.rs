//! The pyo3 bindings: Python objects in, core calls with the GIL released, Python objects out.
//! Bad arguments raise `ValueError` (wrong values) or `TypeError` (wrong types) here, before
//! any core work starts.

use crate::cbor::{self, Value, INT_MAX, INT_MIN};
use crate::groups::{self, GroupKind, MambaMode};
use crate::hashing::{self, BlockHash, ExtraKeys, HashAlgo, TokenSlice};
use crate::keys;
use crate::planner::{self, NamespaceSpec, PlannerConfig, Transfer};
use numpy::{PyArray1, PyArrayMethods, PyReadonlyArray1, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::exceptions::{PyIndexError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{
    PyBool, PyByteArray, PyBytes, PyDict, PyFloat, PyInt, PyList, PySequence, PyString, PyTuple,
};
use std::collections::HashSet;

fn value_error(err: crate::Error) -> PyErr {
    PyValueError::new_err(err.0)
}

/// A non-negative integer argument; negative values are a `ValueError` naming the argument.
fn non_negative(name: &str, value: i64) -> PyResult<u64> {
    u64::try_from(value).map_err(|_| PyValueError::new_err(format!("{name}={value}: must be >= 0")))
}

fn optional_non_negative(name: &str, value: Option<i64>) -> PyResult<Option<u64>> {
    value.map(|v| non_negative(name, v)).transpose()
}

fn positive(name: &str, value: i64) -> PyResult<u64> {
    match value {
        v if v > 0 => Ok(v as u64),
        v => Err(PyValueError::new_err(format!(
            "{name}={v}: must be a positive integer"
        ))),
    }
}

// ---- token ids --------------------------------------------------------------------------

/// Token ids: copied out of a Python list, or a contiguous numpy array borrowed in place
/// (read-only; the borrow lives as long as this value).
enum TokenBuf<'py> {
    I32(Vec<i32>),
    I64(Vec<i64>),
    U32(Vec<u32>),
    U64(Vec<u64>),
    ArrayI32(PyReadonlyArray1<'py, i32>),
    ArrayI64(PyReadonlyArray1<'py, i64>),
    ArrayU32(PyReadonlyArray1<'py, u32>),
    ArrayU64(PyReadonlyArray1<'py, u64>),
}

impl TokenBuf<'_> {
    /// The ids as a plain slice, made before the GIL is released (the guard stays here).
    fn slice(&self) -> TokenSlice<'_> {
        let contiguous = "borrowed only when contiguous";
        match self {
            TokenBuf::I32(v) => TokenSlice::I32(v),
            TokenBuf::I64(v) => TokenSlice::I64(v),
            TokenBuf::U32(v) => TokenSlice::U32(v),
            TokenBuf::U64(v) => TokenSlice::U64(v),
            TokenBuf::ArrayI32(a) => TokenSlice::I32(a.as_slice().expect(contiguous)),
            TokenBuf::ArrayI64(a) => TokenSlice::I64(a.as_slice().expect(contiguous)),
            TokenBuf::ArrayU32(a) => TokenSlice::U32(a.as_slice().expect(contiguous)),
            TokenBuf::ArrayU64(a) => TokenSlice::U64(a.as_slice().expect(contiguous)),
        }
    }
}

fn numpy_tokens<'py>(array: &Bound<'py, PyUntypedArray>) -> PyResult<TokenBuf<'py>> {
    if array.ndim() != 1 {
        return Err(PyValueError::new_err(format!(
            "token_ids must be 1-D; got a numpy array of shape {:?}",
            array.shape()
        )));
    }
    macro_rules! take {
        ($t:ty, $owned:ident, $borrowed:ident) => {
            if let Ok(a) = array.cast::<PyArray1<$t>>() {
                let ids = a.readonly();
                return Ok(if ids.is_contiguous() {
                    TokenBuf::$borrowed(ids)
                } else {
                    TokenBuf::$owned(ids.as_array().to_vec())
                });
            }
        };
    }
    macro_rules! widen {
        ($t:ty) => {
            if let Ok(a) = array.cast::<PyArray1<$t>>() {
                return Ok(TokenBuf::I64(
                    a.readonly().as_array().iter().map(|&v| v as i64).collect(),
                ));
            }
        };
    }
    take!(i64, I64, ArrayI64);
    take!(i32, I32, ArrayI32);
    take!(u32, U32, ArrayU32);
    take!(u64, U64, ArrayU64);
    widen!(i16);
    widen!(u16);
    widen!(i8);
    widen!(u8);
    Err(PyTypeError::new_err(format!(
        "token_ids must be integers; got a numpy array of dtype {}",
        array.dtype()
    )))
}

fn extract_tokens<'py>(obj: &Bound<'py, PyAny>) -> PyResult<TokenBuf<'py>> {
    if let Ok(array) = obj.cast::<PyUntypedArray>() {
        return numpy_tokens(array);
    }
    if obj.is_instance_of::<PyString>() || obj.is_instance_of::<PyBytes>() {
        return Err(PyTypeError::new_err(
            "token_ids must be a list/tuple of ints or an integer numpy array, not str/bytes",
        ));
    }
    if let Some(tokens) = exact_int_list(obj) {
        return Ok(TokenBuf::I64(tokens));
    }
    let seq = obj.cast::<PySequence>().map_err(|_| {
        PyTypeError::new_err(format!(
            "token_ids must be a list/tuple of ints or an integer numpy array; got {}",
            type_name(obj)
        ))
    })?;
    let len = seq.len()?;
    let mut signed = Vec::with_capacity(len);
    for i in 0..len {
        let item = seq.get_item(i)?;
        match item.extract::<i64>() {
            Ok(v) if !item.is_instance_of::<PyBool>() => signed.push(v),
            _ => return wide_tokens(seq, i, &item),
        }
    }
    Ok(TokenBuf::I64(signed))
}

/// The fast path for the common input, an exact `list` or `tuple` of exact `int`s that fit
/// an i64: borrowed items (`PyList_GetItem`, no reference counting, no `Bound` per item) and
/// `PyLong_AsLongLong`. None for anything else (a subclass, a bool, a big int, ...): the
/// caller then takes the general path, which also words the errors.
fn exact_int_list(obj: &Bound<'_, PyAny>) -> Option<Vec<i64>> {
    use pyo3::ffi;
    let (is_list, len) = if let Ok(list) = obj.cast_exact::<PyList>() {
        (true, list.len())
    } else if let Ok(tuple) = obj.cast_exact::<PyTuple>() {
        (false, tuple.len())
    } else {
        return None;
    };
    let ptr = obj.as_ptr();
    let mut out = Vec::with_capacity(len);
    for i in 0..len {
        // SAFETY: `ptr` is an exact list/tuple of `len` items and the GIL is held. The items
        // are borrowed: nothing below runs Python code (exact ints only, so no `__index__`),
        // so the container cannot change under the loop.
        unsafe {
            let item = if is_list {
                ffi::PyList_GetItem(ptr, i as ffi::Py_ssize_t)
            } else {
                ffi::PyTuple_GetItem(ptr, i as ffi::Py_ssize_t)
            };
            if item.is_null() || ffi::PyLong_CheckExact(item) == 0 {
                ffi::PyErr_Clear();
                return None;
            }
            let v = ffi::PyLong_AsLongLong(item);
            if v == -1 && !ffi::PyErr_Occurred().is_null() {
                ffi::PyErr_Clear();
                return None;
            }
            out.push(v);
        }
    }
    Some(out)
}

/// The slow path for lists holding ids above i64::MAX (or something that is not an int).
fn wide_tokens(
    seq: &Bound<'_, PySequence>,
    at: usize,
    item: &Bound<'_, PyAny>,
) -> PyResult<TokenBuf<'static>> {
    if !item.is_instance_of::<PyInt>() || item.is_instance_of::<PyBool>() {
        return Err(PyTypeError::new_err(format!(
            "token_ids[{at}] is {} ({}); token ids must be ints",
            item.repr()?,
            type_name(item)
        )));
    }
    let mut wide = Vec::with_capacity(seq.len()?);
    for i in 0..seq.len()? {
        let item = seq.get_item(i)?;
        if !item.is_instance_of::<PyInt>() || item.is_instance_of::<PyBool>() {
            return Err(PyTypeError::new_err(format!(
                "token_ids[{i}] is {} ({}); token ids must be ints",
                item.repr()?,
                type_name(&item)
            )));
        }
        match item.extract::<u64>() {
            Ok(v) => wide.push(v),
            Err(_) => {
                return Err(PyValueError::new_err(format!(
                    "token_ids[{i}]={} is outside the token id range \
                     -2**63 .. 2**64-1 (mixing negative ids with ids >= 2**63 is not supported)",
                    item.repr()?
                )))
            }
        }
    }
    Ok(TokenBuf::U64(wide))
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".into())
}

// ---- CBOR values ------------------------------------------------------------------------

fn to_value(obj: &Bound<'_, PyAny>, depth: usize) -> PyResult<Value> {
    if depth > 64 {
        return Err(PyValueError::new_err(
            "extra key nested deeper than 64 levels",
        ));
    }
    if obj.is_none() {
        return Ok(Value::Null);
    }
    if let Ok(b) = obj.cast::<PyBool>() {
        return Ok(Value::Bool(b.is_true()));
    }
    if obj.is_instance_of::<PyInt>() {
        let v: i128 = obj.extract().map_err(|_| out_of_range(obj))?;
        if !(INT_MIN..=INT_MAX).contains(&v) {
            return Err(out_of_range(obj));
        }
        return Ok(Value::Int(v));
    }
    if let Ok(b) = obj.cast::<PyBytes>() {
        return Ok(Value::Bytes(b.as_bytes().to_vec()));
    }
    if let Ok(b) = obj.cast::<PyByteArray>() {
        return Ok(Value::Bytes(b.to_vec()));
    }
    if let Ok(s) = obj.cast::<PyString>() {
        return Ok(Value::Text(s.to_cow()?.into_owned()));
    }
    if let Ok(f) = obj.cast::<PyFloat>() {
        return Ok(Value::Float(f.value()));
    }
    if obj.is_instance_of::<PyTuple>() || obj.is_instance_of::<PyList>() {
        let items: PyResult<Vec<Value>> = obj
            .try_iter()?
            .map(|item| to_value(&item?, depth + 1))
            .collect();
        return Ok(Value::Array(items?));
    }
    if let Ok(d) = obj.cast::<PyDict>() {
        let mut entries = Vec::with_capacity(d.len());
        for (k, v) in d.iter() {
            entries.push((to_value(&k, depth + 1)?, to_value(&v, depth + 1)?));
        }
        return Ok(Value::Map(entries));
    }
    Err(PyTypeError::new_err(format!(
        "cannot hash a {} ({}): extra keys hold str, int, bytes, None, bool, float or \
         nested tuples of them",
        type_name(obj),
        obj.repr()?
    )))
}

fn out_of_range(obj: &Bound<'_, PyAny>) -> PyErr {
    PyValueError::new_err(format!(
        "int {} is outside CBOR's integer range -2**64 .. 2**64-1",
        obj.repr().map(|r| r.to_string()).unwrap_or_default()
    ))
}

fn holds_map(value: &Value) -> bool {
    match value {
        Value::Map(_) => true,
        Value::Array(items) => items.iter().any(holds_map),
        _ => false,
    }
}

fn extract_extra_keys(obj: &Bound<'_, PyAny>) -> PyResult<Vec<ExtraKeys>> {
    let seq = obj.cast::<PySequence>().map_err(|_| {
        PyTypeError::new_err(
            "extra_keys must be a list with one entry (None or a tuple) per full block",
        )
    })?;
    let mut out = Vec::with_capacity(seq.len()?);
    for i in 0..seq.len()? {
        let entry = seq.get_item(i)?;
        if entry.is_none() {
            out.push(None);
        } else if entry.is_instance_of::<PyTuple>() || entry.is_instance_of::<PyList>() {
            match to_value(&entry, 0)? {
                Value::Array(items) if !items.iter().any(holds_map) => out.push(Some(items)),
                Value::Array(_) => {
                    return Err(PyTypeError::new_err(format!(
                        "extra_keys[{i}] holds a dict: extra keys hold str, int, bytes, None, \
                         bool, float or nested tuples of them"
                    )))
                }
                _ => unreachable!("tuples convert to arrays"),
            }
        } else {
            return Err(PyTypeError::new_err(format!(
                "extra_keys[{i}] is a {}; each entry is None or a tuple",
                type_name(&entry)
            )));
        }
    }
    Ok(out)
}

#[pyfunction]
fn cbor_encode<'py>(py: Python<'py>, value: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyBytes>> {
    let value = to_value(value, 0)?;
    Ok(PyBytes::new(py, &cbor::encode(&value)))
}

// ---- hashing ------------------------------------------------------------------------------

#[pyclass(module = "kvstride._core", frozen)]
struct BlockHasher {
    inner: hashing::BlockHasher,
}

fn hashes_to_py<'py>(py: Python<'py>, hashes: &[BlockHash]) -> Bound<'py, PyList> {
    PyList::new(py, hashes.iter().map(|h| PyBytes::new(py, h.as_ref()))).expect("a list of bytes")
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

// ---- geometry -----------------------------------------------------------------------------

#[pyclass(module = "kvstride._core", frozen, eq)]
#[derive(Clone, PartialEq)]
struct GroupSpec {
    inner: groups::GroupSpec,
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
        if g.prefix_cacheable != (g.kind != GroupKind::CircularBuffer) {
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

fn extract_groups(groups: &Bound<'_, PyAny>) -> PyResult<Vec<groups::GroupSpec>> {
    if groups.is_instance_of::<PyString>() {
        return Err(PyTypeError::new_err(
            "groups must be a sequence of GroupSpec",
        ));
    }
    groups
        .try_iter()
        .map_err(|_| PyTypeError::new_err("groups must be a sequence of GroupSpec"))?
        .enumerate()
        .map(|(i, g)| {
            let g = g?;
            g.cast::<GroupSpec>()
                .map(|s| s.get().inner.clone())
                .map_err(|_| {
                    PyTypeError::new_err(format!(
                        "groups[{i}] is a {}, not a GroupSpec",
                        type_name(&g)
                    ))
                })
        })
        .collect()
}

#[pyfunction]
#[pyo3(signature = (groups, *, prefix_match_unit = None, dcp = 1))]
fn resolve_block_sizes(
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
fn hashes_per_block(
    groups: &Bound<'_, PyAny>,
    hash_block_size: i64,
    dcp: i64,
) -> PyResult<Vec<u64>> {
    let groups = extract_groups(groups)?;
    let h = positive("hash_block_size", hash_block_size)?;
    let dcp = positive("dcp", dcp)?;
    groups::hashes_per_block(&groups, h, dcp).map_err(value_error)
}

// ---- striding and keys --------------------------------------------------------------------

#[pyfunction]
#[pyo3(signature = (block_hashes, hashes_per_chunk, start_chunk = 0))]
fn stride_keys<'py>(
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
struct Namespace {
    inner: keys::Namespace,
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
fn layout_fingerprint(description: &Bound<'_, PyDict>) -> PyResult<String> {
    Ok(keys::layout_fingerprint(&to_value(
        description.as_any(),
        0,
    )?))
}

// ---- planning -----------------------------------------------------------------------------

type PyTransfer = (String, usize, u64);

fn transfers(list: Vec<Transfer>) -> Vec<PyTransfer> {
    list.into_iter()
        .map(|t| (t.key, t.group, t.block_id))
        .collect()
}

#[pyclass(module = "kvstride._core", frozen, get_all)]
struct TailPlan {
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
struct SavePlan {
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
struct LoadPlan {
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
struct KeyPlanner {
    inner: planner::KeyPlanner,
}

fn extract_hashes<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Vec<Bound<'py, PyBytes>>> {
    if obj.is_instance_of::<PyBytes>() || obj.is_instance_of::<PyString>() {
        return Err(PyTypeError::new_err(
            "block_hashes must be a list of bytes, not one bytes/str",
        ));
    }
    obj.try_iter()
        .map_err(|_| PyTypeError::new_err("block_hashes must be a list of bytes"))?
        .enumerate()
        .map(|(i, h)| {
            let h = h?;
            h.cast_into::<PyBytes>().map_err(|e| {
                PyTypeError::new_err(format!(
                    "block_hashes[{i}] is a {}, not bytes",
                    type_name(e.into_inner().as_any())
                ))
            })
        })
        .collect()
}

fn hash_slices<'a>(hashes: &'a [Bound<'_, PyBytes>]) -> Vec<&'a [u8]> {
    hashes.iter().map(|h| h.as_bytes()).collect()
}

/// A list's or tuple's items from index `from` on (O(items taken)); None for other iterables.
fn items_from<'py>(obj: &Bound<'py, PyAny>, from: usize) -> Option<Vec<Bound<'py, PyAny>>> {
    if let Ok(list) = obj.cast::<PyList>() {
        return Some((from..list.len()).filter_map(|i| list.get_item(i).ok()).collect());
    }
    if let Ok(tuple) = obj.cast::<PyTuple>() {
        return Some((from..tuple.len()).filter_map(|i| tuple.get_item(i).ok()).collect());
    }
    None
}

/// A list's or tuple's length; None for other iterables.
fn items_len(obj: &Bound<'_, PyAny>) -> Option<usize> {
    if let Ok(list) = obj.cast::<PyList>() {
        return Some(list.len());
    }
    obj.cast::<PyTuple>().ok().map(|tuple| tuple.len())
}

fn is_list_or_tuple(obj: &Bound<'_, PyAny>) -> bool {
    obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>()
}

/// `block_hashes[from:]` as bytes (a list or tuple is read from `from` on only).
fn extract_hashes_from<'py>(obj: &Bound<'py, PyAny>, from: usize) -> PyResult<Vec<Bound<'py, PyBytes>>> {
    let Some(items) = items_from(obj, from) else {
        let mut all = extract_hashes(obj)?;
        return Ok(all.split_off(from.min(all.len())));
    };
    items
        .into_iter()
        .enumerate()
        .map(|(i, h)| {
            h.cast_into::<PyBytes>().map_err(|e| {
                PyTypeError::new_err(format!(
                    "block_hashes[{}] is a {}, not bytes",
                    from + i,
                    type_name(e.into_inner().as_any())
                ))
            })
        })
        .collect()
}

fn extract_exists(obj: Option<&Bound<'_, PyAny>>) -> PyResult<HashSet<String>> {
    let Some(obj) = obj else {
        return Ok(HashSet::new());
    };
    if obj.is_instance_of::<PyString>() {
        return Err(PyTypeError::new_err(
            "exists must be a set of key strings, not one str",
        ));
    }
    obj.try_iter()
        .map_err(|_| PyTypeError::new_err("exists must be a set (or iterable) of key strings"))?
        .map(|k| k?.extract::<String>())
        .collect()
}

impl KeyPlanner {
    /// `block_ids[g][rows[g]:]` for every group (lists and tuples are read from the row on).
    fn block_tables_from(&self, block_ids: &Bound<'_, PyAny>, rows: &[usize]) -> PyResult<Vec<Vec<u64>>> {
        let Some(tables) = items_from(block_ids, 0).filter(|t| t.iter().all(is_list_or_tuple)) else {
            let mut tables = self.block_tables(block_ids)?;
            for (table, &row) in tables.iter_mut().zip(rows) {
                table.drain(..row.min(table.len()));
            }
            return Ok(tables);
        };
        let groups = self.inner.groups().len();
        if tables.len() != groups {
            return Err(PyValueError::new_err(format!(
                "block_ids has {} tables for {groups} groups: pass one (possibly empty) block \
                 table per group",
                tables.len()
            )));
        }
        tables
            .iter()
            .zip(rows)
            .enumerate()
            .map(|(g, (table, &row))| {
                items_from(table, row)
                    .unwrap_or_default()
                    .into_iter()
                    .map(|id| {
                        let id: i64 = id.extract().map_err(|_| {
                            PyTypeError::new_err("block_ids must be one list of int block ids per group")
                        })?;
                        u64::try_from(id).map_err(|_| {
                            PyValueError::new_err(format!(
                                "block_ids[{g}] holds {id}: block ids are >= 0 (0 = NULL)"
                            ))
                        })
                    })
                    .collect()
            })
            .collect()
    }

    fn block_tables(&self, block_ids: &Bound<'_, PyAny>) -> PyResult<Vec<Vec<u64>>> {
        let tables: Vec<Vec<i64>> = block_ids.extract().map_err(|_| {
            PyTypeError::new_err("block_ids must be one list of int block ids per group")
        })?;
        let groups = self.inner.groups().len();
        if tables.len() != groups {
            return Err(PyValueError::new_err(format!(
                "block_ids has {} tables for {groups} groups: pass one (possibly empty) block \
                 table per group",
                tables.len()
            )));
        }
        tables
            .into_iter()
            .enumerate()
            .map(|(g, t)| {
                t.into_iter()
                    .map(|id| {
                        u64::try_from(id).map_err(|_| {
                            PyValueError::new_err(format!(
                                "block_ids[{g}] holds {id}: block ids are >= 0 (0 = NULL)"
                            ))
                        })
                    })
                    .collect()
            })
            .collect()
    }

    fn group_index(&self, group: i64) -> PyResult<usize> {
        let n = self.inner.groups().len();
        usize::try_from(group)
            .ok()
            .filter(|&g| g < n)
            .ok_or_else(|| {
                PyIndexError::new_err(format!(
                    "group {group} out of range: this planner has {n} groups"
                ))
            })
    }
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
        Ok(self.inner.replication(self.group_index(group)?))
    }

    fn key(&self, group: i64, block_hash: &[u8]) -> PyResult<String> {
        Ok(self.inner.key(self.group_index(group)?, block_hash))
    }

    fn key_bytes<'py>(
        &self,
        py: Python<'py>,
        group: i64,
        block_hash: &[u8],
    ) -> PyResult<Bound<'py, PyBytes>> {
        let g = self.group_index(group)?;
        Ok(PyBytes::new(py, &keys::key_bytes(g as u32, block_hash)))
    }

    #[pyo3(signature = (block_hashes, block_ids, num_tokens, *, saved_offset = 0, exists = None))]
    fn plan_save(
        &self,
        py: Python<'_>,
        block_hashes: &Bound<'_, PyAny>,
        block_ids: &Bound<'_, PyAny>,
        num_tokens: i64,
        saved_offset: i64,
        exists: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<SavePlan> {
        let n = non_negative("num_tokens", num_tokens)?;
        let offset = non_negative("saved_offset", saved_offset)?;
        // Only what the plan reads is converted: a step costs the same at any context length.
        // (Inputs shorter than the base, or not lists, are converted whole.)
        let mut base = self.inner.save_base(offset);
        let hashed = items_len(block_hashes);
        if hashed.is_none_or(|len| len < self.inner.rows_at(base).0) {
            base = 0;
        }
        let (first_hash, rows) = self.inner.rows_at(base);
        let hashes = extract_hashes_from(block_hashes, first_hash)?;
        let tables = self.block_tables_from(block_ids, &rows)?;
        let exists = extract_exists(exists)?;
        let slices = hash_slices(&hashes);
        let inner = &self.inner;
        let plan = py
            .detach(|| inner.plan_save_from(base, &slices, &tables, n, offset, &|k| exists.contains(k)))
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
        let tables = self.block_tables(block_ids)?;
        let raw: Vec<(i64, i64, i64)> = handoffs.extract().map_err(|_| {
            PyTypeError::new_err(
                "handoffs must be a list of (group, block_id, boundary) int tuples",
            )
        })?;
        let handoffs: Vec<(usize, u64, u64)> = raw
            .into_iter()
            .map(|(g, b, x)| {
                Ok((
                    self.group_index(g)?,
                    non_negative("handoff block_id", b)?,
                    non_negative("handoff boundary", x)?,
                ))
            })
            .collect::<PyResult<_>>()?;
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

    fn longest_hit_bitmap(
        &self,
        py: Python<'_>,
        block_hashes: &Bound<'_, PyAny>,
        num_tokens: i64,
        bitmap: &Bound<'_, PyAny>,
    ) -> PyResult<u64> {
        let hashes = extract_hashes(block_hashes)?;
        let n = non_negative("num_tokens", num_tokens)?;
        let bits: Vec<bool> = bitmap
            .try_iter()?
            .map(|b| b?.is_truthy())
            .collect::<PyResult<_>>()?;
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
        let tables = self.block_tables(block_ids)?;
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
fn dedup_gets(
    gets: Vec<(String, Bound<'_, PyAny>, Bound<'_, PyAny>)>,
) -> (Vec<String>, Vec<Vec<usize>>) {
    let keys: Vec<&str> = gets.iter().map(|g| g.0.as_str()).collect();
    planner::dedup_gets(&keys)
}

// ---- store payload hashing (kvstride.stores verified reads) -------------------------------

/// A batch is hashed on rayon's threads (one value per task) from this many bytes on.
const PAR_HASH_BYTES: usize = 1 << 20;

/// One payload part: a C-contiguous numpy array (any dtype, its bytes in memory order) or any
/// object `numpy.frombuffer` accepts (bytes, bytearray, memoryview, ctypes arrays, mmap).
/// Returns the (address, length) of its bytes; the array that owns them goes into `keep`,
/// which the caller holds until every use of the pair is over.
fn payload_part<'py>(
    obj: &Bound<'py, PyAny>,
    keep: &mut Vec<Bound<'py, PyAny>>,
) -> PyResult<(usize, usize)> {
    let array = match obj.cast::<PyUntypedArray>() {
        Ok(a) => a.clone(),
        Err(_) => obj
            .py()
            .import("numpy")?
            .call_method1("frombuffer", (obj, "u1"))
            .and_then(|a| Ok(a.cast_into::<PyUntypedArray>()?))
            .map_err(|e| {
                PyTypeError::new_err(format!(
                    "a payload part must be a C-contiguous numpy array or a buffer (bytes, bytearray, \
                     memoryview); got {}: {e}",
                    type_name(obj)
                ))
            })?,
    };
    if !array.is_c_contiguous() {
        return Err(PyValueError::new_err("a payload part must be C-contiguous"));
    }
    let len = array.len() * numpy::PyArrayDescrMethods::itemsize(&array.dtype());
    // SAFETY: reads the data pointer of a live array object (no dereference here).
    let addr = unsafe { (*array.as_array_ptr()).data } as usize;
    keep.push(array.into_any());
    Ok((addr, len))
}

/// A value's parts: a list or tuple of parts, or one part.
fn payload_parts<'py>(
    value: &Bound<'py, PyAny>,
    keep: &mut Vec<Bound<'py, PyAny>>,
) -> PyResult<Vec<(usize, usize)>> {
    if value.is_instance_of::<PyList>() || value.is_instance_of::<PyTuple>() {
        value.try_iter()?.map(|p| payload_part(&p?, keep)).collect()
    } else {
        Ok(vec![payload_part(value, keep)?])
    }
}

/// XXH3-64 (seed 0) of the parts' bytes in order: the same value as one `xxh3_64` over their
/// concatenation.
fn xxh3_regions(parts: &[(usize, usize)]) -> u64 {
    // SAFETY: every non-empty pair is the data of a C-contiguous array that the caller keeps
    // alive (`keep`) for the whole call.
    let slices: Vec<&[u8]> = parts
        .iter()
        .filter(|p| p.1 > 0)
        .map(|&(addr, len)| unsafe { std::slice::from_raw_parts(addr as *const u8, len) })
        .collect();
    crate::payload::xxh3_64_parts(&slices)
}

/// `xxh3_64_parts(parts) -> int`: the XXH3-64 of one value given as parts (numpy arrays or
/// buffers), equal to `xxhash.xxh3_64_intdigest(b"".join(parts))`; hashed with the GIL released.
#[pyfunction]
fn xxh3_64_parts(py: Python<'_>, parts: &Bound<'_, PyAny>) -> PyResult<u64> {
    let mut keep = Vec::new();
    let regions = payload_parts(parts, &mut keep)?;
    let digest = py.detach(|| xxh3_regions(&regions));
    drop(keep);
    Ok(digest)
}

/// `xxh3_64_batch(values) -> list[int]`: `xxh3_64_parts` of each value, with the GIL released
/// and the values spread over rayon's threads once the batch holds 1 MiB or more.
#[pyfunction]
fn xxh3_64_batch(py: Python<'_>, values: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    let mut keep = Vec::new();
    let regions: Vec<Vec<(usize, usize)>> = values
        .try_iter()?
        .map(|v| payload_parts(&v?, &mut keep))
        .collect::<PyResult<_>>()?;
    let total: usize = regions.iter().flatten().map(|p| p.1).sum();
    let digests = py.detach(|| {
        if total >= PAR_HASH_BYTES && regions.len() > 1 {
            use rayon::prelude::*;
            regions
                .par_iter()
                .with_max_len(1)
                .map(|r| xxh3_regions(r))
                .collect()
        } else {
            regions
                .iter()
                .map(|r| xxh3_regions(r))
                .collect::<Vec<u64>>()
        }
    });
    drop(keep);
    Ok(digests)
}

/// `StoreSecret(secret: bytes)`: the value MAC of a deployment secret (issue 17; the key part
/// is `KeyPlanner(..., secret=)`). `payload_tags(values)`: each value's keyed payload tag (a
/// u64, where `xxh3_64_batch` gives the XXH3-64), GIL released, over rayon's threads for big
/// batches; `header_macs(keys, lengths, tags)`: the 16-byte MAC of each value's header.
#[pyclass(module = "kvstride._core", frozen)]
struct StoreSecret {
    inner: crate::secret::Secret,
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
        let regions: Vec<Vec<(usize, usize)>> = values
            .try_iter()?
            .map(|v| payload_parts(&v?, &mut keep))
            .collect::<PyResult<_>>()?;
        let total: usize = regions.iter().flatten().map(|p| p.1).sum();
        let secret = &self.inner;
        let tag = |parts: &Vec<(usize, usize)>| {
            // SAFETY: as `xxh3_regions`: arrays the caller keeps alive (`keep`).
            let slices: Vec<&[u8]> = parts
                .iter()
                .filter(|p| p.1 > 0)
                .map(|&(addr, len)| unsafe { std::slice::from_raw_parts(addr as *const u8, len) })
                .collect();
            secret.payload_tag(&slices)
        };
        let tags = py.detach(|| {
            if total >= PAR_HASH_BYTES && regions.len() > 1 {
                use rayon::prelude::*;
                regions.par_iter().with_max_len(1).map(tag).collect()
            } else {
                regions.iter().map(tag).collect::<Vec<u64>>()
            }
        });
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
        if keys.len() != lengths.len() || keys.len() != tags.len() {
            return Err(PyValueError::new_err("keys, lengths and tags must have the same length"));
        }
        let secret = &self.inner;
        let macs: Vec<[u8; 16]> = py.detach(|| {
            keys.iter()
                .zip(&lengths)
                .zip(&tags)
                .map(|((k, &n), &t)| secret.header_mac(k.as_bytes(), n, t))
                .collect()
        });
        Ok(macs.iter().map(|m| PyBytes::new(py, m)).collect())
    }

    fn __repr__(&self) -> &'static str {
        "StoreSecret(..)"
    }
}

// ---- host arena regions (kvstride.arena) ---------------------------------------------------

fn region_slice<'a>(array: &'a PyReadonlyArray1<'_, u64>) -> PyResult<&'a [u64]> {
    array
        .as_slice()
        .map_err(|_| PyValueError::new_err("region arrays must be C-contiguous uint64"))
}

fn same_lengths(slices: &[&[u64]]) -> PyResult<()> {
    if slices.windows(2).any(|w| w[0].len() != w[1].len()) {
        return Err(PyValueError::new_err("region arrays must have the same length"));
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn arena_rows<'a>(
    src: &'a PyReadonlyArray1<'_, u64>,
    dst: &'a PyReadonlyArray1<'_, u64>,
    lengths: &'a PyReadonlyArray1<'_, u64>,
    row_start: &'a PyReadonlyArray1<'_, u64>,
    secret: Option<&'a crate::secret::Secret>,
) -> PyResult<crate::regions::Rows<'a>> {
    let rows = crate::regions::Rows {
        src: region_slice(src)?,
        dst: region_slice(dst)?,
        len: region_slice(lengths)?,
        row_start: region_slice(row_start)?,
        secret,
    };
    same_lengths(&[rows.src, rows.dst, rows.len])?;
    let n = rows.len.len() as u64;
    let starts_ok = rows.row_start.first() == Some(&0)
        && rows.row_start.last() == Some(&n)
        && rows.row_start.windows(2).all(|w| w[0] <= w[1]);
    if !starts_ok {
        return Err(PyValueError::new_err("row_start must run from 0 to the number of regions, one more entry than rows"));
    }
    Ok(rows)
}

/// `_save_rows(src, dst, lengths, row_start) -> numpy uint64`: copy each row's regions and
/// return the XXH3-64 of each row's bytes (its regions in order); GIL released. Unchecked raw
/// memory access: only for kvstride's own copies (`kvstride.arena`, `kvstride.transfer`),
/// which derive every address from tensors and buffers they hold. With `secret` (a
/// `StoreSecret`) each row's digest is its keyed payload tag instead.
#[pyfunction]
#[pyo3(signature = (src, dst, lengths, row_start, secret = None))]
fn _save_rows<'py>(
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
    let digests = py.detach(|| unsafe { crate::regions::save_rows(&rows) });
    Ok(PyArray1::from_vec(py, digests))
}

/// `_load_rows(src, dst, lengths, row_start, expected) -> numpy bool`: XXH3-64 each row's
/// source bytes and copy the row only when it equals `expected`; GIL released. Same contract
/// as `_save_rows` (and `secret` as there).
#[pyfunction]
#[pyo3(signature = (src, dst, lengths, row_start, expected, secret = None))]
fn _load_rows<'py>(
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
    if expected.len() + 1 != rows.row_start.len() {
        return Err(PyValueError::new_err("expected needs one digest per row"));
    }
    // SAFETY: as `_save_rows`.
    let ok = py.detach(|| unsafe { crate::regions::load_rows(&rows, expected) });
    Ok(PyArray1::from_vec(py, ok))
}

/// `_copy_regions(src, dst, lengths)`: copy `lengths[i]` bytes from address `src[i]` to
/// `dst[i]` with the GIL released (no torch thread pool: it runs beside vLLM's bound OpenMP
/// threads from any thread). Same contract as `_save_rows`.
#[pyfunction]
fn _copy_regions(
    py: Python<'_>,
    src: PyReadonlyArray1<'_, u64>,
    dst: PyReadonlyArray1<'_, u64>,
    lengths: PyReadonlyArray1<'_, u64>,
) -> PyResult<()> {
    let (s, d, l) = (region_slice(&src)?, region_slice(&dst)?, region_slice(&lengths)?);
    same_lengths(&[s, d, l])?;
    // SAFETY: as `_save_rows`.
    py.detach(|| unsafe { crate::regions::copy_regions(s, d, l) });
    Ok(())
}

/// `_xxh3_64_regions(addrs, lengths) -> numpy.ndarray[uint64]`: the XXH3-64 of each raw region,
/// with the GIL released. Same contract as `_save_rows`.
#[pyfunction]
fn _xxh3_64_regions<'py>(
    py: Python<'py>,
    addrs: PyReadonlyArray1<'py, u64>,
    lengths: PyReadonlyArray1<'py, u64>,
) -> PyResult<Bound<'py, PyArray1<u64>>> {
    let (a, l) = (region_slice(&addrs)?, region_slice(&lengths)?);
    same_lengths(&[a, l])?;
    // SAFETY: as `_save_rows`.
    let digests = py.detach(|| unsafe { crate::regions::xxh3_regions(a, l) });
    Ok(PyArray1::from_vec(py, digests))
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<BlockHasher>()?;
    m.add_class::<GroupSpec>()?;
    m.add_class::<Namespace>()?;
    m.add_class::<KeyPlanner>()?;
    m.add_class::<TailPlan>()?;
    m.add_class::<SavePlan>()?;
    m.add_class::<LoadPlan>()?;
    m.add_class::<StoreSecret>()?;
    m.add_function(wrap_pyfunction!(cbor_encode, m)?)?;
    m.add_function(wrap_pyfunction!(resolve_block_sizes, m)?)?;
    m.add_function(wrap_pyfunction!(hashes_per_block, m)?)?;
    m.add_function(wrap_pyfunction!(stride_keys, m)?)?;
    m.add_function(wrap_pyfunction!(layout_fingerprint, m)?)?;
    m.add_function(wrap_pyfunction!(dedup_gets, m)?)?;
    m.add_function(wrap_pyfunction!(xxh3_64_parts, m)?)?;
    m.add_function(wrap_pyfunction!(xxh3_64_batch, m)?)?;
    m.add_function(wrap_pyfunction!(_save_rows, m)?)?;
    m.add_function(wrap_pyfunction!(_copy_regions, m)?)?;
    m.add_function(wrap_pyfunction!(_load_rows, m)?)?;
    m.add_function(wrap_pyfunction!(_xxh3_64_regions, m)?)?;
    m.add("HASH_ALGOS", HashAlgo::NAMES.to_vec())?;
    m.add("GROUP_KINDS", GroupKind::NAMES.to_vec())?;
    Ok(())
}
