//! Data-parallel `update` through the real binaries: `tandem launch --nproc-per-node N --
//! update ...` on the CPU backend and the CPU communicator trains with the sharded optimizer
//! (rows shared out by token count, global loss normalisation, gradients reduce-scattered,
//! AdamW on 1/N of the masters and moments, weights all-gathered). After 3 optimizer steps
//! the f32 masters and Adam moments of 1 (launched), 2 and 3 ranks equal one process's, and so do the
//! metrics, also with `--shard full` (FSDP: the compute weights sharded too); rank 0 alone
//! writes the outputs; a bad --bucket-elems or --shard is refused. A rank killed
//! (SIGKILL) in the middle of an update stops the other within 60 s, naming it, with nothing
//! written; the rerun, undisturbed, ends where one process does.

use crate::stage_util;

use arrow_array::types::{Float32Type, Int32Type, UInt8Type};
use arrow_array::{ArrayRef, RecordBatch, StringArray};
use arrow_schema::{Field, Schema};
use serde_json::Value;
use stage_util::*;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use tandem::batch::{list_array, schema, write_file};
use tandem::model::init::Like;
use tandem::model::Weights;

const TANDEM: &str = env!("CARGO_BIN_EXE_tandem");

/// Launcher and rendezvous variables a test environment might carry.
const LAUNCH_VARS: [&str; 14] = [
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TANDEM_DIST_TIMEOUT",
    "TANDEM_DIST_ERROR_FILE",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "SLURM_NODEID",
    "SLURM_JOB_ID",
];

/// Rows of varied lengths with varied advantages (prompt ids, response ids, advantage).
fn batch(path: &Path) {
    let rows: Vec<(Vec<i32>, Vec<i32>, f32)> = vec![
        (vec![10, 20, 30], vec![40, 41, 42, 43, 44, 45], 1.0),
        (vec![11, 21], vec![50, 51], -1.0),
        (vec![12, 22, 32, 42], vec![60, 61, 62], 0.5),
        (vec![13], vec![70, 71, 72, 73, 74, 75, 76, 77, 78], -0.5),
        (vec![14, 24, 34], vec![80], 2.0),
        (vec![15, 25], vec![90, 91, 92, 93], -1.5),
        (vec![16, 26, 36], vec![100, 101, 102, 103, 104], 0.25),
    ];
    let n = rows.len();
    let (mut p_off, mut p_ids, mut r_off, mut r_ids, mut adv) =
        (vec![0], vec![], vec![0], vec![], vec![]);
    for (p, r, a) in &rows {
        p_ids.extend_from_slice(p);
        p_off.push(p_ids.len());
        r_ids.extend_from_slice(r);
        r_off.push(r_ids.len());
        adv.extend(std::iter::repeat_n(*a, r.len()));
    }
    let total = r_ids.len();
    // The last token of row 3 is masked out: the counts the normalisation needs differ from
    // the token counts.
    let mut mask = vec![1u8; total];
    mask[r_off[4] - 1] = 0;
    let cols: Vec<(Field, ArrayRef)> = vec![
        (
            schema::field(schema::UID),
            Arc::new(StringArray::from_iter_values(
                (0..n).map(|i| format!("u{i}")),
            )),
        ),
        (
            schema::field(schema::PROMPT_UID),
            Arc::new(StringArray::from_iter_values(
                (0..n).map(|i| format!("p{}", i / 2)),
            )),
        ),
        (
            schema::field(schema::PROMPT_IDS),
            list_array::<Int32Type>(&p_off, p_ids),
        ),
        (
            schema::field(schema::RESPONSE_IDS),
            list_array::<Int32Type>(&r_off, r_ids),
        ),
        (
            schema::field(schema::RESPONSE_MASK),
            list_array::<UInt8Type>(&r_off, mask),
        ),
        (
            schema::field(schema::ADVANTAGES),
            list_array::<Float32Type>(&r_off, adv),
        ),
    ];
    let (fields, arrays): (Vec<Field>, Vec<ArrayRef>) = cols.into_iter().unzip();
    let rb = RecordBatch::try_new(Arc::new(Schema::new(fields)), arrays).unwrap();
    write_file(path, &rb, &Default::default()).unwrap();
}

/// `update` of `model` on `input` into `out` with `extra` flags: one process (`ranks` 0) or
/// `ranks` ranks under `tandem launch`. Returns the metrics.
fn update(ranks: usize, model: &Path, input: &Path, out: &Path, extra: &[&str]) -> Value {
    let metrics = out.with_extension("json");
    let o = update_cmd(ranks, model, input, out, extra)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "update on {ranks} ranks failed ({:?}):\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stderr)
    );
    serde_json::from_slice(&std::fs::read(&metrics).unwrap()).unwrap()
}

