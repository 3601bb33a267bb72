//! The main job, shortened: `pipelines/demo.sh` (what `make demo` runs) with fewer steps, on
//! the debug binaries. Asserts that GRPO raised the reward.

use std::path::Path;
use std::process::Command;

fn mean(xs: &[f64]) -> f64 {
    xs.iter().sum::<f64>() / xs.len() as f64
}

#[test]
fn shortened_demo_raises_the_reward() {
    let bin = Path::new(env!("CARGO_BIN_EXE_pipeline")).parent().unwrap();
    let work = tempfile::tempdir().unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("pipelines/demo.sh");
    let out = Command::new("bash")
        .arg(&script)
        .arg(bin)
        .arg(work.path())
        .args(["--steps", "50"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "demo failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let run = work.path().join("run");
    let rewards: Vec<f64> = std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["reward/mean"]
                .as_f64()
                .expect("reward/mean in metrics.jsonl")
        })
        .collect();
    assert_eq!(rewards.len(), 50);
    let (first, last) = (mean(&rewards[..10]), mean(&rewards[40..]));
    eprintln!("reward: first 10 steps {first:.3}, last 10 steps {last:.3}");
    assert!(
        last > first + 0.05,
        "reward did not rise: first 10 steps {first:.3}, last 10 {last:.3}"
    );
    assert!(run.join("plot.png").exists());
}
