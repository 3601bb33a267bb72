//! `tandem plot RUN... [--out FILE.png]`: one PNG of a run's curves against step: reward and
//! accuracy, eval accuracy, the KL term in use, entropy, response length, seconds per step.
//! A panel without data (no KL term configured, no evaluation) is left out and the others take
//! its space ([`with_data`], [`grid`]); a footnote names what was left out. Several runs are
//! drawn over each other ([`overlay`]): each run in its own colour, its name in the legends.
//!
//! What is drawn is computed first, by pure functions the tests check: [`panels`] reads the
//! curves (one value per metrics line, `None` where a line lacks it), [`Series::runs`] splits
//! them where data is missing (the line breaks there and only there), [`decimate`] keeps, per
//! pixel column, the first, lowest, highest and last point, so every vertex is a real data
//! point however long the run. Each segment is drawn on its own: plotters turns a thick
//! polyline into one polygon whose joins spike far past sharp zig-zags (the stray vertical
//! lines of long runs), while a two-point segment is a plain rectangle. Legends sit above the
//! plot area, never on the data.
//!
//! Drawn with plotters' bitmap backend; text uses DejaVu Sans embedded in the binary (the
//! `dejavu` crate), so no system fonts or fontconfig are needed.

use super::rundir::{read_jsonl, RunDir};
use crate::bail_input;
use anyhow::{anyhow, Result};
use clap::Args;
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::FontStyle;
use serde_json::{Map, Value};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Once;

#[derive(Args, Debug, Clone)]
#[command(about = "Plot a run's metrics and evaluations into one PNG (several runs: overlaid)")]
pub struct PlotArgs {
    /// Run directories (holding metrics.jsonl and eval.jsonl); several are drawn over each
    /// other, one colour per run (at most 10).
    #[arg(required = true, value_name = "RUN")]
    pub runs: Vec<PathBuf>,
    /// Output PNG (default: RUN/plot.png for one run, plot.png in the current directory for
    /// several).
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
}

/// One curve: a label and, for each line of its file in step order, the step and the value
/// (`None` where the line lacks the key or holds a non-number); its colour when several runs
/// are overlaid (None: the panel's palette, by the curve's place).
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Series {
    pub(crate) label: String,
    pub(crate) data: Vec<(f64, Option<f64>)>,
    pub(crate) color: Option<RGBColor>,
}

impl Series {
    /// The runs of consecutive lines that have a value: drawn as one line each, with a gap
    /// between them.
    pub fn runs(&self) -> Vec<Vec<(f64, f64)>> {
        let mut out: Vec<Vec<(f64, f64)>> = vec![];
        let mut cur = vec![];
        for &(x, y) in &self.data {
            match y {
                Some(y) => cur.push((x, y)),
                None if !cur.is_empty() => out.push(std::mem::take(&mut cur)),
                None => {}
            }
        }
        if !cur.is_empty() {
            out.push(cur);
        }
        out
    }

    /// (lowest, highest) value, when there is one.
    pub fn range(&self) -> Option<(f64, f64)> {
        self.values().fold(None, |r, v| {
            Some(r.map_or((v, v), |(lo, hi): (f64, f64)| (lo.min(v), hi.max(v))))
        })
    }

    fn values(&self) -> impl Iterator<Item = f64> + '_ {
        self.data.iter().filter_map(|p| p.1)
    }
}

/// One panel: a title, its curves, and a note drawn in it (why it is empty).
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Panel {
    pub(crate) title: String,
    pub(crate) series: Vec<Series>,
    pub(crate) note: Option<String>,
}

impl Panel {
    fn new(title: &str, series: Vec<Series>) -> Panel {
        Panel {
            title: title.to_string(),
            series,
            note: None,
        }
    }
}

/// The steps and values of `key` in JSON-lines rows (rows without it, or with a non-number,
/// give `None`), in step order.
pub fn column(rows: &[Map<String, Value>], key: &str) -> Vec<(f64, Option<f64>)> {
    let mut out: Vec<(f64, Option<f64>)> = rows
        .iter()
        .filter_map(|r| {
            let s = r.get("step")?.as_f64()?;
            Some((
                s,
                r.get(key).and_then(Value::as_f64).filter(|v| v.is_finite()),
            ))
        })
        .collect();
    out.sort_by(|a, b| a.0.total_cmp(&b.0));
    out
}

/// The curve of `key`, when it has at least one value.
fn series(rows: &[Map<String, Value>], key: &str, label: &str) -> Option<Series> {
    let data = column(rows, key);
    data.iter().any(|p| p.1.is_some()).then(|| Series {
        label: label.to_string(),
        data,
        color: None,
    })
}

/// The first of `keys` that has data.
fn first_of(rows: &[Map<String, Value>], keys: &[&str]) -> Option<Series> {
    keys.iter().find_map(|k| series(rows, k, k))
}

/// A spec value, e.g. `spec_value(spec, "update", "use-kl-loss")`.
fn spec_value<'a>(
    spec: Option<&'a toml::Table>,
    table: &str,
    key: &str,
) -> Option<&'a toml::Value> {
    spec?.get(table)?.get(key)
}

fn spec_on(spec: Option<&toml::Table>, table: &str, key: &str) -> bool {
    match spec_value(spec, table, key) {
        Some(toml::Value::Boolean(b)) => *b,
        Some(toml::Value::String(s)) => s == "true",
        _ => false,
    }
}

fn spec_text(spec: Option<&toml::Table>, table: &str, key: &str, default: &str) -> String {
    match spec_value(spec, table, key) {
        Some(toml::Value::String(s)) => s.clone(),
        Some(v) => v.to_string(),
        None => default.to_string(),
    }
}