/// The command [`update`] runs (a flag of `extra` replaces its default here).
fn update_cmd(ranks: usize, model: &Path, input: &Path, out: &Path, extra: &[&str]) -> Command {
    let metrics = out.with_extension("json");
    let mut args: Vec<String> = [
        ("--model", p(model)),
        ("--in", p(input)),
        ("--out-model", p(out)),
        ("--metrics", p(&metrics)),
        ("--lr", "1e-3"),
        ("--mini-batch-size", "3"),
        ("--micro-batch-tokens", "12"),
        ("--grad-clip", "0.5"),
    ]
    .into_iter()
    .filter(|(flag, _)| !extra.contains(flag))
    .flat_map(|(flag, v)| [flag.to_string(), v.to_string()])
    .collect();
    args.extend(extra.iter().map(|s| s.to_string()));
    let mut cmd = match ranks {
        0 => Command::new(bin("update")),
        n => {
            let mut c = Command::new(TANDEM);
            c.args(["launch", "--nproc-per-node", &n.to_string(), "--"])
                .arg(bin("update"));
            c
        }
    };
    for k in LAUNCH_VARS {
        cmd.env_remove(k);
    }
    cmd.args(&args).env("RAYON_NUM_THREADS", "1");
    cmd
}

/// The f32 masters, exp_avg and exp_avg_sq written next to the model (put back together from
/// the ranks' shard files of a sharded checkpoint).
fn state(dir: &Path) -> [Weights; 3] {
    if !dir.join("optimizer.safetensors").exists() {
        let (master, st) = tandem::engine::resume::whole_from_shards(dir).unwrap();
        return [master, st.exp_avg, st.exp_avg_sq];
    }
    let (_, weights) = tandem::model::ModelDir::load(dir).unwrap();
    let r = tandem::engine::resume::load(dir, &weights)
        .unwrap()
        .expect("optimizer state");
    [
        r.master.expect("f32 masters"),
        r.optimizer.exp_avg,
        r.optimizer.exp_avg_sq,
    ]
}

/// ‖a − b‖ / ‖b‖ over every tensor.
pub(crate) fn rel_err(a: &Weights, b: &Weights) -> f64 {
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    let (mut d, mut n) = (0f64, 0f64);
    for (k, t) in b {
        let u = &a[k];
        assert_eq!(u.shape, t.shape, "{k}");
        for (x, y) in u.data.iter().zip(&t.data) {
            d += ((x - y) as f64).powi(2);
            n += (*y as f64).powi(2);
        }
    }
    (d / n.max(f64::MIN_POSITIVE)).sqrt()
}

/// How two model directories' bf16 weight files differ, element by element.
struct Bf16Diff {
    /// Tensors with any element that differs, of all.
    tensors: (usize, usize),
    /// Elements that differ, per million.
    ppm: usize,
    /// Elements more than one bf16 step (ulp) apart.
    over_one_step: usize,
    /// The largest difference, relative to its tensor's largest magnitude.
    max_rel: f32,
}

fn bf16_diff(a: &Path, b: &Path) -> Bf16Diff {
    let (fa, fb) = (
        std::fs::read(a.join("model.safetensors")).unwrap(),
        std::fs::read(b.join("model.safetensors")).unwrap(),
    );
    let (sa, sb) = (
        safetensors::SafeTensors::deserialize(&fa).unwrap(),
        safetensors::SafeTensors::deserialize(&fb).unwrap(),
    );
    let values = |t: &safetensors::tensor::TensorView| -> Vec<u16> {
        assert_eq!(t.dtype(), safetensors::Dtype::BF16);
        let d = t.data();
        d.chunks_exact(2)
            .map(|x| u16::from_le_bytes([x[0], x[1]]))
            .collect()
    };
    let f = |bits: u16| f32::from_bits((bits as u32) << 16);
    // bf16 bits as a position on the number line: adjacent values are one apart.
    let order = |bits: u16| -> i32 {
        match bits & 0x8000 {
            0 => bits as i32,
            _ => -((bits & 0x7fff) as i32),
        }
    };
    let names = sa.names();
    let mut d = Bf16Diff {
        tensors: (0, names.len()),
        ppm: 0,
        over_one_step: 0,
        max_rel: 0.0,
    };
    let (mut elems, mut total) = (0usize, 0usize);
    for name in &names {
        let (x, y) = (
            values(&sa.tensor(name).unwrap()),
            values(&sb.tensor(name).unwrap()),
        );
        let scale = x
            .iter()
            .map(|&v| f(v).abs())
            .fold(0f32, f32::max)
            .max(f32::MIN_POSITIVE);
        total += x.len();
        let before = elems;
        for (&u, &v) in x.iter().zip(&y).filter(|(u, v)| u != v) {
            elems += 1;
            d.over_one_step += usize::from(order(u).abs_diff(order(v)) > 1);
            d.max_rel = d.max_rel.max((f(u) - f(v)).abs() / scale);
        }
        d.tensors.0 += usize::from(elems > before);
    }
    d.ppm = elems * 1_000_000 / total.max(1);
    d
}

fn close(a: &Value, b: &Value, what: &str) {
    let (x, y) = (a.as_f64().unwrap(), b.as_f64().unwrap());
    assert!(
        (x - y).abs() <= 1e-5 * y.abs().max(1e-3),
        "{what}: {x} vs one rank's {y}"
    );
}

