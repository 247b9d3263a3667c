//! SVG plots of a [`Report`] with `plotters` (SVG backend only: text is written as SVG `<text>`
//! and laid out by plotters' estimate, so no font library or fontconfig is needed).

use crate::report::Report;
use plotters::prelude::*;
use std::path::Path;

const SIZE: (u32, u32) = (900, 520);

fn color(i: usize) -> RGBColor {
    // matplotlib's tab20, dark shades first: 20 contenders stay distinct.
    const C: [RGBColor; 20] = [
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
        RGBColor(174, 199, 232),
        RGBColor(255, 187, 120),
        RGBColor(152, 223, 138),
        RGBColor(255, 152, 150),
        RGBColor(197, 176, 213),
        RGBColor(196, 156, 148),
        RGBColor(247, 182, 210),
        RGBColor(199, 199, 199),
        RGBColor(219, 219, 141),
        RGBColor(158, 218, 229),
    ];
    C[i % C.len()]
}

/// The size of a line chart with a legend of `n` series in its lower right corner: taller
/// with more series, so that the legend leaves the curves visible.
fn lines_size(n: usize) -> (u32, u32) {
    (SIZE.0 + 100, SIZE.1.max(300 + 21 * n as u32))
}

fn err<E: std::fmt::Display>(e: E) -> String {
    format!("plot: {e}")
}

/// Writes every plot into `dir`; returns the file names.
pub fn write_all(report: &Report, dir: &Path) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    for (name, f) in [
        (
            "ttft_cdf.svg",
            ttft_cdf as fn(&Report, &Path) -> Result<(), String>,
        ),
        ("throughput.svg", throughput),
        ("hit_rate.svg", hit_rate),
        ("hit_rate_over_time.svg", hit_rate_over_time),
        ("load_spread.svg", load_spread),
    ] {
        f(report, &dir.join(name))?;
        out.push(name.to_string());
    }
    Ok(out)
}

/// TTFT CDF per contender (median run).
fn ttft_cdf(r: &Report, path: &Path) -> Result<(), String> {
    let root = SVGBackend::new(path, lines_size(r.contenders.len())).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let xmax = r
        .contenders
        .iter()
        .flat_map(|c| c.ttfts_ms.last())
        .fold(1.0f64, |a, &b| a.max(b))
        * 1.05;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "TTFT distribution per contender (wall ms)",
            ("sans-serif", 22),
        )
        .margin(20)
        .x_label_area_size(45)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..xmax, 0f64..1.0)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("TTFT (ms)")
        .y_desc("fraction of requests")
        .draw()
        .map_err(err)?;
    for (i, c) in r.contenders.iter().enumerate() {
        let n = c.ttfts_ms.len().max(1) as f64;
        let pts: Vec<(f64, f64)> = c
            .ttfts_ms
            .iter()
            .enumerate()
            .map(|(k, &t)| (t, (k + 1) as f64 / n))
            .collect();
        let col = color(i);
        chart
            .draw_series(LineSeries::new(pts, col.stroke_width(2)))
            .map_err(err)?
            .label(c.name.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], col.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)
}

/// Width of the plots with one row per contender, and of their label column (contender names
/// are long: `cache_aware x8 no-mesh`, `smg cache_aware ×3 meshed`).
const ROWS_WIDTH: u32 = 1000;
const ROW_LABELS: u32 = 260;
const ROW_HEIGHT: u32 = 26;

/// The size of a plot with one row per item: it grows with the contenders, so that every
/// label stays readable however many there are.
fn rows_size(n: usize) -> (u32, u32) {
    (ROWS_WIDTH, 140 + ROW_HEIGHT * n.max(1) as u32)
}

/// Row `i` of `n` counted from the top (the first contender on top).
fn row_y(i: usize, n: usize) -> f64 {
    (n - 1 - i) as f64
}

/// The label of the row whose middle is at `y` (rows counted from the top), "" between rows.
fn row_label(labels: &[String], y: f64) -> String {
    let n = labels.len();
    if n == 0 || (y.fract() - 0.5).abs() >= 0.01 {
        return String::new();
    }
    labels[n - 1 - (y as usize).min(n - 1)].clone()
}

