//! `tandem inspect FILE.parquet [--rows N] [--sort score]`: a batch as a readable table
//! (prompt, response, score, advantage, mean log-prob), whatever stage wrote it.

use crate::bail_input;
use crate::batch::{schema, Batch};
use anyhow::Result;
use clap::Args;
use std::path::PathBuf;

#[derive(Args, Debug, Clone)]
#[command(about = "Show a batch file as a table (prompt, response, score, advantage, log-prob)")]
pub struct InspectArgs {
    /// A batch or prompt file.
    pub file: PathBuf,
    /// How many rows to show.
    #[arg(long, default_value_t = 10)]
    pub rows: usize,
    /// Sort by this column, highest first: score, advantage, logprob, length, or any float
    /// column of the file.
    #[arg(long)]
    pub sort: Option<String>,
    /// Sort lowest first.
    #[arg(long)]
    pub asc: bool,
    /// Characters shown of each text cell (prompt, response).
    #[arg(long, default_value_t = 48)]
    pub chars: usize,
}

/// One displayed column: a header and a cell per row of the file.
struct Col {
    name: String,
    cells: Vec<String>,
    /// Sort key per row, for numeric columns.
    keys: Option<Vec<f64>>,
    numeric: bool,
}

/// Mean of each row's values over model tokens (mask 1, or all tokens without a mask).
fn row_means(batch: &Batch, name: &str) -> Result<Vec<f64>> {
    let x = batch.ragged_f32(name)?;
    let mask = if batch.has(schema::RESPONSE_MASK) {
        Some(batch.ragged_u8(schema::RESPONSE_MASK)?)
    } else {
        None
    };
    Ok((0..x.num_rows())
        .map(|i| {
            let (mut s, mut n) = (0.0f64, 0usize);
            for (j, v) in x.row(i).iter().enumerate() {
                if mask.as_ref().is_none_or(|m| m.row(i)[j] != 0) {
                    s += *v as f64;
                    n += 1;
                }
            }
            if n == 0 {
                f64::NAN
            } else {
                s / n as f64
            }
        })
        .collect())
}

/// Text of a prompt cell: the last message's content of chat messages, or the text itself.
fn prompt_text(v: serde_json::Value) -> String {
    match v {
        serde_json::Value::Array(msgs) => msgs
            .last()
            .and_then(|m| m.get("content"))
            .and_then(|c| c.as_str())
            .map(str::to_string)
            .unwrap_or_default(),
        serde_json::Value::String(s) => s,
        serde_json::Value::Null => String::new(),
        other => other.to_string(),
    }
}

/// One line, control characters made visible, cut to `max` characters with an ellipsis.
pub(crate) fn cell_text(s: &str, max: usize) -> String {
    let flat: String = s
        .chars()
        .flat_map(|c| match c {
            '\n' => vec!['\\', 'n'],
            '\t' => vec!['\\', 't'],
            '\r' => vec!['\\', 'r'],
            // Other control characters would break the table's columns.
            c if c.is_control() => format!("\\x{:02x}", c as u32).chars().collect(),
            c => vec![c],
        })
        .collect();
    if flat.chars().count() <= max {
        flat
    } else {
        let mut t: String = flat.chars().take(max.saturating_sub(1)).collect();
        t.push('…');
        t
    }
}

fn fmt_num(v: f64) -> String {
    if v.is_nan() {
        "-".into()
    } else {
        format!("{v:.3}")
    }
}

fn numeric(name: &str, values: Vec<f64>) -> Col {
    Col {
        name: name.into(),
        cells: values.iter().map(|&v| fmt_num(v)).collect(),
        keys: Some(values),
        numeric: true,
    }
}

/// The table as text.
pub fn render(args: &InspectArgs) -> Result<String> {
    let batch = Batch::read(&args.file, &[])?;
    let n = batch.num_rows();
    let cols = columns(&batch, args)?;
    let mut order = row_order(&batch, &cols, args)?;
    order.truncate(args.rows);
    let mut out = heading(&batch, args);
    out += &aligned(&cols, &order);
    if order.len() < n {
        out += &format!("({} of {n} rows shown; --rows N for more)\n", order.len());
    }
    Ok(out)
}

/// The columns shown, those of the batch's schema that it has: source, prompt, response,
/// baseline (when some rows are ReMax's greedy baselines), length, score, advantage, logprob.
fn columns(batch: &Batch, args: &InspectArgs) -> Result<Vec<Col>> {
    let mut cols: Vec<Col> = Vec::new();
    if batch.has(schema::DATA_SOURCE) {
        let v = batch.strings(schema::DATA_SOURCE)?;
        cols.push(Col {
            name: "source".into(),
            cells: v.iter().map(|s| cell_text(s, 16)).collect(),
            keys: None,
            numeric: false,
        });
    }
    if batch.has(schema::PROMPT) {
        let cells = batch
            .json_rows(schema::PROMPT)
            .into_iter()
            .map(|v| cell_text(&prompt_text(v), args.chars))
            .collect();
        cols.push(Col {
            name: "prompt".into(),
            cells,
            keys: None,
            numeric: false,
        });
    }
    if batch.has(schema::RESPONSE_TEXT) {
        let v = batch.strings(schema::RESPONSE_TEXT)?;
        cols.push(Col {
            name: "response".into(),
            cells: v.iter().map(|s| cell_text(s, args.chars)).collect(),
            keys: None,
            numeric: false,
        });
    }
    let baseline = batch.baseline_rows()?;
    if baseline.contains(&true) {
        // ReMax's greedy rows: scored, but not samples.
        cols.push(Col {
            name: "baseline".into(),
            cells: baseline
                .iter()
                .map(|&b| if b { "greedy" } else { "" }.into())
                .collect(),
            keys: None,
            numeric: false,
        });
    }
    if batch.has(schema::RESPONSE_IDS) {
        let r = batch.ragged_i32(schema::RESPONSE_IDS)?;
        cols.push(Col {
            name: "length".into(),
            cells: r.rows().map(|x| x.len().to_string()).collect(),
            keys: Some(r.rows().map(|x| x.len() as f64).collect()),
            numeric: true,
        });
    }
    if batch.has(schema::SCORE) {
        let v = batch.f32s(schema::SCORE)?;
        cols.push(numeric("score", v.iter().map(|&x| x as f64).collect()));
    }
    if batch.has(schema::ADVANTAGES) {
        cols.push(numeric("advantage", row_means(batch, schema::ADVANTAGES)?));
    }
    let lp = [schema::OLD_LOGPROBS, schema::ROLLOUT_LOGPROBS]
        .into_iter()
        .find(|c| batch.has(c));
    if let Some(c) = lp {
        cols.push(numeric("logprob", row_means(batch, c)?));
    }
    Ok(cols)
}

