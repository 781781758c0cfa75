//! PNG plots of the bench's figures, drawn in-process with plotters.

use crate::traffic::Series;
use anyhow::{anyhow, Context as _, Result};
use plotters::prelude::*;
use std::path::Path;

/// Installed by `cargo xtask setup` (Debian's fonts-dejavu-core).
const FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";
const COLOURS: [RGBColor; 8] = [
    RGBColor(200, 30, 30),
    RGBColor(30, 90, 200),
    GREEN,
    MAGENTA,
    RGBColor(230, 140, 0),
    RGBColor(0, 170, 170),
    RGBColor(120, 70, 30),
    BLACK,
];

/// Makes the font known to plotters' text renderer; once per process.
pub fn register_font() -> Result<()> {
    let bytes = std::fs::read(FONT).with_context(|| format!("cannot read {FONT}"))?;
    plotters::style::register_font(
        "sans-serif",
        FontStyle::Normal,
        Box::leak(bytes.into_boxed_slice()),
    )
    .map_err(|_| anyhow!("{FONT} is not a usable font"))
}

fn err<E: std::fmt::Debug>(error: E) -> anyhow::Error {
    anyhow!("plotting failed: {error:?}")
}

/// Rate over time, one line per tool, with the configured rate as a dashed black line.
pub fn rate_over_time(
    path: &Path,
    title: &str,
    series: &[(String, Series)],
    configured_mbit: f64,
) -> Result<()> {
    let top = values(series).fold(configured_mbit * 1.5, f64::max);
    lines_over_time(
        path,
        &Axes {
            title,
            x_desc: "time (s), 100 ms bins",
            y_desc: "Mbit/s received",
            y_range: 0.0..top,
            stroke: 2,
            legend: SeriesLabelPosition::UpperLeft,
        },
        series,
        Some(("configured rate", configured_mbit)),
    )
}

/// The y values of every series.
fn values(series: &[(String, Series)]) -> impl Iterator<Item = f64> + '_ {
    series
        .iter()
        .flat_map(|(_, points)| points.iter().map(|p| p.1))
}

/// What a time-series chart shows besides its lines.
struct Axes<'a> {
    title: &'a str,
    x_desc: &'a str,
    y_desc: &'a str,
    y_range: std::ops::Range<f64>,
    stroke: u32,
    legend: SeriesLabelPosition,
}

/// One line per series over time (x from 0 to the last point), and optionally a dashed
/// black reference line at a labelled level.
fn lines_over_time(
    path: &Path,
    axes: &Axes,
    series: &[(String, Series)],
    reference: Option<(&str, f64)>,
) -> Result<()> {
    let end = series
        .iter()
        .flat_map(|(_, points)| points.iter().map(|p| p.0))
        .fold(1.0, f64::max);
    let root = BitMapBackend::new(path, (1000, 450)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(axes.title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..end, axes.y_range.clone())
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc(axes.x_desc)
        .y_desc(axes.y_desc)
        .draw()
        .map_err(err)?;
    for (index, (label, points)) in series.iter().enumerate() {
        let colour = COLOURS[index % COLOURS.len()];
        chart
            .draw_series(LineSeries::new(
                points.clone(),
                colour.stroke_width(axes.stroke),
            ))
            .map_err(err)?
            .label(label.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], colour));
    }
    if let Some((label, level)) = reference {
        chart
            .draw_series(DashedLineSeries::new(
                vec![(0.0, level), (end, level)],
                6,
                4,
                BLACK.into(),
            ))
            .map_err(err)?
            .label(label)
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLACK));
    }
    chart
        .configure_series_labels()
        .position(axes.legend.clone())
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)?;
    Ok(())
}

/// ns per packet against the number of live flows and of classes (log scale), with the
/// empty program's cost as the floor.
pub fn cost_vs_scale(
    path: &Path,
    flows: &[(f64, f64)],
    classes: &[(f64, f64)],
    floor_ns: f64,
) -> Result<()> {
    let right = flows
        .iter()
        .chain(classes)
        .map(|p| p.0)
        .fold(10.0, f64::max)
        * 2.0;
    let top = flows
        .iter()
        .chain(classes)
        .map(|p| p.1)
        .fold(floor_ns, f64::max)
        * 1.3;
    let root = BitMapBackend::new(path, (1000, 450)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "Per-packet cost (BPF_PROG_TEST_RUN, median)",
            ("sans-serif", 22),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d((1.0..right).log_scale(), 0.0..top)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("live flows in the per-flow table / classes attached")
        .y_desc("ns per packet")
        .draw()
        .map_err(err)?;
    for (index, (label, points)) in [("1 class, N live flows", flows), ("N classes", classes)]
        .into_iter()
        .enumerate()
    {
        let colour = COLOURS[index];
        chart
            .draw_series(LineSeries::new(
                points.iter().copied(),
                colour.stroke_width(2),
            ))
            .map_err(err)?
            .label(label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], colour));
        chart
            .draw_series(points.iter().map(|p| Circle::new(*p, 4, colour.filled())))
            .map_err(err)?;
    }
    chart
        .draw_series(DashedLineSeries::new(
            vec![(1.0, floor_ns), (right, floor_ns)],
            6,
            4,
            BLACK.into(),
        ))
        .map_err(err)?
        .label("empty TC program (floor)")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLACK));
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)?;
    Ok(())
}

