//! Token embedding lookup and its scatter-add backward.

use anyhow::{bail, Result};
use rayon::prelude::*;

use super::EmbeddingOps;
use crate::backend::cpu::{get, get_mut, Cpu};

fn check_ids(ids: &[u32], table_len: usize, dim: usize) -> Result<()> {
    let vocab = table_len / dim.max(1);
    if let Some((t, &id)) = ids.iter().enumerate().find(|(_, &id)| id as usize >= vocab) {
        bail!("embedding: token id {id} at row {t} is outside the vocabulary ({vocab})");
    }
    Ok(())
}

/// out[t,:] = table[ids[t],:].
pub fn forward(out: &mut [f32], table: &[f32], ids: &[u32], dim: usize) -> Result<()> {
    check_ids(ids, table.len(), dim)?;
    out.par_chunks_mut(dim.max(1))
        .zip(ids.par_iter())
        .for_each(|(o, &id)| o.copy_from_slice(&table[id as usize * dim..(id as usize + 1) * dim]));
    Ok(())
}

/// dtable[ids[t],:] += dout[t,:].
pub fn backward(dtable: &mut [f32], dout: &[f32], ids: &[u32], dim: usize) -> Result<()> {
    check_ids(ids, dtable.len(), dim)?;
    // Serial on purpose: ids repeat, and tokens·dim adds are noise next to the GEMMs.
    for (t, &id) in ids.iter().enumerate() {
        let row = &mut dtable[id as usize * dim..(id as usize + 1) * dim];
        row.iter_mut()
            .zip(&dout[t * dim..(t + 1) * dim])
            .for_each(|(d, g)| *d += g);
    }
    Ok(())
}

impl EmbeddingOps for Cpu {
    fn embedding(
        &self,
        out: &mut Vec<f32>,
        table: &Vec<f32>,
        ids: &Vec<u32>,
        tokens: usize,
        dim: usize,
    ) -> Result<()> {
        forward(
            get_mut(out, tokens * dim, "embedding out")?,
            table,
            get(ids, tokens, "embedding ids")?,
            dim,
        )
    }
    fn embedding_backward(
        &self,
        dtable: &mut Vec<f32>,
        dout: &Vec<f32>,
        ids: &Vec<u32>,
        tokens: usize,
        dim: usize,
    ) -> Result<()> {
        backward(
            dtable,
            get(dout, tokens * dim, "embedding dout")?,
            get(ids, tokens, "embedding ids")?,
            dim,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookup_and_scatter_add_with_repeated_ids() {
        let table: Vec<f32> = (0..12).map(|i| i as f32).collect(); // vocab 4, dim 3
        let ids = [2u32, 0, 2];
        let mut out = vec![0.0; 9];
        forward(&mut out, &table, &ids, 3).unwrap();
        assert_eq!(out, [6., 7., 8., 0., 1., 2., 6., 7., 8.]);
        let mut d = vec![0.0; 12];
        let dout: Vec<f32> = (1..=9).map(|i| i as f32).collect();
        backward(&mut d, &dout, &ids, 3).unwrap();
        assert_eq!(d, [4., 5., 6., 0., 0., 0., 8., 10., 12., 0., 0., 0.]);
    }

    #[test]
    fn id_outside_vocab_is_an_error() {
        let mut out = vec![0.0; 3];
        let err = forward(&mut out, &[0.0; 12], &[4], 3).unwrap_err();
        assert!(err.to_string().contains("token id 4 at row 0"), "{err}");
    }
}