/// The KL panel shows the KL terms the run uses: the KL loss (`update/kl_loss`) when
/// `use-kl-loss` is on, the in-reward KL (`advantage/kl`) when `kl-in-reward` is on, else a
/// note that none is configured. Without a spec (a bare directory of metrics), what the metrics
/// show is used: a KL loss that is not 0 everywhere, an in-reward KL that is present.
fn kl_panel(metrics: &[Map<String, Value>], spec: Option<&toml::Table>) -> Panel {
    let (loss_on, reward_on) = match spec {
        Some(_) => (
            spec_on(spec, "update", "use-kl-loss"),
            spec_on(spec, "advantage", "kl-in-reward"),
        ),
        None => (
            column(metrics, "update/kl_loss")
                .iter()
                .any(|p| p.1.is_some_and(|v| v != 0.0)),
            column(metrics, "advantage/kl")
                .iter()
                .any(|p| p.1.is_some()),
        ),
    };
    let mut panel = Panel::new("KL to the reference", vec![]);
    if loss_on {
        let label = format!(
            "KL loss ({}, coef {})",
            spec_text(spec, "update", "kl-loss-type", "k3"),
            spec_text(spec, "update", "kl-loss-coef", "0.001")
        );
        panel
            .series
            .extend(series(metrics, "update/kl_loss", &label));
    }
    if reward_on {
        let label = format!(
            "KL in the reward ({}, β {})",
            spec_text(spec, "advantage", "kl-penalty", "k1"),
            spec_text(spec, "advantage", "kl-coef", "0.001")
        );
        panel.series.extend(series(metrics, "advantage/kl", &label));
    }
    panel.note = match (loss_on || reward_on, spec.is_some()) {
        (false, true) => {
            Some("no KL term configured\n(use-kl-loss and kl-in-reward are off)".into())
        }
        (false, false) => Some("no KL term in the metrics".into()),
        (true, _) if panel.series.is_empty() => Some("no data yet".into()),
        _ => None,
    };
    panel
}

/// The six panels of a run; `spec` is the run's spec.resolved.toml (what the KL panel shows).
pub(crate) fn panels(
    metrics: &[Map<String, Value>],
    evals: &[Map<String, Value>],
    spec: Option<&toml::Table>,
) -> Vec<Panel> {
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
    // A 0/1 reward makes the mean reward the accuracy: one curve then, not one hidden under
    // the other.
    let train = match (
        series(metrics, "reward/mean", "reward mean"),
        series(metrics, "accuracy", "accuracy"),
    ) {
        (Some(r), Some(a)) if r.data == a.data => vec![Series {
            label: "reward mean = accuracy".into(),
            ..r
        }],
        (r, a) => r.into_iter().chain(a).collect(),
    };
    vec![
        Panel::new("reward and accuracy (train)", train),
        Panel::new("eval accuracy", eval_series),
        kl_panel(metrics, spec),
        Panel::new(
            "entropy",
            first_of(metrics, &["entropy", "update/entropy"])
                .into_iter()
                .collect(),
        ),
        Panel::new(
            "response length (tokens)",
            [
                series(metrics, "response_length/mean", "mean"),
                series(metrics, "response_length/max", "max"),
            ]
            .into_iter()
            .flatten()
            .collect(),
        ),
        Panel::new(
            "seconds per step",
            series(metrics, "time/step", "seconds")
                .into_iter()
                .collect(),
        ),
    ]
}

/// Several runs' panels as one set: panel by panel, every run's curves, labelled `NAME: curve`,
/// in the run's colour (a panel's second and later curves of a run in lighter shades of it).
/// A panel's note is the first run's.
pub(crate) fn overlay(runs: &[(String, Vec<Panel>)]) -> Vec<Panel> {
    let Some((_, first)) = runs.first() else {
        return vec![];
    };
    let mut out: Vec<Panel> = first
        .iter()
        .map(|p| Panel {
            series: vec![],
            ..p.clone()
        })
        .collect();
    for (r, (name, panels)) in runs.iter().enumerate() {
        for (merged, panel) in out.iter_mut().zip(panels) {
            merged
                .series
                .extend(panel.series.iter().enumerate().map(|(k, s)| Series {
                    label: format!("{name}: {}", s.label),
                    data: s.data.clone(),
                    color: Some(shade(COLORS[r % COLORS.len()], k)),
                }));
        }
    }
    out
}

/// `color` for a run's `k`-th curve of a panel: itself, then lighter (mixed with white).
fn shade(color: RGBColor, k: usize) -> RGBColor {
    let white = 1.0 - 0.6f64.powi(k as i32);
    let mix = |c: u8| (c as f64 + (255.0 - c as f64) * white).round() as u8;
    RGBColor(mix(color.0), mix(color.1), mix(color.2))
}

/// The panels that have data, and the footnote that names the others (with why, where the
/// panel says), so they give their space to the rest. When no panel has data, all of them (each
/// says why it is empty).
pub(crate) fn with_data(panels: Vec<Panel>) -> (Vec<Panel>, Option<String>) {
    let has_data = |p: &Panel| p.series.iter().any(|s| s.range().is_some());
    if !panels.iter().any(has_data) {
        return (panels, None);
    }
    let (kept, empty): (Vec<Panel>, Vec<Panel>) = panels.into_iter().partition(has_data);
    let names: Vec<String> = empty
        .iter()
        .map(|p| match &p.note {
            Some(note) => format!("{}: {}", p.title, note.replace('\n', " ")),
            None => p.title.clone(),
        })
        .collect();
    let footnote = (!names.is_empty()).then(|| format!("no data: {}", names.join("; ")));
    (kept, footnote)
}

/// How `n` panels fill the figure: the number of panels in each row, at most 3 a row, the
/// rows as even as can be (5: 3 then 2, each row's panels sharing its whole width).
pub(crate) fn grid(n: usize) -> Vec<usize> {
    let rows = n.div_ceil(3).max(1);
    (0..rows)
        .map(|r| n / rows + usize::from(r < n % rows))
        .collect()
}

