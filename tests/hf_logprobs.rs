//! Agreement with HF transformers: the log-probs and entropies our decoder computes for the
//! tiny models of `tests/fixtures/hf/{qwen2,llama,qwen3}` equal the ones transformers computed
//! (float32, eager attention; `tests/fixtures/make_hf_fixtures.py`) within 1e-4.

use std::path::Path;

use tandem::backend::cpu::Cpu;
use tandem::model::decoder::{Decoder, SeqRef};
use tandem::model::ModelDir;

struct Case {
    tokens: Vec<u32>,
    temperature: f32,
    logprobs: Vec<f32>,
    entropy: Vec<f32>,
}

fn cases(dir: &Path) -> Vec<Case> {
    let text = std::fs::read_to_string(dir.join("expected.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let floats = |x: &serde_json::Value| -> Vec<f32> {
        x.as_array()
            .unwrap()
            .iter()
            .map(|f| f.as_f64().unwrap() as f32)
            .collect()
    };
    v["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| Case {
            tokens: c["tokens"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_u64().unwrap() as u32)
                .collect(),
            temperature: c["temperature"].as_f64().unwrap() as f32,
            logprobs: floats(&c["logprobs"]),
            entropy: floats(&c["entropy"]),
        })
        .collect()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn logprobs_and_entropy_match_transformers() {
    for model in ["qwen2", "llama", "qwen3"] {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/hf")
            .join(model);
        let (cfg, weights) = ModelDir::load(&dir).unwrap();
        let mut dec = Decoder::new(Cpu, &cfg, &weights).unwrap();
        let cases = cases(&dir);
        assert!(cases.len() >= 4, "{model}: too few cases");
        let mut worst = 0f32;
        for temp in [1.0f32, 0.7] {
            // All cases of one temperature packed in one call, so packing is covered too.
            let mine: Vec<&Case> = cases.iter().filter(|c| c.temperature == temp).collect();
            let seqs: Vec<SeqRef> = mine
                .iter()
                .map(|c| SeqRef {
                    tokens: &c.tokens,
                    start: 1,
                })
                .collect();
            let got = dec.logprobs(&seqs, temp, true).unwrap();
            for (c, g) in mine.iter().zip(&got) {
                let d = max_diff(&g.logprobs, &c.logprobs)
                    .max(max_diff(g.entropy.as_ref().unwrap(), &c.entropy));
                assert!(
                    d <= 1e-4,
                    "{model} T={temp} len {}: |Δ| = {d:e}",
                    c.tokens.len()
                );
                worst = worst.max(d);
            }
        }
        eprintln!("{model}: max |Δ| vs transformers {worst:.2e}");
    }
}