fn same_training(one: &Value, many: &Value, ranks: usize) {
    for k in [
        "loss",
        "pg_loss",
        "pg_clipfrac",
        "pg_clipfrac_lower",
        "ppo_kl",
        "entropy",
        "grad_norm",
    ] {
        close(&many[k], &one[k], &format!("{ranks} ranks: {k}"));
    }
    for k in ["optimizer_steps", "tokens", "lr"] {
        assert_eq!(many[k], one[k], "{ranks} ranks: {k}");
    }
    assert!(one.get("shard").is_none(), "one process: {one}");
    let s = &many["shard"];
    assert_eq!(s["world_size"], ranks, "{many}");
    assert!(s["buckets"].as_u64().unwrap() > 1, "{s}");
    // Each rank receives every bucket, padded, in f32 (the CPU's compute type), per step.
    let padded = s["shard_elems"].as_u64().unwrap() * ranks as u64;
    assert_eq!(
        s["weight_sync_bytes"].as_u64().unwrap(),
        3 * 4 * padded,
        "{s}"
    );
    assert!(s["weight_sync_bytes"].as_u64().unwrap() > 0, "{s}");
    assert!(s["weight_sync_seconds"].as_f64().unwrap() > 0.0, "{s}");
    // Rank 0 (whose metrics these are) has rows in every step (the longest row goes to it):
    // each step's last backward started every bucket's reduce-scatter.
    let buckets = s["buckets"].as_u64().unwrap();
    assert_eq!(
        s["overlapped_buckets"].as_u64().unwrap(),
        3 * buckets,
        "{s}"
    );
}

#[test]
fn two_and_three_ranks_train_as_one() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path(), 21);
    let input = dir.path().join("batch.parquet");
    batch(&input);
    for (name, extra) in [
        ("token-mean", vec!["--bucket-elems", "5000"]),
        (
            "seq-mean-token-sum",
            vec![
                "--loss-agg-mode",
                "seq-mean-token-sum",
                "--bucket-elems",
                "3000",
            ],
        ),
    ] {
        let out = |r: usize| dir.path().join(format!("{name}-{r}"));
        let one = update(0, &model, &input, &out(1), &extra);
        assert_eq!(one["optimizer_steps"], 3, "{one}");
        let want = state(&out(1));
        // One rank under the launcher runs the data-parallel path too (a world of one).
        let ranks: &[usize] = if name == "token-mean" {
            &[1, 2, 3]
        } else {
            &[2]
        };
        for &n in ranks {
            let many = update(n, &model, &input, &out(n), &extra);
            same_training(&one, &many, n);
            let got = state(&out(n));
            for (i, what) in ["masters", "exp_avg", "exp_avg_sq"].iter().enumerate() {
                let e = rel_err(&got[i], &want[i]);
                eprintln!("{name}, {n} ranks: {what} relative error {e:.2e}");
                assert!(e <= 1e-6, "{name}, {n} ranks: {what} relative error {e}");
            }
            // The bf16 files round masters that differ in the last f32 bits (the ranks sum
            // gradients in another order): an element may land one bf16 step away, no further.
            // The bf16 files: the masters differ in their last bits (the ranks sum gradients
            // in another order), which moves a few elements by a rounding step, and a few more
            // where Adam divides by a gradient that is nearly zero.
            let d = bf16_diff(&out(n), &out(1));
            eprintln!(
                "{name}, {n} ranks: bf16 weights: {} of {} tensors differ, {} ppm of elements, \
                 {} by more than one step, at most {:.1e} of the tensor's largest |w|",
                d.tensors.0, d.tensors.1, d.ppm, d.over_one_step, d.max_rel
            );
            assert!(
                d.ppm <= 1000,
                "{name}, {n} ranks: {} ppm of bf16 weights differ",
                d.ppm
            );
            assert!(
                d.max_rel <= 5e-3,
                "{name}, {n} ranks: bf16 weights {:.1e} apart",
                d.max_rel
            );
            // The weights moved: the comparison is not of untouched models.
            let (_, start) = tandem::model::ModelDir::load(&model).unwrap();
            let moved = rel_err(&got[0], &start);
            assert!(
                moved > 1e-2,
                "{name}: training moved the weights by {moved} only"
            );
        }
    }
}

