//! Memory of a full-sharded (`shard = "full"`) training pass, counted by this binary's global
//! allocator on the CPU backend (whose buffers are heap allocations). A daemon group frees its
//! gradients after each update (`release_grads`); the next update's passes must still
//! allocate each unit's gradients only for its backward, not the whole model's f32 gradients
//! (4 bytes a parameter: 30 GB at 7B, what made the second 7B step run out of memory on 80 GB
//! GPUs). One test in this binary, so nothing else allocates while it measures.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};

use tandem::backend::cpu::Cpu;
use tandem::dist::{HostComm, Options, ProcessGroup, World};
use tandem::model::decoder::{Decoder, Holding, PassComm, SeqRef, TokenGrads, TokenStats};
use tandem::model::{init, Arch, Config};

struct Counting;
static NOW: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn grew(n: usize) {
    let now = NOW.fetch_add(n, SeqCst) + n;
    PEAK.fetch_max(now, SeqCst);
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        grew(l.size());
        System.alloc(l)
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        grew(l.size());
        System.alloc_zeroed(l)
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        System.dealloc(p, l);
        NOW.fetch_sub(l.size(), SeqCst);
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

/// Bytes allocated at the peak of `f` above what was held when it started.
fn peak_of(f: impl FnOnce()) -> usize {
    let base = NOW.load(SeqCst);
    PEAK.store(base, SeqCst);
    f();
    PEAK.load(SeqCst) - base
}

#[test]
fn a_full_shard_pass_after_release_grads_holds_no_whole_gradients() {
    // Many layers and few tokens: a unit is small against the whole model, so whole f32
    // gradients would show.
    let cfg = Config {
        arch: Arch::Qwen2,
        vocab_size: 256,
        hidden_size: 128,
        intermediate_size: 512,
        num_layers: 8,
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 32,
        rope_theta: 10_000.0,
        rms_norm_eps: 1e-6,
        tie_word_embeddings: false,
        qkv_bias: true,
        qk_norm: false,
        max_position_embeddings: 512,
        bos_token_id: None,
        eos_token_ids: vec![0],
    };
    let weights = init::random_weights(&cfg, 1, 0.02);
    let params: usize = weights.values().map(|t| t.data.len()).sum();
    let whole_grads = 4 * params;
    let pg = ProcessGroup::new(World::single(), Options::from_env().unwrap()).unwrap();
    let comm = HostComm::new(&pg).unwrap();
    let mut dec = Decoder::new(Cpu, &cfg, &weights).unwrap();
    drop(weights);
    // One chunk of logits for 32 rows (the backend's default is sized for the GPU).
    dec.logprob_chunk = 32;
    let mut st = dec.shard_full(&comm).unwrap();
    st.zero_grads(&Cpu).unwrap();
    let toks: Vec<Vec<u32>> = (0..2)
        .map(|s| (0..16).map(|i| ((i * 7 + s) % 256) as u32).collect())
        .collect();
    let seqs: Vec<SeqRef> = toks
        .iter()
        .map(|t| SeqRef {
            tokens: t,
            start: 4,
        })
        .collect();
    let mut pass = |dec: &mut Decoder<Cpu>| {
        let mut loss = |s: &[TokenStats]| -> anyhow::Result<Vec<TokenGrads>> {
            Ok(s.iter()
                .map(|s| TokenGrads {
                    dlogprobs: vec![0.01; s.logprobs.len()],
                    dentropy: None,
                })
                .collect())
        };
        let mut hold = Holding::new(&comm, &mut st);
        dec.forward_backward_with(&seqs, 1.0, &mut loss, PassComm::Held(&mut hold))
            .unwrap();
    };
    // The first pass also builds the workspace; the second is the steady state.
    pass(&mut dec);
    let steady = peak_of(|| pass(&mut dec));
    // What a daemon group does after each update, before the next one's passes.
    dec.release_grads();
    let after_release = peak_of(|| pass(&mut dec));
    assert!(
        after_release <= steady + whole_grads / 8,
        "after release_grads the pass peaked at {after_release} B against {steady} B before (whole f32 gradients: {whole_grads} B)"
    );
    drop(comm);
    pg.finish().unwrap();
}