/// The vertices drawn for one run of points when `columns` pixel columns span x0..=x1: every
/// point when there are few, else per column its first, lowest, highest and last point, in
/// step order. Every vertex is a data point, and the line through them covers each column's
/// whole range of values.
pub(crate) fn decimate(run: &[(f64, f64)], x0: f64, x1: f64, columns: usize) -> Vec<(f64, f64)> {
    if run.len() <= 2 * columns || columns == 0 {
        return run.to_vec();
    }
    let col = |x: f64| {
        let f = if x1 > x0 { (x - x0) / (x1 - x0) } else { 0.0 };
        ((f * columns as f64) as usize).min(columns - 1)
    };
    let mut out = vec![];
    let mut i = 0;
    while i < run.len() {
        let c = col(run[i].0);
        let mut j = i;
        let (mut lo, mut hi) = (i, i);
        while j < run.len() && col(run[j].0) == c {
            if run[j].1 < run[lo].1 {
                lo = j;
            }
            if run[j].1 > run[hi].1 {
                hi = j;
            }
            j += 1;
        }
        let mut keep = [i, lo, hi, j - 1];
        keep.sort();
        for (k, &idx) in keep.iter().enumerate() {
            if k == 0 || idx != keep[k - 1] {
                out.push(run[idx]);
            }
        }
        i = j;
    }
    out
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

/// The step axis: the steps themselves, widened when there is only one.
fn step_range(panel: &Panel) -> Range<f64> {
    let (lo, hi) = panel
        .series
        .iter()
        .flat_map(|s| s.data.iter().filter(|p| p.1.is_some()).map(|p| p.0))
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), x| {
            (lo.min(x), hi.max(x))
        });
    if hi > lo {
        lo..hi
    } else {
        lo - 1.0..hi + 1.0
    }
}

/// Pixel rectangle: x0..x1, y0..y1 (ends excluded).
pub(crate) type Rect = (Range<i32>, Range<i32>);

/// What was drawn of one series: its polylines (data coordinates) and their pixels.
#[derive(Clone, Debug)]
#[cfg_attr(not(test), allow(dead_code, reason = "read by the tests only"))]
pub(crate) struct DrawnSeries {
    pub(crate) color: (u8, u8, u8),
    pub(crate) lines: Vec<Vec<(f64, f64)>>,
    pub(crate) pixels: Vec<Vec<(i32, i32)>>,
}

/// What was drawn of one panel: its share of the figure, where its plot area and legend are,
/// and its series.
#[derive(Clone, Debug)]
#[cfg_attr(not(test), allow(dead_code, reason = "read by the tests only"))]
pub(crate) struct DrawnPanel {
    pub(crate) title: String,
    pub(crate) area: Rect,
    pub(crate) plot: Rect,
    pub(crate) legend: Option<Rect>,
    pub(crate) x_range: Range<f64>,
    pub(crate) y_range: Range<f64>,
    pub(crate) series: Vec<DrawnSeries>,
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

/// A panel's curves, or the runs overlaid, in this order (matplotlib's tab10).
pub(crate) const COLORS: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

/// Image size in pixels.
pub(crate) const SIZE: (u32, u32) = (1500, 900);

const CAPTION_H: i32 = 26;
const LEGEND_ROW_H: i32 = 17;
const FOOTNOTE_H: u32 = 22;

/// Draw the panels into a PNG at `out` (written whole, then renamed into place), with a gray
/// `footnote` under them; returns what was drawn.
pub(crate) fn draw(
    panels: &[Panel],
    title: &str,
    footnote: Option<&str>,
    out: &Path,
) -> Result<Vec<DrawnPanel>> {
    register_font();
    // The encoder picks the format from the extension, so the temp name keeps `.png`.
    let tmp = out.with_extension("tmp.png");
    let drawn = {
        let root = BitMapBackend::new(&tmp, SIZE).into_drawing_area();
        let drawn = render(&root, panels, title, footnote)?;
        root.present().map_err(|e| anyhow!("{e}"))?;
        drawn
    };
    std::fs::rename(&tmp, out)?;
    Ok(drawn)
}

/// Draw the figure on any backend (a PNG file, or an RGB buffer in tests): the panels fill it
/// row by row ([`grid`]).
pub(crate) fn render<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    panels: &[Panel],
    title: &str,
    footnote: Option<&str>,
) -> Result<Vec<DrawnPanel>> {
    register_font();
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| anyhow!("drawing the plot: {e}");
    root.fill(&WHITE).map_err(err)?;
    let mut body = root.titled(title, ("sans-serif", 24)).map_err(err)?;
    if let Some(text) = footnote {
        let (w, h) = body.dim_in_pixel();
        let (top, foot) = body.split_vertically(h.saturating_sub(FOOTNOTE_H));
        let (x, y) = foot.get_base_pixel();
        let at = (x + w as i32 / 2, y + FOOTNOTE_H as i32 / 2);
        root_text(&foot, text, at, RGBColor(120, 120, 120)).map_err(err)?;
        body = top;
    }
    let counts = grid(panels.len());
    let mut areas = vec![];
    for (row, &n) in body.split_evenly((counts.len(), 1)).iter().zip(&counts) {
        areas.extend(row.split_evenly((1, n)));
    }
    let mut drawn = vec![];
    for (area, panel) in areas.iter().zip(panels) {
        drawn.push(draw_panel(area, panel)?);
    }
    Ok(drawn)
}

/// Legend entries laid out left to right from `x`, wrapping before `width`: (row, x) each.
fn legend_layout<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    labels: &[&str],
    x: i32,
    width: i32,
) -> Vec<(i32, i32)> {
    let (mut row, mut at) = (0, x);
    labels
        .iter()
        .map(|l| {
            let w = area
                .estimate_text_size(l, &("sans-serif", 13).into_text_style(area))
                .map_or(8 * l.len() as i32, |s| s.0 as i32)
                + 30;
            if at > x && at + w > width {
                row += 1;
                at = x;
            }
            let pos = (row, at);
            at += w + 12;
            pos
        })
        .collect()
}

