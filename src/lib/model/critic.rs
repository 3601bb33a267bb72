//! A value model (a critic) made from a policy, as verl's critic starts: the policy's
//! weights with its LM head dropped and a `score` head (hidden -> 1, with a bias) set to zero,
//! so every value is 0 until the critic trains. Its checkpoint is HF's token classifier with
//! one label (`Config::value_head`), which transformers opens as `*ForTokenClassification`.

use super::names::{LM_HEAD, VALUE_BIAS, VALUE_HEAD};
use super::{Config, Tensor, Weights};

/// The value model of a policy `(cfg, weights)`; a value model is returned as it is.
pub fn value_model_from(cfg: &Config, mut weights: Weights) -> (Config, Weights) {
    if cfg.value_head {
        return (cfg.clone(), weights);
    }
    weights.remove(LM_HEAD);
    let d = cfg.hidden_size;
    weights.insert(VALUE_HEAD.into(), Tensor::zeros(vec![1, d]));
    weights.insert(VALUE_BIAS.into(), Tensor::zeros(vec![1]));
    let cfg = Config {
        value_head: true,
        ..cfg.clone()
    };
    (cfg, weights)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::init::random_weights;
    use crate::model::names::expected_tensors;

    #[test]
    fn a_policy_becomes_a_critic_with_a_zero_head() {
        for tied in [true, false] {
            let cfg = Config {
                tie_word_embeddings: tied,
                ..Config::small_qwen2()
            };
            let w = random_weights(&cfg, 1, 0.1);
            let (c, v) = value_model_from(&cfg, w.clone());
            assert!(c.value_head && !cfg.value_head);
            let names: Vec<String> = expected_tensors(&c).into_iter().map(|s| s.name).collect();
            let mut have: Vec<String> = v.keys().cloned().collect();
            have.sort();
            let mut want = names.clone();
            want.sort();
            assert_eq!(have, want, "tied {tied}");
            assert_eq!(v[VALUE_HEAD].shape, vec![1, cfg.hidden_size]);
            assert!(v[VALUE_HEAD].data.iter().all(|&x| x == 0.0));
            assert_eq!(v[VALUE_BIAS].data, vec![0.0]);
            // The trunk is the policy's, untouched.
            assert_eq!(v["model.norm.weight"], w["model.norm.weight"]);
            // Converting a critic again changes nothing.
            let (c2, v2) = value_model_from(&c, v.clone());
            assert_eq!((c2, v2), (c, v));
        }
    }
}
