//! `tandem plot RUN [--out FILE.png]`: one PNG of a run's curves against step: reward and
//! accuracy, eval accuracy, KL, entropy, response length, seconds per step.
//!
//! Drawn with plotters' bitmap backend; text uses DejaVu Sans embedded in the binary (the
//! `dejavu` crate), so no system fonts or fontconfig are needed.

use super::rundir::{read_jsonl, RunDir};
use crate::bail_input;
use anyhow::Result;
use clap::Args;
use plotters::prelude::*;
use plotters::style::FontStyle;
use serde_json::{Map, Value};
use std::path::{Path, PathBuf};
use std::sync::Once;

#[derive(Args, Debug, Clone)]
#[command(about = "Plot a run's metrics and evaluations into one PNG")]
pub struct PlotArgs {
    /// The run directory (holding metrics.jsonl and eval.jsonl).
    pub run: PathBuf,
    /// Output PNG [default: RUN/plot.png].
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// One curve: a label and its (step, value) points.
pub struct Series {
    pub label: String,
    pub points: Vec<(f64, f64)>,
}

/// One panel: a title and its curves.
pub struct Panel {
    pub title: &'static str,
    pub series: Vec<Series>,
}

/// The points of `key` in JSON-lines rows (rows without it, or with a non-number, skipped).
pub fn points(rows: &[Map<String, Value>], key: &str) -> Vec<(f64, f64)> {
    rows.iter()
        .filter_map(|r| {
            let s = r.get("step")?.as_f64()?;
            let v = r.get(key)?.as_f64()?;
            v.is_finite().then_some((s, v))
        })
        .collect()
}

fn series(rows: &[Map<String, Value>], key: &str, label: &str) -> Option<Series> {
    let p = points(rows, key);
    (!p.is_empty()).then(|| Series {
        label: label.to_string(),
        points: p,
    })
}

/// The first of `keys` that has data.
fn first_of(rows: &[Map<String, Value>], keys: &[&str]) -> Option<Series> {
    keys.iter().find_map(|k| series(rows, k, k))
}

/// The six panels of a run.
pub fn panels(metrics: &[Map<String, Value>], evals: &[Map<String, Value>]) -> Vec<Panel> {
    let mut eval_series: Vec<Series> = series(evals, "accuracy", "accuracy").into_iter().collect();
    // Per-source eval accuracy when there is more than one source.
    let mut sources: Vec<String> = evals
        .iter()
        .flat_map(|r| r.keys().filter(|k| k.starts_with("accuracy/")).cloned())
        .collect();
    sources.sort();
    sources.dedup();
    if sources.len() > 1 {
        eval_series.extend(sources.iter().filter_map(|k| series(evals, k, k)));
    }
    vec![
        Panel {
            title: "reward and accuracy (train)",
            series: [
                series(metrics, "reward/mean", "reward mean"),
                series(metrics, "accuracy", "accuracy"),
            ]
            .into_iter()
            .flatten()
            .collect(),
        },
        Panel {
            title: "eval accuracy",
            series: eval_series,
        },
        Panel {
            title: "KL",
            series: first_of(
                metrics,
                &["kl", "update/kl_loss", "advantage/kl", "update/ppo_kl"],
            )
            .into_iter()
            .collect(),
        },
        Panel {
            title: "entropy",
            series: first_of(metrics, &["entropy", "update/entropy"])
                .into_iter()
                .collect(),
        },
        Panel {
            title: "response length (tokens)",
            series: [
                series(metrics, "response_length/mean", "mean"),
                series(metrics, "response_length/max", "max"),
            ]
            .into_iter()
            .flatten()
            .collect(),
        },
        Panel {
            title: "seconds per step",
            series: series(metrics, "time/step", "seconds")
                .into_iter()
                .collect(),
        },
    ]
}

static FONT: Once = Once::new();

fn register_font() {
    FONT.call_once(|| {
        // The embedded font is a valid TTF; registration cannot fail for it.
        let _ = plotters::style::register_font(
            "sans-serif",
            FontStyle::Normal,
            dejavu::sans::regular(),
        );
    });
}

const COLORS: [RGBColor; 5] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
];

/// Draw the panels into a PNG at `out` (written whole, then renamed into place).
pub fn draw(panels: &[Panel], title: &str, out: &Path) -> Result<()> {
    register_font();
    // The encoder picks the format from the extension, so the temp name keeps `.png`.
    let tmp = out.with_extension("tmp.png");
    {
        let root = BitMapBackend::new(&tmp, (1500, 900)).into_drawing_area();
        root.fill(&WHITE)?;
        let root = root.titled(title, ("sans-serif", 24))?;
        let areas = root.split_evenly((2, 3));
        for (area, panel) in areas.iter().zip(panels) {
            draw_panel(area, panel)?;
        }
        root.present()?;
    }
    std::fs::rename(&tmp, out)?;
    Ok(())
}