/// zero2's reduce-scatter overlapped with the backward of each rank's last pass, where the
/// ranks have different numbers of passes: with 8-token micro-batches on 2 ranks, rank 0 has
/// one pass in each of the first two steps and rank 1 two (rank 0 reduces during its first
/// pass, rank 1 during its second), and in the third step rank 1 has no row (it reduces
/// zeros after its passes, none). Buckets of 9000 elements span units (a layer's down
/// projection with the next layer's input norm, the last one's with the final norm), so a
/// bucket started before all its gradients are final would change the result. The untied
/// head (Llama) is final with the final norm. The masters and moments are one process's.
#[test]
fn ranks_with_different_numbers_of_passes_overlap_the_reduce_scatter() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("batch.parquet");
    batch(&input);
    let model = tiny_model_like(dir.path(), 25, Like::Llama, 0.02);
    let extra = ["--micro-batch-tokens", "8", "--bucket-elems", "9000"];
    let out = |r: usize| dir.path().join(format!("passes-{r}"));
    let one = update(0, &model, &input, &out(1), &extra);
    assert_eq!(one["optimizer_steps"], 3, "{one}");
    let many = update(2, &model, &input, &out(2), &extra);
    same_training(&one, &many, 2);
    let s = &many["shard"];
    // 2 layers: [in_norm, q, k, v], [o, post_norm], [gate], [up], [down, next in_norm...].
    assert!(s["buckets"].as_u64().unwrap() >= 10, "{s}");
    let (want, got) = (state(&out(1)), state(&out(2)));
    for (i, what) in ["masters", "exp_avg", "exp_avg_sq"].iter().enumerate() {
        let e = rel_err(&got[i], &want[i]);
        eprintln!("uneven passes, 2 ranks: {what} relative error {e:.2e}");
        assert!(e <= 1e-6, "uneven passes: {what} relative error {e}");
    }
    let (_, start) = tandem::model::ModelDir::load(&model).unwrap();
    assert!(rel_err(&got[0], &start) > 1e-2, "the weights did not move");
}

/// `--shard full` (FSDP): the compute weights sharded too, each unit gathered before its
/// forward and its backward, gradients reduce-scattered unit by unit; the same masters,
/// moments and metrics as one process, with a tied head (Qwen2) and an untied one (Llama).
#[test]
fn full_sharding_on_two_and_three_ranks_trains_as_one() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("batch.parquet");
    batch(&input);
    for (seed, like, ranks) in [
        (23, Like::Qwen2, &[2usize, 3][..]),
        (24, Like::Llama, &[2][..]),
    ] {
        let model = tiny_model_like(dir.path(), seed, like, 0.02);
        let name = format!("{like:?}");
        let out = |r: usize| dir.path().join(format!("full-{name}-{r}"));
        let one = update(0, &model, &input, &out(1), &[]);
        assert_eq!(one["optimizer_steps"], 3, "{one}");
        let want = state(&out(1));
        for &n in ranks {
            let many = update(n, &model, &input, &out(n), &["--shard", "full"]);
            for k in ["loss", "pg_loss", "pg_clipfrac", "entropy", "grad_norm"] {
                close(&many[k], &one[k], &format!("{name}, full, {n} ranks: {k}"));
            }
            // A mean of log-prob differences (-0.004 here): its error is the log-probs'
            // absolute one (zero2 is off by 1e-5 relative on the Llama model too).
            let (kl, kl1) = (
                many["ppo_kl"].as_f64().unwrap(),
                one["ppo_kl"].as_f64().unwrap(),
            );
            assert!(
                (kl - kl1).abs() <= 1e-6,
                "{name}, full, {n} ranks: ppo_kl {kl} vs {kl1}"
            );
            for k in ["optimizer_steps", "tokens", "lr"] {
                assert_eq!(many[k], one[k], "{name}, full, {n} ranks: {k}");
            }
            let s = &many["shard"];
            assert_eq!(s["mode"], "full", "{s}");
            assert_eq!(s["world_size"], n, "{s}");
            // One bucket per unit: the embedding, 2 layers, the final norm (and head).
            assert_eq!(s["buckets"], 4, "{s}");
            assert_eq!(s["weight_sync_bytes"], 0, "{s}");
            assert_eq!(s["overlapped_buckets"], 0, "{s}");
            assert!(s["unit_gathers"].as_u64().unwrap() >= 3 * 2 * 4, "{s}");
            assert!(s["unit_gather_bytes"].as_u64().unwrap() > 0, "{s}");
            // The checkpoint's state came to the hosts, and past one rank each rank wrote its
            // optimizer shard file (one rank writes the whole state with the model instead).
            assert!(s["state_gather_seconds"].as_f64().unwrap() > 0.0, "{s}");
            assert_eq!(
                s["shard_write_seconds"].as_f64().unwrap() > 0.0,
                n > 1,
                "{s}"
            );
            // The next unit's all-gather prefetched: a forward pass gathers the embedding, the
            // 2 layers and the head (its buckets: 1, or 2 when tied) and prefetches units − 1
            // = 3; a backward gathers the layers and prefetches 1. Rank 0's F forward and K
            // backward passes (empty ones included: a rank with no rows in a pass runs the
            // same collectives) follow from its gathers G = (4 + tied)·F + 2K and prefetches
            // P = 3F + K.
            let tied = matches!(like, Like::Qwen2) as i64;
            let g = s["unit_gathers"].as_i64().unwrap();
            let p = s["unit_prefetches"].as_i64().unwrap();
            assert_eq!((2 * p - g) % (2 - tied), 0, "{s}");
            let f = (2 * p - g) / (2 - tied);
            let k = p - 3 * f;
            eprintln!(
                "{name}, full, {n} ranks: {p} prefetches in {f} forward, {k} backward passes"
            );
            // A backward per training pass (3 optimizer steps: at least 3), each after a
            // forward.
            assert!(
                k >= 3 && f >= k,
                "{name}, {n} ranks: {f} forward, {k} backward: {s}"
            );
            let got = state(&out(n));
            for (i, what) in ["masters", "exp_avg", "exp_avg_sq"].iter().enumerate() {
                let e = rel_err(&got[i], &want[i]);
                eprintln!("{name}, full, {n} ranks: {what} relative error {e:.2e}");
                assert!(
                    e <= 1e-6,
                    "{name}, full, {n} ranks: {what} relative error {e}"
                );
            }
            let (_, start) = tandem::model::ModelDir::load(&model).unwrap();
            assert!(
                rel_err(&got[0], &start) > 1e-2,
                "{name}: the weights did not move"
            );
        }
        // Resumed from a checkpoint with optimizer state: each rank uploads its shards of the
        // masters and moments, and goes on as one process does.
        let again = |r: usize| dir.path().join(format!("full-{name}-{r}-again"));
        let one = update(0, &out(1), &input, &again(1), &[]);
        let many = update(2, &out(1), &input, &again(2), &["--shard", "full"]);
        assert_eq!(many["optimizer_step"], 6, "{many}");
        assert_eq!(many["optimizer_step"], one["optimizer_step"], "{many}");
        let (got, want) = (state(&again(2)), state(&again(1)));
        for (i, what) in ["masters", "exp_avg", "exp_avg_sq"].iter().enumerate() {
            let e = rel_err(&got[i], &want[i]);
            eprintln!("{name}, full, resumed: {what} relative error {e:.2e}");
            assert!(
                e <= 1e-6,
                "{name}, full, resumed: {what} relative error {e}"
            );
        }
    }
}

