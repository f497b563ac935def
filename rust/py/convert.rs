//! Python <-> Rust conversion shared by the binding modules: argument checks that name the
//! argument, token ids (list and numpy fast paths), CBOR values and extra keys, block hashes,
//! block tables, hand-offs, `exists` sets, payload parts and region arrays.

use crate::cbor::{Value, INT_MAX, INT_MIN};
use crate::hashing::{BlockHash, ExtraKeys, TokenSlice};
use crate::planner::Transfer;
use crate::regions::Part;
use numpy::{PyArray1, PyArrayMethods, PyReadonlyArray1, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::exceptions::{PyIndexError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{
    PyBool, PyByteArray, PyBytes, PyDict, PyFloat, PyInt, PyList, PySequence, PyString, PyTuple,
};
use std::collections::HashSet;

/// A core error is a `ValueError` with the core's message.
pub(super) fn value_error(err: crate::Error) -> PyErr {
    PyValueError::new_err(err.0)
}

/// A non-negative integer argument; negative values are a `ValueError` naming the argument.
pub(super) fn non_negative(name: &str, value: i64) -> PyResult<u64> {
    u64::try_from(value).map_err(|_| PyValueError::new_err(format!("{name}={value}: must be >= 0")))
}

pub(super) fn optional_non_negative(name: &str, value: Option<i64>) -> PyResult<Option<u64>> {
    value.map(|v| non_negative(name, v)).transpose()
}

pub(super) fn positive(name: &str, value: i64) -> PyResult<u64> {
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
pub(super) enum TokenBuf<'py> {
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
    pub(super) fn slice(&self) -> TokenSlice<'_> {
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

pub(super) fn extract_tokens<'py>(obj: &Bound<'py, PyAny>) -> PyResult<TokenBuf<'py>> {
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

pub(super) fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".into())
}

// ---- CBOR values ------------------------------------------------------------------------

/// A Python value as a CBOR value (extra keys, layout descriptions, `cbor_encode`).
pub(super) fn to_value(obj: &Bound<'_, PyAny>, depth: usize) -> PyResult<Value> {
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

/// `extra_keys`: one entry per full block, None or a tuple of CBOR values (no dicts).
pub(super) fn extract_extra_keys(obj: &Bound<'_, PyAny>) -> PyResult<Vec<ExtraKeys>> {
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

// ---- block hashes, groups, block tables, hand-offs, exists sets ------------------------------

/// Block hashes out: a list of bytes.
pub(super) fn hashes_to_py<'py>(py: Python<'py>, hashes: &[BlockHash]) -> Bound<'py, PyList> {
    PyList::new(py, hashes.iter().map(|h| PyBytes::new(py, h.as_ref()))).expect("a list of bytes")
}

/// `groups`: a sequence (not a str) of `GroupSpec`.
pub(super) fn extract_groups(groups: &Bound<'_, PyAny>) -> PyResult<Vec<crate::groups::GroupSpec>> {
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
            g.cast::<super::groups::GroupSpec>()
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

/// A transfer as Python sees it: `(key, group, block_id)`.
pub(super) type PyTransfer = (String, usize, u64);

pub(super) fn transfers(list: Vec<Transfer>) -> Vec<PyTransfer> {
    list.into_iter()
        .map(|t| (t.key, t.group, t.block_id))
        .collect()
}

/// `block_hashes`: an iterable (not one bytes/str) of bytes, borrowed.
pub(super) fn extract_hashes<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Vec<Bound<'py, PyBytes>>> {
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

/// An iterable of truthy values as bools (existence bitmaps, "seen" marks).
pub(super) fn extract_bools(obj: &Bound<'_, PyAny>) -> PyResult<Vec<bool>> {
    obj.try_iter()?.map(|b| b?.is_truthy()).collect()
}

pub(super) fn hash_slices<'a>(hashes: &'a [Bound<'_, PyBytes>]) -> Vec<&'a [u8]> {
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
pub(super) fn items_len(obj: &Bound<'_, PyAny>) -> Option<usize> {
    if let Ok(list) = obj.cast::<PyList>() {
        return Some(list.len());
    }
    obj.cast::<PyTuple>().ok().map(|tuple| tuple.len())
}

fn is_list_or_tuple(obj: &Bound<'_, PyAny>) -> bool {
    obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>()
}

/// `block_hashes[from:]` as bytes (a list or tuple is read from `from` on only).
pub(super) fn extract_hashes_from<'py>(obj: &Bound<'py, PyAny>, from: usize) -> PyResult<Vec<Bound<'py, PyBytes>>> {
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

/// `exists` / `present`: an iterable (not one str) of key strings; None is empty.
pub(super) fn extract_exists(obj: Option<&Bound<'_, PyAny>>) -> PyResult<HashSet<String>> {
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

/// A `block_ids` argument's group count check: one table per group.
fn check_table_count(tables: usize, groups: usize) -> PyResult<()> {
    if tables != groups {
        return Err(PyValueError::new_err(format!(
            "block_ids has {tables} tables for {groups} groups: pass one (possibly empty) block \
             table per group"
        )));
    }
    Ok(())
}

fn block_id(g: usize, id: i64) -> PyResult<u64> {
    u64::try_from(id).map_err(|_| {
        PyValueError::new_err(format!("block_ids[{g}] holds {id}: block ids are >= 0 (0 = NULL)"))
    })
}

/// `block_ids[g][rows[g]:]` for every one of `groups` groups (lists and tuples are read from
/// the row on).
pub(super) fn block_tables_from(
    block_ids: &Bound<'_, PyAny>,
    groups: usize,
    rows: &[usize],
) -> PyResult<Vec<Vec<u64>>> {
    let Some(tables) = items_from(block_ids, 0).filter(|t| t.iter().all(is_list_or_tuple)) else {
        let mut tables = block_tables(block_ids, groups)?;
        for (table, &row) in tables.iter_mut().zip(rows) {
            table.drain(..row.min(table.len()));
        }
        return Ok(tables);
    };
    check_table_count(tables.len(), groups)?;
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
                    block_id(g, id)
                })
                .collect()
        })
        .collect()
}