fn draw_panel(area: &DrawingArea<BitMapBackend, plotters::coord::Shift>, p: &Panel) -> Result<()> {
    let all: Vec<(f64, f64)> = p.series.iter().flat_map(|s| s.points.clone()).collect();
    if all.is_empty() {
        let mut chart = ChartBuilder::on(area)
            .caption(p.title, ("sans-serif", 18))
            .margin(10)
            .build_cartesian_2d(0f64..1f64, 0f64..1f64)?;
        chart.configure_mesh().disable_mesh().draw()?;
        area.draw(&Text::new(
            "no data",
            (
                area.dim_in_pixel().0 as i32 / 2 - 30,
                area.dim_in_pixel().1 as i32 / 2,
            ),
            ("sans-serif", 16)
                .into_font()
                .color(&RGBColor(120, 120, 120)),
        ))?;
        return Ok(());
    }
    let (x0, x1) = bounds(all.iter().map(|p| p.0));
    let (y0, y1) = bounds(all.iter().map(|p| p.1));
    let mut chart = ChartBuilder::on(area)
        .caption(p.title, ("sans-serif", 18))
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(55)
        .build_cartesian_2d(x0..x1, y0..y1)?;
    chart
        .configure_mesh()
        .x_desc("step")
        .x_label_formatter(&|x| format!("{x:.0}"))
        .light_line_style(RGBColor(235, 235, 235))
        .label_style(("sans-serif", 12))
        .draw()?;
    for (i, s) in p.series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        chart
            .draw_series(LineSeries::new(s.points.clone(), color.stroke_width(2)))?
            .label(s.label.clone())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
            });
        if s.points.len() <= 60 {
            chart.draw_series(
                s.points
                    .iter()
                    .map(|&pt| Circle::new(pt, 3, color.filled())),
            )?;
        }
    }
    if p.series.len() > 1 {
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(RGBColor(200, 200, 200))
            .label_font(("sans-serif", 12))
            .position(SeriesLabelPosition::UpperLeft)
            .draw()?;
    }
    Ok(())
}

/// An axis range covering the values with a little room, never empty.
pub fn bounds(vals: impl Iterator<Item = f64>) -> (f64, f64) {
    let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
    for v in vals {
        lo = lo.min(v);
        hi = hi.max(v);
    }
    if hi - lo < 1e-9 {
        let pad = if lo.abs() > 1e-9 { lo.abs() * 0.1 } else { 1.0 };
        return (lo - pad, hi + pad);
    }
    let pad = (hi - lo) * 0.05;
    (lo - pad, hi + pad)
}

/// `tandem plot`.
pub fn run(args: PlotArgs) -> Result<()> {
    let run = RunDir::new(&args.run);
    let metrics = read_jsonl(&run.metrics_path())?;
    let evals = read_jsonl(&run.eval_path())?;
    if metrics.is_empty() && evals.is_empty() {
        bail_input!(
            "{}: no metrics.jsonl or eval.jsonl lines: not a run directory, or no step has finished yet",
            args.run.display()
        );
    }
    let out = args.out.unwrap_or_else(|| run.root.join("plot.png"));
    let title = format!("tandem run {}", args.run.display());
    draw(&panels(&metrics, &evals), &title, &out)?;
    println!("{}", out.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn rows(v: Value) -> Vec<Map<String, Value>> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|r| r.as_object().unwrap().clone())
            .collect()
    }

    #[test]
    fn panels_pick_the_available_keys() {
        let m = rows(json!([
            {"step": 1, "reward/mean": 0.1, "accuracy": 0.0, "update/kl_loss": 0.01, "time/step": 2.0},
            {"step": 2, "reward/mean": 0.3, "accuracy": 0.5, "update/kl_loss": 0.02, "time/step": 2.5},
        ]));
        let e = rows(json!([
            {"step": 0, "accuracy": 0.1, "accuracy/a": 0.1},
            {"step": 2, "accuracy": 0.6, "accuracy/a": 0.6},
        ]));
        let p = panels(&m, &e);
        assert_eq!(p.len(), 6);
        assert_eq!(p[0].series.len(), 2);
        assert_eq!(p[0].series[1].points, [(1.0, 0.0), (2.0, 0.5)]);
        // one source: no per-source curve
        assert_eq!(p[1].series.len(), 1);
        assert_eq!(p[2].series[0].label, "update/kl_loss");
        assert!(p[3].series.is_empty());
        assert_eq!(p[5].series[0].points, [(1.0, 2.0), (2.0, 2.5)]);
    }

    #[test]
    fn bounds_pad_and_never_collapse() {
        assert_eq!(bounds([0.0, 10.0].into_iter()), (-0.5, 10.5));
        assert_eq!(bounds([0.0].into_iter()), (-1.0, 1.0));
        let (lo, hi) = bounds([2.0, 2.0].into_iter());
        assert!(lo < 2.0 && hi > 2.0);
    }

    #[test]
    fn draws_a_png() {
        let dir = tempfile::tempdir().unwrap();
        let m = rows(json!([{"step": 1, "reward/mean": 0.1}, {"step": 2, "reward/mean": 0.4}]));
        let out = dir.path().join("p.png");
        draw(&panels(&m, &[]), "t", &out).unwrap();
        let bytes = std::fs::read(&out).unwrap();
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
        assert!(!dir.path().join("p.tmp.png").exists());
    }
}
