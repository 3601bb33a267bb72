//! Synthetic rollout batches for benchmarks: the columns `rollout` writes, with realistic
//! sizes and a response text whose last line holds a GSM8K-style answer.

use crate::batch::{list_array, schema, NewColumns};
use crate::rng::SplitMix64;
use arrow_array::types::{Float32Type, Int32Type, UInt8Type};
use arrow_array::{ArrayRef, RecordBatch, StringArray};
use arrow_schema::{Field, Schema};
use rayon::prelude::*;
use std::sync::Arc;

/// Shape of a synthetic batch.
pub(crate) struct SynthSpec {
    pub(crate) rows: usize,
    pub(crate) response_tokens: usize,
    pub(crate) prompt_tokens: usize,
    /// Samples per prompt (rows sharing a prompt_uid).
    pub(crate) group: usize,
    pub(crate) seed: u64,
}

/// A batch as `rollout` would write it: ids, mask, logprobs, text with a `#### N` answer that is
/// right for about half of the rows.
pub(crate) fn rollout_batch(spec: &SynthSpec) -> RecordBatch {
    let n = spec.rows;
    let rows: Vec<(Vec<i32>, Vec<f32>, String, String)> = (0..n)
        .into_par_iter()
        .map(|i| {
            let mut rng = SplitMix64(spec.seed ^ (i as u64).wrapping_mul(0x2545_F491_4F6C_DD1D));
            let ids: Vec<i32> = (0..spec.response_tokens)
                .map(|_| (rng.next_u64() % 151_936) as i32)
                .collect();
            let lps: Vec<f32> = (0..spec.response_tokens)
                .map(|_| -5.0 * rng.uniform() as f32)
                .collect();
            let truth = (i / spec.group * 7 % 1000).to_string();
            let answer = if rng.next_u64().is_multiple_of(2) {
                truth.clone()
            } else {
                (rng.next_u64() % 1000).to_string()
            };
            // ~4 characters per token, as in English text.
            let mut text = String::with_capacity(spec.response_tokens * 4 + 16);
            while text.len() + 12 < spec.response_tokens * 4 {
                text.push_str(
                    ["So ", "we ", "add ", "12 ", "and ", "then ", "get ", "34. "]
                        [(rng.next_u64() % 8) as usize],
                );
            }
            text.push_str("#### ");
            text.push_str(&answer);
            (ids, lps, text, truth)
        })
        .collect();
    let offsets: Vec<usize> = (0..=n).map(|i| i * spec.response_tokens).collect();
    let prompt_offsets: Vec<usize> = (0..=n).map(|i| i * spec.prompt_tokens).collect();
    let strings = |f: &dyn Fn(usize) -> String| -> ArrayRef {
        Arc::new(StringArray::from_iter_values((0..n).map(f)))
    };
    let mut cols = NewColumns::new();
    cols.add(schema::UID, strings(&|i| format!("u{i}")))
        .add(
            schema::PROMPT_UID,
            strings(&|i| format!("p{}", i / spec.group)),
        )
        .add(schema::DATA_SOURCE, strings(&|_| "openai/gsm8k".into()))
        .add_field(
            Field::new(schema::GROUND_TRUTH, arrow_schema::DataType::Utf8, false),
            strings(&|i| rows[i].3.clone()),
        )
        .add(
            schema::PROMPT_IDS,
            list_array::<Int32Type>(
                &prompt_offsets,
                (0..n * spec.prompt_tokens)
                    .map(|j| (j % 5000) as i32)
                    .collect(),
            ),
        )
        .add(
            schema::RESPONSE_IDS,
            list_array::<Int32Type>(
                &offsets,
                rows.iter().flat_map(|r| r.0.iter().copied()).collect(),
            ),
        )
        .add(
            schema::RESPONSE_MASK,
            list_array::<UInt8Type>(&offsets, vec![1u8; n * spec.response_tokens]),
        )
        .add(
            schema::RESPONSE_TEXT,
            Arc::new(StringArray::from_iter_values(
                rows.iter().map(|r| r.2.as_str()),
            )),
        )
        .add(schema::FINISH_REASON, strings(&|_| "stop".into()))
        .add(
            schema::ROLLOUT_LOGPROBS,
            list_array::<Float32Type>(
                &offsets,
                rows.iter().flat_map(|r| r.1.iter().copied()).collect(),
            ),
        );
    let (fields, arrays): (Vec<Field>, Vec<ArrayRef>) = cols.into_parts().into_iter().unzip();
    RecordBatch::try_new(Arc::new(Schema::new(fields)), arrays).expect("synthetic batch")
}
