//! Host memory, counted by this binary's global allocator (the CPU backend's buffers are heap
//! allocations too), of what grows with the model under sharding:
//! - a full-sharded (`shard = "full"`) training pass: a daemon group frees its gradients after
//!   each update (`release_grads`); the next update's passes must still allocate each unit's
//!   gradients only for its backward, not the whole model's f32 gradients (4 bytes a parameter:
//!   30 GB at 7B, what made the second 7B step run out of memory on 80 GB GPUs);
//! - writing an optimizer shard or the whole optimizer file: streamed from the tensors, with
//!   no copy of the file in memory (a 7B shape's optimizer state is 91 GB).
//!
//! The tests take one lock, so nothing else allocates while one measures.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Mutex;

use tandem::backend::cpu::Cpu;
use tandem::engine::resume::{shard_file_name, write_optimizer, write_shard};
use tandem::engine::shard::{Holding, HostShard, ShardLayout, ShardedOptim};
use tandem::model::decoder::{Decoder, OptimizerState, SeqRef, TokenGrads, TokenStats};
use tandem::model::{init, Arch, Config, Tensor, Weights};
use tandem::parallel::{HostComm, Options, ProcessGroup, World};

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

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Bytes allocated at the peak of `f` above what was held when it started.
fn peak_of(f: impl FnOnce()) -> usize {
    let base = NOW.load(SeqCst);
    PEAK.store(base, SeqCst);
    f();
    PEAK.load(SeqCst) - base
}

#[test]
fn a_full_shard_pass_after_release_grads_holds_no_whole_gradients() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
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
        value_head: false,
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
    let mut st = ShardedOptim::full(&mut dec, &comm).unwrap();
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
        dec.forward_backward_with(&seqs, 1.0, &mut loss, &mut hold)
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

#[test]
fn optimizer_files_are_written_without_a_copy_in_memory() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let dir = tempfile::tempdir().unwrap();
    // 3 buckets of 1 Mi floats: 12 MiB of masters and moments each, 36 MiB in all.
    let n = 1 << 20;
    let buckets = |base: f32| -> Vec<Vec<f32>> {
        (0..3)
            .map(|k| (0..n).map(|i| base + (k * n + i) as f32).collect())
            .collect()
    };
    let shard = HostShard {
        rank: 0,
        layout: ShardLayout {
            world_size: 1,
            names: vec!["w".into()],
            shapes: vec![vec![3 * n]],
            buckets: (0..3).map(|k| (0, 1, vec![k * n], n, n)).collect(),
        },
        step: 1,
        master: buckets(0.0),
        moments: Some((buckets(1.0), buckets(2.0))),
    };
    let file_bytes = 9 * n * 4;
    let peak = peak_of(|| write_shard(dir.path(), &shard).unwrap());
    assert!(
        peak < file_bytes / 8,
        "writing a {file_bytes} B shard file held {peak} B more at its peak"
    );
    let written = std::fs::metadata(dir.path().join(shard_file_name(0, 1)))
        .unwrap()
        .len() as usize;
    assert!(written > file_bytes, "{written} B written");

    let tensor = |base: f32| Tensor {
        data: (0..3 * n).map(|i| base + i as f32).collect(),
        shape: vec![3 * n],
    };
    let master: Weights = [("w".to_string(), tensor(0.0))].into_iter().collect();
    let state = OptimizerState {
        step: 1,
        exp_avg: [("w".to_string(), tensor(1.0))].into_iter().collect(),
        exp_avg_sq: [("w".to_string(), tensor(2.0))].into_iter().collect(),
    };
    let path = dir.path().join("optimizer.safetensors");
    let peak = peak_of(|| write_optimizer(&path, &state, &master).unwrap());
    assert!(
        peak < file_bytes / 8,
        "writing a {file_bytes} B optimizer file held {peak} B more at its peak"
    );
    assert!(std::fs::metadata(&path).unwrap().len() as usize > file_bytes);
}