#[test]
fn a_bad_shard_mode_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let err = input_error(
        "update",
        &[
            "--model",
            "m",
            "--in",
            "b.parquet",
            "--out-model",
            p(&dir.path().join("o")),
            "--shard",
            "zero3",
        ],
        "--shard",
    );
    assert!(err.contains("full") && err.contains("zero2"), "{err}");
}

#[test]
fn a_bad_bucket_size_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    input_error(
        "update",
        &[
            "--model",
            "m",
            "--in",
            "b.parquet",
            "--out-model",
            p(&dir.path().join("o")),
            "--bucket-elems",
            "0",
        ],
        "--bucket-elems",
    );
}

#[test]
fn a_killed_rank_stops_the_others_naming_it_and_the_rerun_trains_as_one() {
    use std::io::{BufRead, BufReader};
    use std::process::Stdio;
    use std::time::{Duration, Instant};
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path(), 22);
    let input = dir.path().join("batch.parquet");
    batch(&input);
    // Enough optimizer steps that the update is still running when rank 1 is killed.
    let long = ["--ppo-epochs", "100", "--bucket-elems", "5000"];
    let killed = dir.path().join("killed");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut ranks: Vec<_> = (0..2)
        .map(|r| {
            let mut c = Command::new(bin("update"));
            for k in LAUNCH_VARS {
                c.env_remove(k);
            }
            c.args([
                "--model",
                p(&model),
                "--in",
                p(&input),
                "--out-model",
                p(&killed),
                "--lr",
                "1e-3",
                "--mini-batch-size",
                "3",
                "--micro-batch-tokens",
                "12",
            ])
            .args(long)
            .envs([
                ("RANK", r.to_string()),
                ("WORLD_SIZE", "2".into()),
                ("LOCAL_RANK", r.to_string()),
                ("LOCAL_WORLD_SIZE", "2".into()),
                ("MASTER_ADDR", "127.0.0.1".into()),
                ("MASTER_PORT", port.to_string()),
                ("TANDEM_DIST_TIMEOUT", "50".into()),
                ("RAYON_NUM_THREADS", "1".into()),
            ])
            .stderr(Stdio::piped());
            let mut child = c.spawn().unwrap();
            let (tx, rx) = std::sync::mpsc::channel();
            let err = child.stderr.take().unwrap();
            std::thread::spawn(move || {
                for line in BufReader::new(err).lines().map_while(Result::ok) {
                    let _ = tx.send(line);
                }
            });
            (child, rx)
        })
        .collect();
    // Rank 0 says when the training loop starts (it computes the old log-probs first).
    let t = Instant::now();
    let mut seen = Vec::new();
    while !seen
        .iter()
        .any(|l: &String| l.contains("old_logprobs absent"))
    {
        assert!(t.elapsed() < Duration::from_secs(60), "{seen:?}");
        seen.extend(ranks[0].1.try_iter());
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        ranks[1].0.try_wait().unwrap().is_none(),
        "rank 1 finished before it was killed: make the update longer"
    );
    ranks[1].0.kill().unwrap(); // SIGKILL
    ranks[1].0.wait().unwrap();
    let at = Instant::now();
    let status = loop {
        if let Some(s) = ranks[0].0.try_wait().unwrap() {
            break s;
        }
        assert!(
            at.elapsed() < Duration::from_secs(60),
            "rank 0 still running"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    std::thread::sleep(Duration::from_millis(50));
    seen.extend(ranks[0].1.try_iter());
    let err = seen.join("\n");
    assert!(!status.success(), "rank 0 succeeded: {err}");
    assert!(err.contains("rank 1"), "rank 0 does not name rank 1: {err}");
    assert!(
        !killed.exists(),
        "a killed update wrote {}",
        killed.display()
    );
    eprintln!("rank 0 stopped {:?} after the kill", at.elapsed());

    // The rerun of the same update, undisturbed, ends where one process does.
    let (one, two) = (dir.path().join("one"), dir.path().join("two"));
    let t = Instant::now();
    let j1 = update(0, &model, &input, &one, &long);
    eprintln!("one process: {:?}", t.elapsed());
    let j2 = update(2, &model, &input, &two, &long);
    assert_eq!(j2["optimizer_steps"], j1["optimizer_steps"]);
    let (a, b) = (state(&two), state(&one));
    for (i, what) in ["masters", "exp_avg", "exp_avg_sq"].iter().enumerate() {
        let e = rel_err(&a[i], &b[i]);
        eprintln!("rerun: {what} relative error {e:.2e}");
        assert!(e <= 1e-5, "rerun: {what} relative error {e}");
    }
}

#[test]
fn bench_update_under_launch_reports_per_gpu_numbers_and_the_weight_sync() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("bench.json");
    let mut c = Command::new(TANDEM);
    for k in LAUNCH_VARS {
        c.env_remove(k);
    }
    let o = c
        .args([
            "launch",
            "--nproc-per-node",
            "2",
            "--",
            TANDEM,
            "bench",
            "update",
        ])
        .args(["--device", "cpu", "--shape", "tiny", "--seq-len", "24"])
        .args([
            "--prompt-len",
            "8",
            "--micro-batch",
            "2",
            "--micro-batches",
            "2",
        ])
        .args(["--warmup", "1", "--steps", "2", "--json", p(&json)])
        .env("RAYON_NUM_THREADS", "1")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    let j: Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(j["world_size"], 2, "{j}");
    // Each GPU does the one-GPU workload; the step trained on both ranks' tokens.
    assert_eq!(j["tokens_per_step"], 2 * 2 * 24);
    assert_eq!(j["last_step_metrics"]["tokens"], 2 * 2 * 2 * 24);
    let dp = &j["data_parallel"];
    let tps = j["tokens_per_s"].as_f64().unwrap();
    assert!((dp["tokens_per_s_per_gpu"].as_f64().unwrap() - tps).abs() < 1e-9);
    assert!((dp["tokens_per_s_all_gpus"].as_f64().unwrap() - 2.0 * tps).abs() < 1e-6);
    assert!(dp["weight_sync_bytes"].as_u64().unwrap() > 0, "{dp}");
    assert!(dp["weight_sync_ms"].as_f64().unwrap() > 0.0, "{dp}");
    // The step's backward started the reduce-scatter (one bucket of the default size here).
    assert_eq!(dp["reduce_scatter_overlapped"], true, "{dp}");
    assert_eq!(dp["overlapped_buckets"], 1, "{dp}");
    // Rank 0 alone reports.
    assert_eq!(err.matches("step 1").count(), 1, "{err}");
}

