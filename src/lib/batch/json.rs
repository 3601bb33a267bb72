//! One cell of an arbitrary Arrow column as JSON (for reward functions that receive
//! `extra_info` and ground truths of any shape).

use arrow_array::cast::AsArray;
use arrow_array::types::*;
use arrow_array::Array;
use arrow_schema::DataType;
use serde_json::{json, Map, Value};

/// The value at `row` as JSON. Types without a natural JSON form become their debug text.
pub fn value(col: &dyn Array, row: usize) -> Value {
    if col.is_null(row) {
        return Value::Null;
    }
    macro_rules! prim {
        ($t:ty) => {
            json!(col.as_primitive::<$t>().value(row))
        };
    }
    match col.data_type() {
        DataType::Boolean => json!(col.as_boolean().value(row)),
        DataType::Int8 => prim!(Int8Type),
        DataType::Int16 => prim!(Int16Type),
        DataType::Int32 => prim!(Int32Type),
        DataType::Int64 => prim!(Int64Type),
        DataType::UInt8 => prim!(UInt8Type),
        DataType::UInt16 => prim!(UInt16Type),
        DataType::UInt32 => prim!(UInt32Type),
        DataType::UInt64 => prim!(UInt64Type),
        DataType::Float32 => prim!(Float32Type),
        DataType::Float64 => prim!(Float64Type),
        DataType::Utf8 => json!(col.as_string::<i32>().value(row)),
        DataType::LargeUtf8 => json!(col.as_string::<i64>().value(row)),
        DataType::Utf8View => json!(col.as_string_view().value(row)),
        DataType::List(_) => list(col.as_list::<i32>().value(row).as_ref()),
        DataType::LargeList(_) => list(col.as_list::<i64>().value(row).as_ref()),
        DataType::Struct(fields) => {
            let s = col.as_struct();
            let mut m = Map::new();
            for (i, f) in fields.iter().enumerate() {
                m.insert(f.name().clone(), value(s.column(i).as_ref(), row));
            }
            Value::Object(m)
        }
        other => json!(format!("<{other}>")),
    }
}

fn list(items: &dyn Array) -> Value {
    Value::Array((0..items.len()).map(|i| value(items, i)).collect())
}

/// The value as text: strings as they are, everything else as compact JSON.
pub(crate) fn value_text(col: &dyn Array, row: usize) -> String {
    match value(col, row) {
        Value::String(s) => s,
        Value::Null => String::new(),
        v => v.to_string(),
    }
}