/// `block_ids`: one table of block ids (ints >= 0) for every one of `groups` groups.
pub(super) fn block_tables(block_ids: &Bound<'_, PyAny>, groups: usize) -> PyResult<Vec<Vec<u64>>> {
    let tables: Vec<Vec<i64>> = block_ids.extract().map_err(|_| {
        PyTypeError::new_err("block_ids must be one list of int block ids per group")
    })?;
    check_table_count(tables.len(), groups)?;
    tables
        .into_iter()
        .enumerate()
        .map(|(g, t)| t.into_iter().map(|id| block_id(g, id)).collect())
        .collect()
}

/// A group index argument: `IndexError` outside `0..groups`.
pub(super) fn group_index(group: i64, groups: usize) -> PyResult<usize> {
    usize::try_from(group)
        .ok()
        .filter(|&g| g < groups)
        .ok_or_else(|| {
            PyIndexError::new_err(format!(
                "group {group} out of range: this planner has {groups} groups"
            ))
        })
}

/// `handoffs`: `(group, block_id, boundary)` int tuples, the group checked against `groups`.
pub(super) fn extract_handoffs(
    handoffs: &Bound<'_, PyAny>,
    groups: usize,
) -> PyResult<Vec<(usize, u64, u64)>> {
    let raw: Vec<(i64, i64, i64)> = handoffs.extract().map_err(|_| {
        PyTypeError::new_err("handoffs must be a list of (group, block_id, boundary) int tuples")
    })?;
    raw.into_iter()
        .map(|(g, b, x)| {
            Ok((
                group_index(g, groups)?,
                non_negative("handoff block_id", b)?,
                non_negative("handoff boundary", x)?,
            ))
        })
        .collect()
}

// ---- payload parts and raw regions ----------------------------------------------------------

/// One payload part: a C-contiguous numpy array (any dtype, its bytes in memory order) or any
/// object `numpy.frombuffer` accepts (bytes, bytearray, memoryview, ctypes arrays, mmap).
/// Returns the (address, length) of its bytes; the array that owns them goes into `keep`,
/// which the caller holds until every use of the pair is over.
pub(super) fn payload_part<'py>(
    obj: &Bound<'py, PyAny>,
    keep: &mut Vec<Bound<'py, PyAny>>,
) -> PyResult<Part> {
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
pub(super) fn payload_parts<'py>(
    value: &Bound<'py, PyAny>,
    keep: &mut Vec<Bound<'py, PyAny>>,
) -> PyResult<Vec<Part>> {
    if value.is_instance_of::<PyList>() || value.is_instance_of::<PyTuple>() {
        value.try_iter()?.map(|p| payload_part(&p?, keep)).collect()
    } else {
        Ok(vec![payload_part(value, keep)?])
    }
}

/// Each value's parts (`payload_parts`), for a batch.
pub(super) fn values_parts<'py>(
    values: &Bound<'py, PyAny>,
    keep: &mut Vec<Bound<'py, PyAny>>,
) -> PyResult<Vec<Vec<Part>>> {
    values.try_iter()?.map(|v| payload_parts(&v?, keep)).collect()
}

/// A region array argument (addresses, lengths, row starts, digests): a C-contiguous uint64
/// numpy array, borrowed.
pub(super) fn region_slice<'a>(array: &'a PyReadonlyArray1<'_, u64>) -> PyResult<&'a [u64]> {
    array
        .as_slice()
        .map_err(|_| PyValueError::new_err("region arrays must be C-contiguous uint64"))
}