/// The names of the optimizer files in `dir`, sorted.
fn optimizer_files(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("optimizer"))
        .collect();
    names.sort();
    names
}

/// Runs `cmd` expecting exit code 2; returns its stderr.
fn exits_2(mut cmd: Command, what: &str) -> String {
    let o = cmd.output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(2), "{what}: expected exit 2:\n{err}");
    err
}

/// With N > 1 ranks each rank writes its own optimizer shard and no rank gathers the state:
/// N shard files, no optimizer.safetensors, `optimizer_shards: N` in trainer_state.json. A
/// run resumed from such checkpoints (1 update call, then 2 more, each on N ranks reading its
/// own shard) ends where 3 calls in a row of one process do (zero2 with 2 and 3 ranks, full
/// with 2).
#[test]
fn sharded_checkpoints_are_written_per_rank_and_resume_as_one() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path(), 25);
    let input = dir.path().join("batch.parquet");
    batch(&input);
    let chain = |name: &str, ranks: usize, extra: &[&str]| -> Vec<std::path::PathBuf> {
        let mut from = model.clone();
        (1..=3)
            .map(|i| {
                let out = dir.path().join(format!("{name}-{i}"));
                let m = update(ranks, &from, &input, &out, extra);
                assert_eq!(m["optimizer_step"], 3 * i as u64, "{name} call {i}: {m}");
                let shards = if ranks > 1 { ranks } else { 0 };
                assert_eq!(m["optimizer_shards"], shards, "{name} call {i}: {m}");
                assert_eq!(m["optimizer_state_saved"], true, "{name} call {i}: {m}");
                from = out.clone();
                out
            })
            .collect()
    };
    let one = chain("one", 0, &[]);
    let want = state(&one[2]);
    for (name, ranks, extra) in [
        ("zero2-2", 2, &["--bucket-elems", "5000"][..]),
        ("zero2-3", 3, &["--bucket-elems", "3000"][..]),
        ("full-2", 2, &["--shard", "full"][..]),
    ] {
        let outs = chain(name, ranks, extra);
        for out in &outs {
            let files: Vec<String> = (0..ranks)
                .map(|r| format!("optimizer.rank{r:05}-of-{ranks:05}.safetensors"))
                .collect();
            assert_eq!(optimizer_files(out), files, "{}", out.display());
            let ts: Value =
                serde_json::from_slice(&std::fs::read(out.join("trainer_state.json")).unwrap())
                    .unwrap();
            assert_eq!(ts["optimizer_shards"], ranks, "{ts}");
            assert!(tandem::engine::resume::resumable(out).unwrap());
            // The staging directory is gone once the shards are moved in.
            let mut staging = out.clone().into_os_string();
            staging.push(".shards");
            assert!(!Path::new(&staging).exists());
        }
        // Each shard holds about 1/N of the state: the files together are the whole.
        let sizes: Vec<u64> = optimizer_files(&outs[0])
            .iter()
            .map(|f| std::fs::metadata(outs[0].join(f)).unwrap().len())
            .collect();
        let one_size = std::fs::metadata(one[0].join("optimizer.safetensors"))
            .unwrap()
            .len();
        for s in &sizes {
            assert!(
                *s < one_size / ranks as u64 + one_size / 5,
                "{name}: a shard of {s} bytes, the whole state {one_size}"
            );
        }
        let got = state(&outs[2]);
        for (i, what) in ["masters", "exp_avg", "exp_avg_sq"].iter().enumerate() {
            let e = rel_err(&got[i], &want[i]);
            eprintln!("{name}, resumed twice: {what} relative error {e:.2e}");
            assert!(
                e <= 1e-5,
                "{name}, resumed twice: {what} relative error {e}"
            );
        }
        // The model files are the HF layout of the same weights.
        let (_, a) = tandem::model::ModelDir::load(&outs[2]).unwrap();
        let (_, b) = tandem::model::ModelDir::load(&one[2]).unwrap();
        assert!(rel_err(&a, &b) <= 1e-2, "{name}: model files differ");
        let (_, start) = tandem::model::ModelDir::load(&model).unwrap();
        assert!(
            rel_err(&got[0], &start) > 1e-2,
            "{name}: the weights did not move"
        );
    }
}