/// Draws a panel: its title and legend above, the mesh, a note (or "no data"), the series.
fn draw_panel<DB: DrawingBackend>(area: &DrawingArea<DB, Shift>, p: &Panel) -> Result<DrawnPanel> {
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| anyhow!("drawing panel '{}': {e}", p.title);
    let (legend, body) = draw_heading(area, p).map_err(err)?;
    let has_data = p.series.iter().any(|s| s.range().is_some());
    let x_range = if has_data { step_range(p) } else { 0.0..1.0 };
    let y_range = if has_data {
        let (lo, hi) = bounds(p.series.iter().flat_map(|s| s.values()));
        lo..hi
    } else {
        0.0..1.0
    };
    let mut chart = ChartBuilder::on(&body)
        .margin(10)
        .margin_top(2)
        .x_label_area_size(30)
        .y_label_area_size(55)
        .build_cartesian_2d(x_range.clone(), y_range.clone())
        .map_err(err)?;
    draw_mesh(&mut chart, &x_range, has_data).map_err(err)?;
    let plot = chart.plotting_area().get_pixel_range();
    let note = p
        .note
        .clone()
        .or_else(|| (!has_data).then(|| "no data".to_string()));
    if let Some(note) = note {
        let gray = RGBColor(120, 120, 120);
        let (cx, cy) = (
            (plot.0.start + plot.0.end) / 2,
            (plot.1.start + plot.1.end) / 2,
        );
        for (k, line) in note.lines().enumerate() {
            root_text(area, line, (cx, cy - 10 + 18 * k as i32), gray).map_err(err)?;
        }
    }
    let columns = (plot.0.end - plot.0.start).max(1) as usize;
    let series = draw_series(&mut chart, p, &x_range, columns).map_err(err)?;
    Ok(DrawnPanel {
        title: p.title.clone(),
        area: area.get_pixel_range(),
        plot,
        legend,
        x_range,
        y_range,
        series,
    })
}

/// What drawing on a `DB` area returns.
type Drawn<T, DB> = Result<T, DrawingAreaErrorKind<<DB as DrawingBackend>::ErrorType>>;

/// A panel's chart: steps on x, values on y.
type Chart<'a, DB> = ChartContext<
    'a,
    DB,
    Cartesian2d<plotters::coord::types::RangedCoordf64, plotters::coord::types::RangedCoordf64>,
>;

/// The panel's title and legend above its chart; returns the legend's pixels and the area
/// left for the chart.
fn draw_heading<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    p: &Panel,
) -> Drawn<(Option<Rect>, DrawingArea<DB, Shift>), DB> {
    let (w, _) = area.dim_in_pixel();
    let labels: Vec<&str> = p.series.iter().map(|s| s.label.as_str()).collect();
    let layout = legend_layout(area, &labels, 70, w as i32 - 10);
    let rows = layout.iter().map(|l| l.0 + 1).max().unwrap_or(0);
    let top = CAPTION_H + rows * LEGEND_ROW_H + 4;
    let (head, body) = area.split_vertically(top);
    head.draw(&Text::new(
        p.title.clone(),
        (w as i32 / 2, 4),
        ("sans-serif", 18)
            .into_font()
            .color(&BLACK)
            .pos(plotters::style::text_anchor::Pos::new(
                plotters::style::text_anchor::HPos::Center,
                plotters::style::text_anchor::VPos::Top,
            )),
    ))?;
    for ((row, x), (i, s)) in layout.iter().zip(p.series.iter().enumerate()) {
        let color = s.color.unwrap_or(COLORS[i % COLORS.len()]);
        let y = CAPTION_H + row * LEGEND_ROW_H + LEGEND_ROW_H / 2;
        head.draw(&PathElement::new(
            vec![(*x, y), (x + 22, y)],
            color.stroke_width(3),
        ))?;
        head.draw(&Text::new(
            s.label.clone(),
            (x + 28, y - 7),
            ("sans-serif", 13).into_font(),
        ))?;
    }
    let legend = (!layout.is_empty()).then(|| {
        let (x, y) = head.get_base_pixel();
        (x..x + w as i32, y + CAPTION_H..y + top)
    });
    Ok((legend, body))
}

/// The mesh and axes; none without data.
fn draw_mesh<DB: DrawingBackend>(
    chart: &mut Chart<'_, DB>,
    x_range: &Range<f64>,
    has_data: bool,
) -> Drawn<(), DB> {
    // Steps are whole numbers: no label on a fractional tick (a short run's axis would read
    // 1 2 2 3 otherwise).
    let step_label = |x: &f64| {
        if x.fract() == 0.0 {
            format!("{x:.0}")
        } else {
            String::new()
        }
    };
    let span = (x_range.end - x_range.start) as usize;
    let mut mesh = chart.configure_mesh();
    mesh.x_desc("step")
        .x_labels((span + 1).clamp(2, 10))
        .x_label_formatter(&step_label)
        .light_line_style(RGBColor(235, 235, 235))
        .label_style(("sans-serif", 12));
    if !has_data {
        mesh.disable_mesh().x_labels(0).y_labels(0);
    }
    mesh.draw()
}

/// Each series as lines (and dots when they are few), decimated to the plot's `columns`.
fn draw_series<DB: DrawingBackend>(
    chart: &mut Chart<'_, DB>,
    p: &Panel,
    x_range: &Range<f64>,
    columns: usize,
) -> Drawn<Vec<DrawnSeries>, DB> {
    let mut out = vec![];
    for (i, s) in p.series.iter().enumerate() {
        let color = s.color.unwrap_or(COLORS[i % COLORS.len()]);
        let lines: Vec<Vec<(f64, f64)>> = s
            .runs()
            .iter()
            .map(|r| decimate(r, x_range.start, x_range.end, columns))
            .collect();
        let mut pixels = vec![];
        for line in &lines {
            let px: Vec<(i32, i32)> = line.iter().map(|pt| chart.backend_coord(pt)).collect();
            // Each segment alone (see the module docs); a lone point as a dot.
            let segments = line
                .windows(2)
                .zip(px.windows(2))
                .filter(|(_, q)| q[0] != q[1])
                .map(|(d, _)| PathElement::new(vec![d[0], d[1]], color.stroke_width(2)));
            chart.draw_series(segments)?;
            if line.len() == 1 || s.data.len() <= 60 {
                chart.draw_series(line.iter().map(|&pt| Circle::new(pt, 3, color.filled())))?;
            }
            pixels.push(px);
        }
        out.push(DrawnSeries {
            color: (color.0, color.1, color.2),
            lines,
            pixels,
        });
    }
    Ok(out)
}

