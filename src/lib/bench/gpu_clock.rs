//! The GPU's SM clock and power while a benchmark runs, from `nvidia-smi` sampling every 100 ms
//! beside it. A long decode at 7B and 256 sequences runs an H200 at its power cap with the SM
//! clock ~23% below the short replay's (docs/BENCHMARKS.md, 2026-11-29): the roofline at the
//! nominal clock is then not what the GPU can deliver, and a run's table says so next to its
//! fractions. Nothing when `nvidia-smi` is missing or fails: the columns say "-".

use crate::stage::common::Device;
use serde::Serialize;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

/// `clocks_throttle_reasons.active`'s bit for the software power cap.
const POWER_CAP: u64 = 0x4;

#[derive(Clone, Copy, Debug, PartialEq)]
struct Sample {
    sm_mhz: f64,
    power_w: f64,
    power_capped: bool,
}

/// The samples of a time window.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub(crate) struct ClockSummary {
    pub(crate) samples: usize,
    pub(crate) sm_mhz_median: f64,
    pub(crate) power_w_mean: f64,
    pub(crate) power_w_max: f64,
    /// Share of the samples with the software power cap active.
    pub(crate) power_capped_fraction: f64,
}

impl ClockSummary {
    /// Work per joule at the window's mean power of `rate` units a second (tokens/s: tokens
    /// per joule, what a power-capped GPU trades); None without a power reading.
    pub(crate) fn per_joule(&self, rate: f64) -> Option<f64> {
        (self.power_w_mean > 0.0).then(|| rate / self.power_w_mean)
    }
}

type Samples = Arc<Mutex<Vec<(Instant, Sample)>>>;

/// A sampling child process and the thread that reads it.
pub(crate) struct ClockSampler {
    child: Child,
    samples: Samples,
    reader: Option<JoinHandle<()>>,
}

impl ClockSampler {
    /// The sampler of a benchmark's `--device`: None on the CPU.
    pub(crate) fn on(device: Device) -> Option<ClockSampler> {
        match device {
            Device::Cuda(ordinal) => ClockSampler::start(ordinal),
            Device::Cpu => None,
        }
    }

    /// Samples CUDA device `ordinal` (the physical GPU `CUDA_VISIBLE_DEVICES` maps it to);
    /// None without `nvidia-smi`.
    pub(crate) fn start(ordinal: usize) -> Option<ClockSampler> {
        let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
        let gpu = physical_gpu(visible.as_deref(), ordinal)?;
        let args = [
            "--query-gpu=clocks.sm,power.draw,clocks_throttle_reasons.active",
            "--format=csv,noheader,nounits",
            "-lms",
            "100",
            "-i",
            &gpu,
        ];
        ClockSampler::spawn("nvidia-smi", &args)
    }

    fn spawn(program: &str, args: &[&str]) -> Option<ClockSampler> {
        let mut child = Command::new(program)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .ok()?;
        let out = child.stdout.take()?;
        let samples: Samples = Arc::default();
        let into = samples.clone();
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if let Some(s) = parse(&line) {
                    into.lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push((Instant::now(), s));
                }
            }
        });
        Some(ClockSampler {
            child,
            samples,
            reader: Some(reader),
        })
    }

    /// The samples read between `from` and `to`; None when there are none.
    pub(crate) fn summary(&self, from: Instant, to: Instant) -> Option<ClockSummary> {
        let all = self.samples.lock().unwrap_or_else(|e| e.into_inner());
        let window: Vec<Sample> = all
            .iter()
            .filter(|(t, _)| *t >= from && *t <= to)
            .map(|&(_, s)| s)
            .collect();
        summarise(&window)
    }
}

impl Drop for ClockSampler {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
    }
}

/// The physical GPU of CUDA ordinal `ordinal`: the entry of `CUDA_VISIBLE_DEVICES` (an index
/// or a UUID) when it is set, else the ordinal itself.
fn physical_gpu(visible: Option<&str>, ordinal: usize) -> Option<String> {
    match visible.map(str::trim).filter(|v| !v.is_empty()) {
        Some(v) => v.split(',').nth(ordinal).map(|s| s.trim().to_string()),
        None => Some(ordinal.to_string()),
    }
}

/// One line of `nvidia-smi --format=csv,noheader,nounits`: "1515, 661.82, 0x0000000000000004".
fn parse(line: &str) -> Option<Sample> {
    let mut f = line.split(',').map(str::trim);
    let sm_mhz = f.next()?.parse().ok()?;
    let power_w = f.next()?.parse().ok()?;
    let reasons = u64::from_str_radix(f.next()?.trim_start_matches("0x"), 16).ok()?;
    Some(Sample {
        sm_mhz,
        power_w,
        power_capped: reasons & POWER_CAP != 0,
    })
}