/// A tiny model and batch in `dir`, trained by one process (`one-1`, then `one-2` from it:
/// `want` is its state after 6 optimizer steps) and by 2 ranks (`two`, sharded, 3 steps).
struct Trained {
    input: std::path::PathBuf,
    one1: std::path::PathBuf,
    two: std::path::PathBuf,
    want: [Weights; 3],
}

fn trained(dir: &Path, seed: u64) -> Trained {
    let model = tiny_model(dir, seed);
    let input = dir.join("batch.parquet");
    batch(&input);
    let one1 = dir.join("one-1");
    update(0, &model, &input, &one1, &[]);
    let one2 = dir.join("one-2");
    update(0, &one1, &input, &one2, &[]);
    let two = dir.join("two");
    update(2, &model, &input, &two, &["--bucket-elems", "5000"]);
    Trained {
        want: state(&one2),
        input,
        one1,
        two,
    }
}

/// Continues checkpoint `from` (3 optimizer steps in) in one process, on 3 ranks (zero2, another
/// bucket size) and on 2 with --shard full, into `dir/NAME-…`: each gets where one process that
/// never sharded gets (`want`, 6 steps), masters and moments within 1e-5.
fn continues_like_one_process(
    dir: &Path,
    from: &Path,
    input: &Path,
    want: &[Weights; 3],
    name: &str,
) {
    for (run, ranks, extra) in [
        ("1", 0, &[][..]),
        ("3", 3, &["--bucket-elems", "3000"][..]),
        ("full-2", 2, &["--shard", "full"][..]),
    ] {
        let run = format!("{name}-{run}");
        let out = dir.join(&run);
        let m = update(ranks, from, input, &out, extra);
        assert_eq!(m["optimizer_step"], 6, "{run}: {m}");
        let got = state(&out);
        for (i, what) in ["masters", "exp_avg", "exp_avg_sq"].iter().enumerate() {
            let e = rel_err(&got[i], &want[i]);
            assert!(e <= 1e-5, "{run}: {what} relative error {e}");
        }
    }
}