/// One horizontal bar per label, the labels in a column on the left.
fn bars(
    path: &Path,
    title: &str,
    xdesc: &str,
    items: &[(String, f64)],
    xmax: f64,
    percent: bool,
) -> Result<(), String> {
    let n = items.len().max(1);
    let root = SVGBackend::new(path, rows_size(n)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let labels: Vec<String> = items.iter().map(|(l, _)| l.clone()).collect();
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(20)
        .x_label_area_size(40)
        .y_label_area_size(ROW_LABELS)
        .build_cartesian_2d(0f64..xmax, 0f64..n as f64)
        .map_err(err)?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .y_labels(n * 2 + 1)
        .y_label_style(("sans-serif", 14))
        .y_label_formatter(&|y| row_label(&labels, *y))
        .x_desc(xdesc)
        .draw()
        .map_err(err)?;
    chart
        .draw_series(items.iter().enumerate().map(|(i, (_, v))| {
            let y = row_y(i, n);
            Rectangle::new([(0.0, y + 0.15), (*v, y + 0.85)], color(i).filled())
        }))
        .map_err(err)?;
    chart
        .draw_series(items.iter().enumerate().map(|(i, (_, v))| {
            let txt = if percent {
                format!("{:.1}%", v * 100.0)
            } else {
                format!("{v:.0}")
            };
            Text::new(
                txt,
                (*v + xmax * 0.01, row_y(i, n) + 0.75),
                ("sans-serif", 14),
            )
        }))
        .map_err(err)?;
    root.present().map_err(err)
}

/// Output tokens/s by contender (median over repeats).
fn throughput(r: &Report, path: &Path) -> Result<(), String> {
    let items: Vec<(String, f64)> = r
        .contenders
        .iter()
        .map(|c| (c.name.clone(), c.output_tokens_per_s))
        .collect();
    let ymax = items.iter().fold(1.0f64, |a, (_, v)| a.max(*v)) * 1.15;
    bars(
        path,
        "Output tokens per second (wall, median)",
        "output tokens / s",
        &items,
        ymax,
        false,
    )
}

/// Engine-reported hit rate by contender, with the evaluator's oracle as the ceiling.
fn hit_rate(r: &Report, path: &Path) -> Result<(), String> {
    let mut items: Vec<(String, f64)> = r
        .contenders
        .iter()
        .map(|c| (c.name.clone(), c.hit_rate))
        .collect();
    if let Some(o) = r.evaluator.iter().find(|e| e.name == "oracle") {
        items.push(("oracle (virtual)".into(), o.hit_rate));
    }
    bars(
        path,
        "Engine-reported prefix-cache hit rate",
        "hits / queries",
        &items,
        1.1,
        true,
    )
}

/// Client-side hit rate over the run (tenths of the run) per contender.
fn hit_rate_over_time(r: &Report, path: &Path) -> Result<(), String> {
    let root = SVGBackend::new(path, lines_size(r.contenders.len())).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let xmax = r
        .contenders
        .iter()
        .map(|c| c.elapsed_s)
        .fold(1e-3f64, f64::max);
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "Hit rate over the run (cached / prompt tokens by send time)",
            ("sans-serif", 22),
        )
        .margin(20)
        .x_label_area_size(45)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..xmax, 0f64..1.05)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("seconds since start (wall)")
        .y_desc("hit rate")
        .draw()
        .map_err(err)?;
    for (i, c) in r.contenders.iter().enumerate() {
        let col = color(i);
        chart
            .draw_series(LineSeries::new(c.timeline.clone(), col.stroke_width(2)))
            .map_err(err)?
            .label(c.name.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], col.stroke_width(2)));
        chart
            .draw_series(c.timeline.iter().map(|&p| Circle::new(p, 3, col.filled())))
            .map_err(err)?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)
}

/// Requests per engine, grouped by contender: a row per contender, a thin bar per engine.
fn load_spread(r: &Report, path: &Path) -> Result<(), String> {
    let n = r.contenders.len().max(1);
    let root = SVGBackend::new(path, rows_size(n)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let xmax = r
        .contenders
        .iter()
        .flat_map(|c| c.per_engine.iter().map(|(_, v)| *v as f64))
        .fold(1.0f64, f64::max)
        * 1.1;
    let labels: Vec<String> = r
        .contenders
        .iter()
        .map(|c| format!("{} (spread {:.2})", c.name, c.load_spread))
        .collect();
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "Requests per engine by contender (bars: engine 0, 1, ... top to bottom)",
            ("sans-serif", 20),
        )
        .margin(20)
        .x_label_area_size(40)
        .y_label_area_size(ROW_LABELS + 40)
        .build_cartesian_2d(0f64..xmax, 0f64..n as f64)
        .map_err(err)?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .y_labels(n * 2 + 1)
        .y_label_style(("sans-serif", 14))
        .y_label_formatter(&|y| row_label(&labels, *y))
        .x_desc("requests")
        .draw()
        .map_err(err)?;
    for (i, c) in r.contenders.iter().enumerate() {
        let k = c.per_engine.len().max(1) as f64;
        let h = 0.8 / k;
        let top = row_y(i, n) + 0.9;
        chart
            .draw_series(c.per_engine.iter().enumerate().map(|(e, (_, v))| {
                let y1 = top - e as f64 * h;
                Rectangle::new([(0.0, y1 - h * 0.9), (*v as f64, y1)], color(e).filled())
            }))
            .map_err(err)?;
    }
    root.present().map_err(err)
}