/// The rows in the order shown: as stored, or by `--sort` (a shown numeric column, or any
/// float column of the batch).
fn row_order(batch: &Batch, cols: &[Col], args: &InspectArgs) -> Result<Vec<usize>> {
    let n = batch.num_rows();
    let mut order: Vec<usize> = (0..n).collect();
    if let Some(key) = &args.sort {
        let keys: Vec<f64> = match cols.iter().find(|c| c.name == *key && c.keys.is_some()) {
            Some(c) => c.keys.clone().expect("checked"),
            None if batch.has(key) && schema::kind_of(key) == Some(schema::Kind::F32) => {
                batch.f32s(key)?.iter().map(|&x| x as f64).collect()
            }
            None if batch.has(key) => match batch.ragged_f32(key) {
                Ok(_) => row_means(batch, key)?,
                Err(_) => batch.f32s(key)?.iter().map(|&x| x as f64).collect(),
            },
            None => {
                let shown: Vec<&str> = cols
                    .iter()
                    .filter(|c| c.keys.is_some())
                    .map(|c| c.name.as_str())
                    .collect();
                bail_input!(
                    "--sort {key}: {} has no such numeric column (sortable here: {})",
                    args.file.display(),
                    shown.join(", ")
                )
            }
        };
        // NaN (rows without tokens) sort last either way.
        order.sort_by(|&a, &b| {
            let (x, y) = (keys[a], keys[b]);
            match (x.is_nan(), y.is_nan()) {
                (true, true) => std::cmp::Ordering::Equal,
                (true, false) => std::cmp::Ordering::Greater,
                (false, true) => std::cmp::Ordering::Less,
                _ if args.asc => x.total_cmp(&y),
                _ => y.total_cmp(&x),
            }
        });
    }
    Ok(order)
}

/// The file's line (rows, columns) and its metadata's step and policy version.
fn heading(batch: &Batch, args: &InspectArgs) -> String {
    let n = batch.num_rows();
    let mut out = String::new();
    let names: Vec<String> = batch
        .data
        .schema()
        .fields()
        .iter()
        .map(|f| f.name().clone())
        .collect();
    out += &format!(
        "{}: {n} rows; columns: {}\n",
        args.file.display(),
        names.join(", ")
    );
    let meta: Vec<String> = ["step", "policy_version"]
        .iter()
        .filter_map(|k| batch.meta.get(*k).map(|v| format!("{k}={v}")))
        .collect();
    if !meta.is_empty() {
        out += &format!("{}\n", meta.join(" "));
    }
    out
}

/// The rows `order` of `cols` as aligned text (numbers to the right).
fn aligned(cols: &[Col], order: &[usize]) -> String {
    let mut out = String::new();
    let mut table: Vec<Vec<String>> = Vec::new();
    let mut header = vec!["row".to_string()];
    header.extend(cols.iter().map(|c| c.name.clone()));
    table.push(header);
    for &r in order {
        let mut line = vec![r.to_string()];
        line.extend(cols.iter().map(|c| c.cells[r].clone()));
        table.push(line);
    }
    let widths: Vec<usize> = (0..table[0].len())
        .map(|j| {
            table
                .iter()
                .map(|l| l[j].chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let right: Vec<bool> = std::iter::once(true)
        .chain(cols.iter().map(|c| c.numeric))
        .collect();
    for line in &table {
        let cells: Vec<String> = line
            .iter()
            .enumerate()
            .map(|(j, s)| {
                let pad = widths[j] - s.chars().count();
                if right[j] {
                    format!("{}{s}", " ".repeat(pad))
                } else {
                    format!("{s}{}", " ".repeat(pad))
                }
            })
            .collect();
        out += cells.join("  ").trim_end();
        out.push('\n');
    }
    out
}

/// `tandem inspect`.
pub fn run(args: InspectArgs) -> Result<()> {
    print!("{}", render(&args)?);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cells_are_one_line_and_cut() {
        assert_eq!(cell_text("a\nb", 10), "a\\nb");
        assert_eq!(cell_text("a\u{7f}b", 10), "a\\x7fb");
        assert_eq!(cell_text("abcdef", 4), "abc…");
        assert_eq!(cell_text("abcd", 4), "abcd");
        assert_eq!(
            prompt_text(serde_json::json!([
                {"role": "system", "content": "s"},
                {"role": "user", "content": "q?"}
            ])),
            "q?"
        );
        assert_eq!(prompt_text(serde_json::json!("plain")), "plain");
    }
}