fn summarise(window: &[Sample]) -> Option<ClockSummary> {
    if window.is_empty() {
        return None;
    }
    let n = window.len();
    let mut mhz: Vec<f64> = window.iter().map(|s| s.sm_mhz).collect();
    mhz.sort_by(f64::total_cmp);
    Some(ClockSummary {
        samples: n,
        sm_mhz_median: mhz[n / 2],
        power_w_mean: window.iter().map(|s| s.power_w).sum::<f64>() / n as f64,
        power_w_max: window.iter().map(|s| s.power_w).fold(0.0, f64::max),
        power_capped_fraction: window.iter().filter(|s| s.power_capped).count() as f64 / n as f64,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_per_joule_are_the_rate_over_the_mean_power() {
        let at = |w: f64| Sample {
            sm_mhz: 1500.0,
            power_w: w,
            power_capped: false,
        };
        let s = summarise(&[at(600.0), at(700.0)]).unwrap();
        assert_eq!(s.per_joule(26_000.0), Some(40.0));
        assert_eq!(summarise(&[at(0.0)]).unwrap().per_joule(1.0), None);
    }

    #[test]
    fn lines_parse_and_the_power_cap_is_bit_4() {
        let s = parse("1515, 661.82, 0x0000000000000004").unwrap();
        assert_eq!(
            (s.sm_mhz, s.power_w, s.power_capped),
            (1515.0, 661.82, true)
        );
        let s = parse("1980, 123.1, 0x0000000000000000").unwrap();
        assert!(!s.power_capped);
        // Thermal slowdown (0x20) alone is not the power cap.
        assert!(!parse("1400, 500, 0x20").unwrap().power_capped);
        assert_eq!(parse("[N/A], 100, 0x0"), None);
        assert_eq!(parse("1980, 100"), None);
    }

    #[test]
    fn a_summary_is_the_median_clock_and_the_mean_power() {
        let s = |mhz, w, capped| Sample {
            sm_mhz: mhz,
            power_w: w,
            power_capped: capped,
        };
        let w = [
            s(1500.0, 690.0, true),
            s(1980.0, 300.0, false),
            s(1515.0, 660.0, true),
            s(1530.0, 650.0, true),
        ];
        let sum = summarise(&w).unwrap();
        assert_eq!(sum.samples, 4);
        assert_eq!(sum.sm_mhz_median, 1530.0);
        assert_eq!(sum.power_w_mean, 575.0);
        assert_eq!(sum.power_w_max, 690.0);
        assert_eq!(sum.power_capped_fraction, 0.75);
        assert_eq!(summarise(&[]), None);
    }

    #[test]
    fn the_ordinal_maps_through_cuda_visible_devices() {
        assert_eq!(physical_gpu(None, 1).as_deref(), Some("1"));
        assert_eq!(physical_gpu(Some(""), 0).as_deref(), Some("0"));
        assert_eq!(physical_gpu(Some("2,3"), 1).as_deref(), Some("3"));
        assert_eq!(
            physical_gpu(Some("GPU-ab12, GPU-cd34"), 0).as_deref(),
            Some("GPU-ab12")
        );
        assert_eq!(physical_gpu(Some("2"), 1), None);
    }

    /// A stand-in for nvidia-smi that prints three samples: the sampler reads them with their
    /// times, and a window after them holds none.
    #[test]
    fn the_sampler_reads_a_programs_lines() {
        let dir = tempfile::tempdir().unwrap();
        let fake = dir.path().join("smi.sh");
        std::fs::write(
            &fake,
            "#!/bin/sh\necho '1500, 690.5, 0x4'\necho 'garbage'\necho '1980, 120, 0x0'\necho '1510, 680, 0x4'\nexec sleep 30\n",
        )
        .unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
        let t0 = Instant::now();
        let s = ClockSampler::spawn(fake.to_str().unwrap(), &[]).unwrap();
        let deadline = t0 + std::time::Duration::from_secs(10);
        while s.samples.lock().unwrap().len() < 3 && Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let sum = s.summary(t0, Instant::now()).unwrap();
        assert_eq!(sum.samples, 3);
        assert_eq!(sum.sm_mhz_median, 1510.0);
        assert!((sum.power_capped_fraction - 2.0 / 3.0).abs() < 1e-12);
        let later = Instant::now();
        assert_eq!(
            s.summary(later, later + std::time::Duration::from_secs(1)),
            None
        );
        // Dropping it stops the program (its `sleep 30` does not hold the test).
        let t = Instant::now();
        drop(s);
        assert!(t.elapsed() < std::time::Duration::from_secs(10));
    }

    #[test]
    fn a_missing_program_is_no_sampler() {
        assert!(ClockSampler::spawn("/nonexistent/nvidia-smi", &[]).is_none());
    }
}
