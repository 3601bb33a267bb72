//! Ragged (variable-length per row) arrays: the in-memory form of list columns.

use arrow_array::{ArrayRef, ArrowPrimitiveType, ListArray, PrimitiveArray};
use arrow_buffer::{OffsetBuffer, ScalarBuffer};
use arrow_schema::Field;
use std::borrow::Cow;
use std::sync::Arc;

/// Rows of values stored back to back: row `i` is `values[offsets[i]..offsets[i + 1]]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Ragged<'a, T: Clone> {
    pub offsets: Vec<usize>,
    pub values: Cow<'a, [T]>,
}

impl<T: Clone> Ragged<'_, T> {
    pub fn num_rows(&self) -> usize {
        self.offsets.len() - 1
    }

    pub fn row(&self, i: usize) -> &[T] {
        &self.values[self.offsets[i]..self.offsets[i + 1]]
    }

    pub fn rows(&self) -> impl Iterator<Item = &[T]> {
        (0..self.num_rows()).map(move |i| self.row(i))
    }
}

/// Build an Arrow list column (non-null rows and items) from ragged values.
pub fn list_array<P: ArrowPrimitiveType>(offsets: &[usize], values: Vec<P::Native>) -> ArrayRef {
    let item = Arc::new(Field::new_list_field(P::DATA_TYPE, false));
    let offs: Vec<i32> = offsets
        .iter()
        .map(|&o| i32::try_from(o).expect("list column over 2^31 values"))
        .collect();
    let values = PrimitiveArray::<P>::new(ScalarBuffer::from(values), None);
    Arc::new(ListArray::new(
        item,
        OffsetBuffer::new(ScalarBuffer::from(offs)),
        Arc::new(values),
        None,
    ))
}