/// Centred gray text at backend pixel `(x, y)`.
fn root_text<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    text: &str,
    (x, y): (i32, i32),
    color: RGBColor,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    let (bx, by) = area.get_base_pixel();
    area.draw(&Text::new(
        text.to_string(),
        (x - bx, y - by),
        ("sans-serif", 15)
            .into_font()
            .color(&color)
            .pos(plotters::style::text_anchor::Pos::new(
                plotters::style::text_anchor::HPos::Center,
                plotters::style::text_anchor::VPos::Center,
            )),
    ))
}

/// The last `n` parts of the run directory's full path, as `a/b`.
fn path_tail(run: &Path, n: usize) -> String {
    let full = std::fs::canonicalize(run).unwrap_or_else(|_| run.to_path_buf());
    let parts: Vec<String> = full
        .components()
        .rev()
        .take(n)
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    let name: Vec<&str> = parts.iter().rev().map(String::as_str).collect();
    name.join("/")
}

/// The runs' names in legends: the fewest last parts of their paths that tell them apart
/// (`a`, `b` for runs/a and runs/b; `a/run`, `b/run` for runs/a/run and runs/b/run).
pub(crate) fn run_names(runs: &[PathBuf]) -> Vec<String> {
    let most = runs
        .iter()
        .map(|r| r.components().count())
        .max()
        .unwrap_or(1);
    let mut names = vec![];
    for n in 1..=most.max(1) {
        names = runs.iter().map(|r| path_tail(r, n)).collect();
        let mut distinct = names.clone();
        distinct.sort();
        distinct.dedup();
        if distinct.len() == names.len() {
            break;
        }
    }
    names
}

/// "tandem · demo/run · grpo, vanilla · 400 steps": the run's directory (its last two parts),
/// estimator and loss from its spec, and the last step.
pub fn title(run: &Path, spec: Option<&toml::Table>, metrics: &[Map<String, Value>]) -> String {
    let mut t = format!("tandem · {}", path_tail(run, 2));
    if spec.is_some() {
        t += &format!(
            " · {}, {}",
            spec_text(spec, "advantage", "estimator", "?"),
            spec_text(spec, "update", "loss", "vanilla")
        );
    }
    if let Some(last) = metrics.iter().filter_map(|r| r.get("step")?.as_u64()).max() {
        t += &format!(" · {last} steps");
    }
    t
}

/// What `tandem plot` reads of a run directory.
struct RunData {
    metrics: Vec<Map<String, Value>>,
    evals: Vec<Map<String, Value>>,
    spec: Option<toml::Table>,
}

impl RunData {
    fn read(dir: &Path) -> Result<RunData> {
        let run = RunDir::new(dir);
        let metrics = read_jsonl(&run.metrics_path())?;
        let evals = read_jsonl(&run.eval_path())?;
        if metrics.is_empty() && evals.is_empty() {
            bail_input!(
                "{}: no metrics.jsonl or eval.jsonl lines: not a run directory, or no step has finished yet",
                dir.display()
            );
        }
        let spec = std::fs::read_to_string(run.spec_path())
            .ok()
            .and_then(|t| t.parse().ok());
        Ok(RunData {
            metrics,
            evals,
            spec,
        })
    }

    fn panels(&self) -> Vec<Panel> {
        panels(&self.metrics, &self.evals, self.spec.as_ref())
    }
}