/// The bulk flow's added RTT over time (its sender's smoothed RTT over the idle RTT, per
/// second), one line per setup: the queue each limiter keeps.
pub fn queue_over_time(path: &Path, title: &str, series: &[(String, Series)]) -> Result<()> {
    added_rtt_over_time(
        path,
        (
            title,
            "time (s) since the load started",
            "bulk flow's added RTT (ms)",
        ),
        2,
        series,
    )
}

/// The probe's added RTT over time, one line per setup (ms over the idle RTT).
pub fn rtt_over_time(path: &Path, title: &str, series: &[(String, Series)]) -> Result<()> {
    added_rtt_over_time(
        path,
        (
            title,
            "time (s) since the probe started",
            "probe's added RTT (ms)",
        ),
        1,
        series,
    )
}

/// Milliseconds over an idle RTT against time: (title, x, y) descriptions, line width.
fn added_rtt_over_time(
    path: &Path,
    (title, x_desc, y_desc): (&str, &str, &str),
    stroke: u32,
    series: &[(String, Series)],
) -> Result<()> {
    let top = values(series).fold(10.0, f64::max) * 1.1;
    let bottom = values(series).fold(0.0, f64::min);
    lines_over_time(
        path,
        &Axes {
            title,
            x_desc,
            y_desc,
            y_range: bottom..top,
            stroke,
            legend: SeriesLabelPosition::UpperRight,
        },
        series,
        None,
    )
}

/// Small charts in a grid, two a row, each with its title and one line per series
/// (x: seconds since the run's start): a dashboard's panels drawn from their data.
pub fn panel_grid(
    path: &Path,
    title: &str,
    panels: &[(String, Vec<(String, Series)>)],
) -> Result<()> {
    let rows = panels.len().div_ceil(2).max(1);
    let root = BitMapBackend::new(path, (1400, 60 + 330 * rows as u32)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let root = root.titled(title, ("sans-serif", 26)).map_err(err)?;
    let cells = root.split_evenly((rows, 2));
    for ((panel_title, series), cell) in panels.iter().zip(cells.iter()) {
        let end = series
            .iter()
            .flat_map(|(_, points)| points.iter().map(|p| p.0))
            .fold(1.0, f64::max);
        let top = values(series).fold(0.0, f64::max);
        let top = if top > 0.0 { top * 1.15 } else { 1.0 };
        let mut chart = ChartBuilder::on(cell)
            .caption(panel_title.as_str(), ("sans-serif", 18))
            .margin(10)
            .x_label_area_size(28)
            .y_label_area_size(70)
            .build_cartesian_2d(0.0..end, 0.0..top)
            .map_err(err)?;
        chart
            .configure_mesh()
            .x_desc("s")
            .y_label_formatter(&|v| short_number(*v))
            .draw()
            .map_err(err)?;
        // At most six series a panel, the rest left out of the picture (not of the data).
        for (index, (label, points)) in series.iter().take(6).enumerate() {
            let colour = COLOURS[index % COLOURS.len()];
            chart
                .draw_series(LineSeries::new(points.clone(), colour.stroke_width(2)))
                .map_err(err)?
                .label(label.as_str())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], colour));
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .label_font(("sans-serif", 12))
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(err)?;
    }
    root.present().map_err(err)?;
    Ok(())
}

/// A number for an axis: 12k, 3.4M, 0.005.
fn short_number(value: f64) -> String {
    let magnitude = value.abs();
    if magnitude >= 1e9 {
        format!("{:.1}G", value / 1e9)
    } else if magnitude >= 1e6 {
        format!("{:.1}M", value / 1e6)
    } else if magnitude >= 1e3 {
        format!("{:.0}k", value / 1e3)
    } else if magnitude >= 10.0 || magnitude == 0.0 {
        format!("{value:.0}")
    } else if magnitude >= 1.0 {
        format!("{value:.1}")
    } else {
        format!("{value:.3}")
    }
}