/// A sharded checkpoint continues with any number of ranks and any layout, straight from its
/// shard files: one process and a lone daemon (the whole state put back together), 3 ranks of
/// another bucket size and 2 ranks under `--shard full` (each rank cuts its shard from the
/// files) all get where one process that never sharded gets. Its model files alone load
/// anywhere. A missing shard makes the checkpoint not resumable and its load an input error
/// naming the file.
#[test]
fn a_sharded_checkpoint_loads_with_any_world_size_and_needs_every_shard() {
    let dir = tempfile::tempdir().unwrap();
    let Trained {
        input, two, want, ..
    } = trained(dir.path(), 26);
    continues_like_one_process(dir.path(), &two, &input, &want, "direct");
    // A lone daemon continues it too: it puts the shards together, as plain update does.
    let socket = dir.path().join("d.sock");
    let mut daemon = Command::new(TANDEM)
        .args([
            "daemon",
            "--device",
            "cpu",
            "--socket",
            p(&socket),
            "--policy",
            p(&two),
        ])
        .env("RAYON_NUM_THREADS", "1")
        .spawn()
        .unwrap();
    let t = std::time::Instant::now();
    while !Command::new(TANDEM)
        .args(["daemon-ctl", "--socket", p(&socket), "health"])
        .output()
        .unwrap()
        .status
        .success()
    {
        assert!(t.elapsed().as_secs() < 60, "the daemon never answered");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let lone = dir.path().join("direct-daemon");
    let m = update(0, &two, &input, &lone, &["--daemon", p(&socket)]);
    let _ = daemon.kill();
    let _ = daemon.wait();
    assert_eq!(m["optimizer_step"], 6, "{m}");
    let got = state(&lone);
    for (i, what) in ["masters", "exp_avg", "exp_avg_sq"].iter().enumerate() {
        let e = rel_err(&got[i], &want[i]);
        assert!(e <= 1e-5, "lone daemon: {what} relative error {e}");
    }
    // The model files alone (no trainer state, no optimizer files) load with any N.
    let bare = dir.path().join("bare");
    std::fs::create_dir(&bare).unwrap();
    for e in std::fs::read_dir(&two).unwrap() {
        let name = e.unwrap().file_name();
        let n = name.to_string_lossy();
        if !n.starts_with("optimizer") && n != "trainer_state.json" {
            std::fs::copy(two.join(&name), bare.join(&name)).unwrap();
        }
    }
    let m = update(3, &bare, &input, &dir.path().join("bare3"), &[]);
    assert_eq!(m["optimizer_step"], 3, "{m}");
    // A shard missing: not resumable, and loading it names the file.
    assert!(tandem::engine::resume::resumable(&two).unwrap());
    std::fs::remove_file(two.join("optimizer.rank00001-of-00002.safetensors")).unwrap();
    assert!(!tandem::engine::resume::resumable(&two).unwrap());
    let err = exits_2(
        update_cmd(2, &two, &input, &dir.path().join("x2"), &[]),
        "2 ranks with a shard missing",
    );
    assert!(
        err.contains("optimizer.rank00001-of-00002.safetensors") && err.contains("missing"),
        "{err}"
    );
}

/// `tandem merge-shards` makes a sharded checkpoint one optimizer.safetensors holding the same
/// state, bit for bit; it then loads in one process and on another number of ranks, and both
/// continue as one process that never sharded. Bad input (not sharded, a shard missing, an
/// existing --out) exits 2 with nothing written.
#[test]
fn merged_shards_load_with_any_number_of_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let Trained {
        input,
        one1,
        two,
        want,
        ..
    } = trained(dir.path(), 27);
    let merge = |from: &Path, out: &Path| {
        let mut c = Command::new(TANDEM);
        c.arg("merge-shards").arg(from).arg("--out").arg(out);
        c
    };
    let merged = dir.path().join("merged");
    let o = merge(&two, &merged).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(optimizer_files(&merged), ["optimizer.safetensors"]);
    assert!(!dir.path().join("merged.merging").exists());
    let ts: Value =
        serde_json::from_slice(&std::fs::read(merged.join("trainer_state.json")).unwrap()).unwrap();
    assert!(ts.get("optimizer_shards").is_none(), "{ts}");
    assert_eq!(ts["optimizer_step"], 3, "{ts}");
    // The same state as the shards, bit for bit, and the masters are the model files' (they
    // are used only when they round to them).
    let (a, b) = (state(&merged), state(&two));
    for i in 0..3 {
        assert_eq!(rel_err(&a[i], &b[i]), 0.0, "tensor group {i}");
    }
    let (_, weights) = tandem::model::ModelDir::load(&merged).unwrap();
    let r = tandem::engine::resume::load(&merged, &weights)
        .unwrap()
        .unwrap();
    assert!(
        r.master.is_some(),
        "the merged masters do not round to the model"
    );

    // Continued in one process, on 3 ranks (zero2) and on 2 with --shard full: where one
    // process that never sharded gets.
    continues_like_one_process(dir.path(), &merged, &input, &want, "merged");

    // Bad input: exit 2, named, nothing written.
    let err = exits_2(merge(&one1, &dir.path().join("x")), "not sharded");
    assert!(err.contains("is not sharded"), "{err}");
    let err = exits_2(merge(&two, &merged), "existing --out");
    assert!(err.contains("already exists"), "{err}");
    std::fs::remove_file(two.join("optimizer.rank00001-of-00002.safetensors")).unwrap();
    let err = exits_2(merge(&two, &dir.path().join("y")), "a shard missing");
    assert!(
        err.contains("optimizer.rank00001-of-00002.safetensors") && err.contains("missing"),
        "{err}"
    );
    assert!(!dir.path().join("x").exists() && !dir.path().join("y").exists());
}