/// `tandem plot`: every run is read (and checked) before anything is drawn.
pub fn run(args: PlotArgs) -> Result<()> {
    if args.runs.len() > COLORS.len() {
        bail_input!(
            "plot: {} runs given; at most {} in one plot (one colour each)",
            args.runs.len(),
            COLORS.len()
        );
    }
    let runs: Vec<RunData> = args
        .runs
        .iter()
        .map(|r| RunData::read(r))
        .collect::<Result<_>>()?;
    let (panels, title, out) = match (&runs[..], &args.runs[..]) {
        ([one], [dir]) => (
            one.panels(),
            title(dir, one.spec.as_ref(), &one.metrics),
            RunDir::new(dir).root.join("plot.png"),
        ),
        _ => {
            let names = run_names(&args.runs);
            let title = format!("tandem · {}", names.join(" vs "));
            let named: Vec<(String, Vec<Panel>)> = names
                .into_iter()
                .zip(runs.iter().map(RunData::panels))
                .collect();
            (overlay(&named), title, PathBuf::from("plot.png"))
        }
    };
    let out = args.out.unwrap_or(out);
    let (panels, footnote) = with_data(panels);
    draw(&panels, &title, footnote.as_deref(), &out)?;
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

    fn spec(text: &str) -> toml::Table {
        text.parse().unwrap()
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
        let p = panels(&m, &e, None);
        assert_eq!(p.len(), 6);
        assert_eq!(p[0].series.len(), 2);
        assert_eq!(p[0].series[1].data, [(1.0, Some(0.0)), (2.0, Some(0.5))]);
        // one source: no per-source curve
        assert_eq!(p[1].series.len(), 1);
        // no spec: a KL loss that is not 0 is shown
        assert_eq!(p[2].series[0].data[1], (2.0, Some(0.02)));
        assert!(p[3].series.is_empty());
        assert_eq!(p[5].series[0].data, [(1.0, Some(2.0)), (2.0, Some(2.5))]);
    }

    #[test]
    fn identical_reward_and_accuracy_are_one_curve() {
        let m = rows(json!([
            {"step": 1, "reward/mean": 0.25, "accuracy": 0.25},
            {"step": 2, "reward/mean": 0.5, "accuracy": 0.5},
        ]));
        let p = panels(&m, &[], None);
        assert_eq!(p[0].series.len(), 1);
        assert_eq!(p[0].series[0].label, "reward mean = accuracy");
    }

    #[test]
    fn the_kl_panel_shows_the_kl_in_use() {
        let m = rows(json!([
            {"step": 1, "update/kl_loss": 0.0, "advantage/kl": 0.03},
            {"step": 2, "update/kl_loss": 0.0, "advantage/kl": 0.05},
        ]));
        // Nothing configured: kl_loss is 0 everywhere and not drawn; the panel says so.
        let none = spec("[update]\nloss = \"vanilla\"\n[advantage]\nestimator = \"grpo\"\n");
        let p = kl_panel(&m, Some(&none));
        assert!(p.series.is_empty());
        assert!(p.note.unwrap().contains("no KL term configured"));
        let m0 = rows(json!([{"step": 1, "update/kl_loss": 0.0}]));
        assert_eq!(
            kl_panel(&m0, None).note.as_deref(),
            Some("no KL term in the metrics")
        );
        // In the reward.
        let s = spec("[advantage]\nkl-in-reward = true\nkl-penalty = \"k2\"\nkl-coef = 0.01\n");
        let p = kl_panel(&m, Some(&s));
        assert_eq!(p.series.len(), 1);
        assert_eq!(p.series[0].label, "KL in the reward (k2, β 0.01)");
        assert_eq!(p.series[0].data[1], (2.0, Some(0.05)));
        assert_eq!(p.note, None);
        // As a loss, 0 or not.
        let s = spec("[update]\nuse-kl-loss = true\n");
        let p = kl_panel(&m, Some(&s));
        assert_eq!(p.series[0].label, "KL loss (k3, coef 0.001)");
        assert_eq!(p.series[0].data[0], (1.0, Some(0.0)));
    }

    #[test]
    fn runs_break_only_where_a_value_is_missing() {
        let s = Series {
            label: "x".into(),
            color: None,
            data: vec![
                (1.0, None),
                (2.0, Some(1.0)),
                (3.0, Some(2.0)),
                (4.0, None),
                (5.0, None),
                (6.0, Some(0.5)),
                (7.0, Some(0.0)),
            ],
        };
        assert_eq!(
            s.runs(),
            [vec![(2.0, 1.0), (3.0, 2.0)], vec![(6.0, 0.5), (7.0, 0.0)]]
        );
        assert_eq!(s.range(), Some((0.0, 2.0)));
    }

    #[test]
    fn decimate_keeps_each_columns_extremes_in_order() {
        // 10 points over 2 columns: x 0..4.5 in column 0, 5..9 in column 1.
        let run: Vec<(f64, f64)> = [3.0, 9.0, 1.0, 5.0, 4.0, 2.0, 2.0, 8.0, 0.5, 7.0]
            .iter()
            .enumerate()
            .map(|(i, &y)| (i as f64, y))
            .collect();
        let got = decimate(&run, 0.0, 10.0, 2);
        assert_eq!(
            got,
            [
                (0.0, 3.0),
                (1.0, 9.0),
                (2.0, 1.0),
                (4.0, 4.0),
                (5.0, 2.0),
                (7.0, 8.0),
                (8.0, 0.5),
                (9.0, 7.0)
            ]
        );
        // Few points: all of them.
        assert_eq!(decimate(&run, 0.0, 10.0, 5), run);
    }

    #[test]
    fn bounds_pad_and_never_collapse() {
        assert_eq!(bounds([0.0, 10.0].into_iter()), (-0.5, 10.5));
        assert_eq!(bounds([0.0].into_iter()), (-1.0, 1.0));
        let (lo, hi) = bounds([2.0, 2.0].into_iter());
        assert!(lo < 2.0 && hi > 2.0);
    }

    #[test]
    fn the_title_names_the_run() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path().join("demo").join("run");
        std::fs::create_dir_all(&run).unwrap();
        let s = spec("[advantage]\nestimator = \"grpo\"\n[update]\nloss = \"gspo\"\n");
        let m = rows(json!([{"step": 1}, {"step": 400}]));
        assert_eq!(
            title(&run, Some(&s), &m),
            "tandem · demo/run · grpo, gspo · 400 steps"
        );
    }

    type Rows = Vec<Map<String, Value>>;

    /// Where a series' colour may be drawn: its panel's plot area, the pixel rows its data
    /// spans, and the slack (the stroke, or a marker's radius).
    struct Span {
        plot: Rect,
        color: (u8, u8, u8),
        rows: Range<i32>,
        slack: i32,
    }

    /// xorshift: deterministic noise without a dependency.
    struct Noise(u64);
    impl Noise {
        fn next(&mut self) -> f64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            (self.0 >> 11) as f64 / (1u64 << 53) as f64
        }
    }

    /// A `steps`-step run as the runner writes it: noisy curves that zig-zag every step,
    /// accuracy missing on steps 300-309 (lines without the key), a null KL at step 500, an
    /// evaluation every 25 steps, the KL in the reward.
    fn synthetic_run(steps: u64) -> (Rows, Rows, toml::Table) {
        let mut r = Noise(7);
        let mut metrics = vec![];
        let mut evals = vec![];
        for step in 1..=steps {
            let t = step as f64 / steps as f64;
            let acc = (0.4 + 0.5 * t + 0.3 * (r.next() - 0.5)).clamp(0.0, 1.0);
            let len = 3.0 + 2.0 * r.next();
            let mut m = json!({
                "step": step,
                "reward/mean": acc + 0.1 * r.next(),
                "response_length/mean": len,
                "response_length/max": (len + 1.0 + 4.0 * r.next()).round(),
                "time/step": 0.5 + 0.3 * r.next() + if step % 97 == 0 { 5.0 } else { 0.0 },
                "entropy": 1.0 + 0.2 * r.next(),
                "update/kl_loss": 0.0,
                "advantage/kl": if step == 500 { Value::Null } else { json!(0.01 * t + 0.005 * r.next()) },
            });
            if !(300..310).contains(&step) {
                m["accuracy"] = json!(acc);
            }
            metrics.push(m.as_object().unwrap().clone());
            if step % 25 == 0 {
                let e =
                    json!({"step": step, "accuracy": (0.3 + 0.6 * t + 0.05 * r.next()).min(1.0)});
                evals.push(e.as_object().unwrap().clone());
            }
        }
        let spec = spec("[advantage]\nestimator = \"grpo\"\nkl-in-reward = true\n[update]\nloss = \"vanilla\"\n");
        (metrics, evals, spec)
    }

    fn inside(r: &Rect, (x, y): (i32, i32), pad: i32) -> bool {
        x >= r.0.start - pad && x < r.0.end + pad && y >= r.1.start - pad && y < r.1.end + pad
    }

    /// What a 1,000-step run's plot draws is true: every vertex is a data point of its series,
    /// within the series' range and inside its panel; lines break exactly where data is
    /// missing; and every pixel drawn in a series' colour lies in its panel's plot area, within
    /// the rows its data spans, or in the legend above it.
    #[test]
    fn a_1000_step_plot_draws_only_its_data() {
        let (metrics, evals, spec) = synthetic_run(1000);
        let panels = panels(&metrics, &evals, Some(&spec));
        assert_eq!(panels[2].series.len(), 1, "the in-reward KL");
        assert_eq!(panels[0].series.len(), 2, "reward and accuracy differ here");
        let (w, h) = SIZE;
        let mut buf = vec![0u8; (w * h * 3) as usize];
        let drawn = {
            let root = BitMapBackend::with_buffer(&mut buf, SIZE).into_drawing_area();
            let d = render(&root, &panels, "synthetic", None).unwrap();
            root.present().unwrap();
            d
        };
        assert_eq!(drawn.len(), 6);
        // Per panel and series colour: the pixel rows its data spans.
        let mut spans: Vec<Span> = vec![];
        for (panel, d) in panels.iter().zip(&drawn) {
            if let Some(l) = &d.legend {
                assert!(
                    l.1.end <= d.plot.1.start,
                    "{}: the legend overlaps the plot",
                    d.title
                );
            }
            for (s, ds) in panel.series.iter().zip(&d.series) {
                let (lo, hi) = s.range().unwrap();
                let runs = s.runs();
                assert_eq!(
                    ds.lines.len(),
                    runs.len(),
                    "{}: a gap without missing data",
                    s.label
                );
                let (mut top, mut bottom) = (i32::MAX, i32::MIN);
                for ((line, run), px) in ds.lines.iter().zip(&runs).zip(&ds.pixels) {
                    // The line starts and ends where its run does: no gap inside a run.
                    assert_eq!(line.first(), run.first(), "{}", s.label);
                    assert_eq!(line.last(), run.last(), "{}", s.label);
                    assert!(line.len() <= 4 * (d.plot.0.end - d.plot.0.start) as usize + 4);
                    for (pt, &p) in line.iter().zip(px) {
                        assert!(run.contains(pt), "{}: {pt:?} is not a data point", s.label);
                        assert!(pt.1 >= lo && pt.1 <= hi, "{}: {pt:?}", s.label);
                        assert!(d.x_range.contains(&pt.0) || pt.0 == d.x_range.end);
                        assert!(d.y_range.contains(&pt.1), "{}: {pt:?}", s.label);
                        assert!(
                            inside(&d.plot, p, 0),
                            "{}: pixel {p:?} outside {:?}",
                            s.label,
                            d.plot
                        );
                        (top, bottom) = (top.min(p.1), bottom.max(p.1 + 1));
                    }
                    // The line reaches the run's extremes.
                    let (rlo, rhi) = run
                        .iter()
                        .fold((f64::MAX, f64::MIN), |a, p| (a.0.min(p.1), a.1.max(p.1)));
                    assert!(line.iter().any(|p| p.1 == rlo) && line.iter().any(|p| p.1 == rhi));
                }
                let slack = if s.data.len() <= 60 { 4 } else { 1 };
                spans.push(Span {
                    plot: d.plot.clone(),
                    color: ds.color,
                    rows: top..bottom,
                    slack,
                });
            }
        }
        // The accuracy breaks at steps 300-309 and the in-reward KL at step 500.
        assert_eq!(panels[0].series[1].runs().len(), 2);
        assert_eq!(panels[0].series[1].runs()[0].last().unwrap().0, 299.0);
        assert_eq!(panels[0].series[1].runs()[1][0].0, 310.0);
        assert_eq!(panels[2].series[0].runs().len(), 2);
        // The PNG (kept where TANDEM_TEST_PLOT says, to look at).
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("plot.png");
        draw(&panels, "synthetic", None, &out).unwrap();
        assert_eq!(&std::fs::read(&out).unwrap()[..8], b"\x89PNG\r\n\x1a\n");
        if let Ok(keep) = std::env::var("TANDEM_TEST_PLOT") {
            std::fs::copy(&out, keep).unwrap();
        }
        // Pixels in a series' colour.
        let legends: Vec<Rect> = drawn.iter().filter_map(|d| d.legend.clone()).collect();
        let mut counted = 0;
        for y in 0..h as i32 {
            for x in 0..w as i32 {
                let i = ((y as u32 * w + x as u32) * 3) as usize;
                let c = (buf[i], buf[i + 1], buf[i + 2]);
                let mine: Vec<&Span> = spans.iter().filter(|s| s.color == c).collect();
                if mine.is_empty() {
                    continue;
                }
                counted += 1;
                let ok = legends.iter().any(|l| inside(l, (x, y), 0))
                    || mine.iter().any(|s| {
                        let k = s.slack;
                        inside(&s.plot, (x, y), k) && y >= s.rows.start - k && y < s.rows.end + k
                    });
                assert!(ok, "a series pixel at ({x}, {y}) outside its data's place");
            }
        }
        assert!(counted > 10_000, "{counted} series pixels");
    }

    /// Renders into an RGB buffer: the buffer and what was drawn.
    fn render_rgb(panels: &[Panel], footnote: Option<&str>) -> (Vec<u8>, Vec<DrawnPanel>) {
        let (w, h) = SIZE;
        let mut buf = vec![0u8; (w * h * 3) as usize];
        let drawn = {
            let root = BitMapBackend::with_buffer(&mut buf, SIZE).into_drawing_area();
            let d = render(&root, panels, "t", footnote).unwrap();
            root.present().unwrap();
            d
        };
        (buf, drawn)
    }

    fn pixel(buf: &[u8], (x, y): (i32, i32)) -> (u8, u8, u8) {
        let i = ((y as u32 * SIZE.0 + x as u32) * 3) as usize;
        (buf[i], buf[i + 1], buf[i + 2])
    }

    /// Whether a pixel of `color` is drawn inside `r`.
    fn has_color(buf: &[u8], r: &Rect, color: RGBColor) -> bool {
        r.1.clone().any(|y| {
            r.0.clone()
                .any(|x| pixel(buf, (x, y)) == (color.0, color.1, color.2))
        })
    }

    #[test]
    fn grids_fill_their_rows() {
        let got: Vec<Vec<usize>> = (1..=6).map(grid).collect();
        assert_eq!(
            got,
            [
                vec![1],
                vec![2],
                vec![3],
                vec![2, 2],
                vec![3, 2],
                vec![3, 3]
            ]
        );
    }

    #[test]
    fn a_panel_without_data_gives_its_space_to_the_others() {
        let (mut metrics, evals, _) = synthetic_run(40);
        for m in &mut metrics {
            m.remove("advantage/kl");
        }
        let none = spec("[advantage]\nestimator = \"grpo\"\n[update]\nloss = \"vanilla\"\n");
        let (kept, footnote) = with_data(panels(&metrics, &evals, Some(&none)));
        let titles: Vec<&str> = kept.iter().map(|p| p.title.as_str()).collect();
        assert_eq!(
            titles,
            [
                "reward and accuracy (train)",
                "eval accuracy",
                "entropy",
                "response length (tokens)",
                "seconds per step"
            ]
        );
        let footnote = footnote.unwrap();
        assert_eq!(
            footnote,
            "no data: KL to the reference: no KL term configured (use-kl-loss and kl-in-reward are off)"
        );
        let (buf, drawn) = render_rgb(&kept, Some(&footnote));
        assert_eq!(drawn.len(), 5);
        // Three panels on the first row, two on the second, each row's panels sharing its
        // whole width; the rows stacked without a gap down to the footnote.
        let (w, h) = (SIZE.0 as i32, SIZE.1 as i32);
        let rows = [&drawn[..3], &drawn[3..]];
        for row in rows {
            assert_eq!(row[0].area.0.start, 0);
            assert_eq!(row.last().unwrap().area.0.end, w);
            for pair in row.windows(2) {
                assert_eq!(pair[0].area.0.end, pair[1].area.0.start);
                assert_eq!(pair[0].area.1, pair[1].area.1);
            }
        }
        let width = |d: &DrawnPanel| d.area.0.end - d.area.0.start;
        assert!((width(&drawn[3]) - w / 2).abs() <= 1);
        assert!((width(&drawn[0]) - w / 3).abs() <= 1);
        assert_eq!(drawn[0].area.1.end, drawn[3].area.1.start);
        assert_eq!(drawn[3].area.1.end, h - FOOTNOTE_H as i32);
        // The footnote is drawn under them.
        let foot: Rect = (0..w, h - FOOTNOTE_H as i32..h);
        assert!(has_color(&buf, &foot, RGBColor(120, 120, 120)));
        // Every panel with data: nothing left out, no footnote.
        let (all, none) = with_data(panels(&synthetic_run(40).0, &evals, None));
        assert_eq!((all.len(), none), (6, None));
    }

    #[test]
    fn runs_overlay_in_every_panel_one_colour_each() {
        let (ma, ea, sa) = synthetic_run(40);
        let (mut mb, eb, sb) = synthetic_run(30);
        // Run b learns faster: its curves differ from a's.
        for m in &mut mb {
            let acc = m["accuracy"].as_f64().map(|a| (a + 0.2).min(1.0));
            m.insert("accuracy".into(), json!(acc));
        }
        let runs = vec![
            ("a".to_string(), panels(&ma, &ea, Some(&sa))),
            ("b".to_string(), panels(&mb, &eb, Some(&sb))),
        ];
        let merged = overlay(&runs);
        assert_eq!(merged.len(), 6);
        for (i, p) in merged.iter().enumerate() {
            for (r, (name, own)) in runs.iter().enumerate() {
                let mine: Vec<&Series> = p
                    .series
                    .iter()
                    .filter(|s| s.label.starts_with(&format!("{name}: ")))
                    .collect();
                assert_eq!(mine.len(), own[i].series.len(), "{}: {name}", p.title);
                assert!(!mine.is_empty(), "{}: {name}", p.title);
                for (k, (s, o)) in mine.iter().zip(&own[i].series).enumerate() {
                    assert_eq!(s.label, format!("{name}: {}", o.label));
                    assert_eq!(s.data, o.data);
                    assert_eq!(s.color, Some(shade(COLORS[r], k)));
                }
            }
        }
        assert_eq!(shade(COLORS[0], 0), COLORS[0]);
        assert_eq!(shade(RGBColor(0, 100, 255), 1), RGBColor(102, 162, 255));
        // Both runs' lines in every panel's plot area.
        let (buf, drawn) = render_rgb(&merged, None);
        for d in &drawn {
            for color in [COLORS[0], COLORS[1]] {
                assert!(has_color(&buf, &d.plot, color), "{}: {color:?}", d.title);
            }
        }
    }

    #[test]
    fn run_names_are_the_shortest_distinct_tails() {
        let paths = |ps: &[&str]| ps.iter().map(PathBuf::from).collect::<Vec<_>>();
        assert_eq!(run_names(&paths(&["runs/a", "runs/b"])), ["a", "b"]);
        assert_eq!(
            run_names(&paths(&["x/a/run", "x/b/run"])),
            ["a/run", "b/run"]
        );
        assert_eq!(run_names(&paths(&["runs/a"])), ["a"]);
    }

    #[test]
    fn draws_a_png() {
        let dir = tempfile::tempdir().unwrap();
        let m = rows(json!([{"step": 1, "reward/mean": 0.1}, {"step": 2, "reward/mean": 0.4}]));
        let out = dir.path().join("p.png");
        draw(&panels(&m, &[], None), "t", None, &out).unwrap();
        let bytes = std::fs::read(&out).unwrap();
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
        assert!(!dir.path().join("p.tmp.png").exists());
    }
}
