//! The [`Registry`] behind `/metrics`, on the `prometheus` crate: each declared [`Metric`] is a
//! family of series whose values are the crate's counters, gauges and histograms, gathered by
//! the crate's registry and written by its `TextEncoder`. Why the families are not the crate's
//! metric vectors, and the one adapter on the output, are in [`Registry`]'s doc.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use prometheus::core::{Collector, Desc, Metric as _};
use prometheus::proto::{LabelPair, MetricFamily, MetricType};
use prometheus::{Counter, Gauge, Histogram, HistogramOpts, TextEncoder};

use super::{ALL, Kind, MAX_SERIES, Metric};

/// One series' value: the `prometheus` metric of the family's [`Kind`].
enum Value {
    Counter(Counter),
    Gauge(Gauge),
    Histogram(Histogram),
}

impl Value {
    /// A new series of `m` at zero; the crate refuses an invalid name, help or buckets.
    fn try_new(m: &Metric) -> prometheus::Result<Self> {
        Ok(match m.kind {
            Kind::Counter => Value::Counter(Counter::new(m.name, m.help)?),
            Kind::Gauge => Value::Gauge(Gauge::new(m.name, m.help)?),
            Kind::Histogram => {
                let opts = HistogramOpts::new(m.name, m.help).buckets(m.buckets.to_vec());
                Value::Histogram(Histogram::with_opts(opts)?)
            }
        })
    }

    /// A new series of `m`, a metric whose family was registered (so `try_new` accepted it).
    fn new(m: &Metric) -> Self {
        Self::try_new(m)
            .unwrap_or_else(|e| panic!("metric {} was registered but is invalid: {e}", m.name))
    }

    fn proto(&self) -> prometheus::proto::Metric {
        match self {
            Value::Counter(c) => c.metric(),
            Value::Gauge(g) => g.metric(),
            Value::Histogram(h) => h.metric(),
        }
    }
}

/// Series by label values, in the order of the metric's label names.
type Series = HashMap<Vec<String>, Value>;

/// Every series of one declared metric.
struct Family {
    metric: &'static Metric,
    desc: Desc,
    series: RwLock<Series>,
}

impl Family {
    fn new(metric: &'static Metric) -> prometheus::Result<Self> {
        let labels = metric.labels.iter().map(|l| l.to_string()).collect();
        let desc = Desc::new(
            metric.name.into(),
            metric.help.into(),
            labels,
            HashMap::new(),
        )?;
        // Checks the buckets (and the rest) once, before any series needs them.
        Value::try_new(metric)?;
        Ok(Self {
            metric,
            desc,
            series: RwLock::new(Series::new()),
        })
    }

    /// Runs `f` on the series of `labels`, creating it at zero if new; past [`MAX_SERIES`]
    /// label sets a new one is folded into the series whose every label is `_other`.
    fn with(&self, labels: &[&str], f: impl FnOnce(&Value)) {
        let m = self.metric;
        debug_assert_eq!(labels.len(), m.labels.len(), "labels of {}", m.name);
        let mut key: Vec<String> = labels.iter().map(|l| l.to_string()).collect();
        if let Some(value) = self.series.read().expect("metrics lock").get(&key) {
            return f(value);
        }
        let mut series = self.series.write().expect("metrics lock");
        if !series.contains_key(&key) && series.len() >= MAX_SERIES {
            key = vec!["_other".to_string(); labels.len()];
        }
        f(series.entry(key).or_insert_with(|| Value::new(m)));
    }
}

/// What the `prometheus` registry holds for a family (a collector must be owned by it).
struct Collected(Arc<Family>);

impl Collector for Collected {
    fn desc(&self) -> Vec<&Desc> {
        vec![&self.0.desc]
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let family = &self.0;
        let m = family.metric;
        let series = family.series.read().expect("metrics lock");
        let metrics = series
            .iter()
            .map(|(values, value)| {
                let mut sample = value.proto();
                sample.set_label(label_pairs(m.labels, values));
                sample
            })
            .collect();
        let mut out = MetricFamily::default();
        out.set_name(m.name.to_string());
        out.set_help(m.help.to_string());
        out.set_field_type(match m.kind {
            Kind::Counter => MetricType::COUNTER,
            Kind::Gauge => MetricType::GAUGE,
            Kind::Histogram => MetricType::HISTOGRAM,
        });
        out.set_metric(metrics);
        vec![out]
    }
}

/// Label pairs in the order the metric declares its label names (the crate would sort them
/// by name; the declared order keeps the text as it was).
fn label_pairs(names: &[&str], values: &[String]) -> Vec<LabelPair> {
    names
        .iter()
        .zip(values)
        .map(|(name, value)| {
            let mut pair = LabelPair::default();
            pair.set_name(name.to_string());
            pair.set_value(value.clone());
            pair
        })
        .collect()
}

/// A set of metric series, one family per declared metric ([`ALL`]). The process uses
/// [`global`](super::global); tests may make their own.
///
/// The values (atomic counters and gauges, sharded histograms), the registry that gathers and
/// sorts the series, and the text encoding are the `prometheus` crate's. A family is a
/// `prometheus` `Collector` (the crate's extension point) over a map from label values to the
/// crate's metrics, rather than one of its metric vectors (`CounterVec`, `GaugeVec`,
/// `HistogramVec`), because:
/// - the label-cardinality guard ([`MAX_SERIES`]) must know whether a label set is new and how
///   many a family holds, which a vector does not tell;
/// - a vector keys its series by one hash of the label values written back to back, with no
///   separator, so `{kind="x",class="non_retryable"}` and `{kind="xnon_",class="retryable"}`
///   would share one series (and a 64-bit hash collision would merge two others); a family
///   here is keyed by the label values themselves;
/// - a database gauge swaps its whole set of series at once ([`Registry::replace`]), so a
///   scrape never sees it half-replaced.
///
/// One adapter remains on the output, in [`Registry::render`]: the crate's registry leaves out
/// a family with no series (its encoder refuses one), and `/metrics` promises every declared
/// metric's `# HELP` and `# TYPE` before its first sample, so those two lines are written here
/// for an empty family; a test checks them against the lines the encoder writes for the same
/// family once it has a series.
pub struct Registry {
    families: HashMap<&'static str, Arc<Family>>,
    registry: prometheus::Registry,
}

impl Default for Registry {
    fn default() -> Self {
        let registry = prometheus::Registry::new();
        let mut families = HashMap::new();
        for m in ALL {
            let family = Family::new(m)
                .and_then(|f| {
                    let f = Arc::new(f);
                    registry.register(Box::new(Collected(f.clone())))?;
                    Ok(f)
                })
                .unwrap_or_else(|e| panic!("metric {} is declared wrong: {e}", m.name));
            families.insert(m.name, family);
        }
        Self { families, registry }
    }
}

impl Registry {
    fn family(&self, m: &Metric) -> &Family {
        self.families
            .get(m.name)
            .unwrap_or_else(|| panic!("metric {} is not declared in metrics::ALL", m.name))
    }

    /// Adds `v` to a counter (or gauge).
    pub fn add(&self, m: &Metric, labels: &[&str], v: f64) {
        self.family(m).with(labels, |value| match value {
            Value::Counter(c) => c.inc_by(v),
            Value::Gauge(g) => g.add(v),
            Value::Histogram(_) => {}
        });
    }

    /// Sets a gauge.
    pub fn set(&self, m: &Metric, labels: &[&str], v: f64) {
        self.family(m).with(labels, |value| {
            if let Value::Gauge(g) = value {
                g.set(v);
            }
        });
    }

    /// Records one observation of a histogram.
    pub fn observe(&self, m: &Metric, labels: &[&str], v: f64) {
        self.family(m).with(labels, |value| {
            if let Value::Histogram(h) = value {
                h.observe(v);
            }
        });
    }

    /// Replaces every series of a gauge at once (database gauges: a status with no rows left
    /// must disappear, not keep its last value). Keeps the first [`MAX_SERIES`] rows.
    pub fn replace(&self, m: &Metric, rows: Vec<(Vec<String>, f64)>) {
        let family = self.family(m);
        let mut fresh = Series::new();
        for (labels, v) in rows.into_iter().take(MAX_SERIES) {
            debug_assert_eq!(labels.len(), m.labels.len(), "labels of {}", m.name);
            let value = Value::new(family.metric);
            if let Value::Gauge(g) = &value {
                g.set(v);
            }
            fresh.insert(labels, value);
        }
        *family.series.write().expect("metrics lock") = fresh;
    }

    /// A counter's or gauge's current value, or a histogram's count.
    pub fn value(&self, m: &Metric, labels: &[&str]) -> Option<f64> {
        let key: Vec<String> = labels.iter().map(|l| l.to_string()).collect();
        let series = self.family(m).series.read().expect("metrics lock");
        series.get(&key).map(|v| match v {
            Value::Counter(c) => c.get(),
            Value::Gauge(g) => g.get(),
            Value::Histogram(h) => h.get_sample_count() as f64,
        })
    }

    /// Every declared metric as Prometheus text (version 0.0.4), in the order of [`ALL`]:
    /// `# HELP` and `# TYPE` for each, even one without samples yet.
    pub fn render(&self) -> String {
        let gathered: HashMap<String, MetricFamily> = self
            .registry
            .gather()
            .into_iter()
            .map(|f| (f.name().to_string(), f))
            .collect();
        let encoder = TextEncoder::new();
        let mut out = String::new();
        for m in ALL {
            match gathered.get(m.name) {
                Some(family) => {
                    if let Err(e) = encoder.encode_utf8(std::slice::from_ref(family), &mut out) {
                        tracing::error!(error = %e, metric = m.name, "metrics: encoding failed");
                    }
                }
                None => out.push_str(&empty_family(m)),
            }
        }
        out
    }
}

/// `# HELP` and `# TYPE` of a metric with no series, as the encoder writes them for one with
/// series (the help texts hold no `\` or newline, which the encoder would escape: checked by
/// a test).
fn empty_family(m: &Metric) -> String {
    format!(
        "# HELP {} {}\n# TYPE {} {}\n",
        m.name,
        m.help,
        m.name,
        m.kind.as_str()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_family_has_the_header_lines_the_encoder_writes() {
        let empty = Registry::default().render();
        let full = Registry::default();
        for m in ALL {
            assert!(
                !m.help.contains(['\\', '\n']),
                "{}: the encoder would escape its help",
                m.name
            );
            let labels: Vec<&str> = m.labels.iter().map(|_| "x").collect();
            full.add(m, &labels, 1.0);
            full.observe(m, &labels, 1.0);
        }
        let full = full.render();
        let headers: Vec<&str> = full.lines().filter(|l| l.starts_with('#')).collect();
        assert_eq!(empty.lines().collect::<Vec<_>>(), headers);
        assert_eq!(headers.len(), 2 * ALL.len());
    }

    #[test]
    fn label_sets_that_concatenate_alike_stay_apart() {
        let registry = Registry::default();
        let m = &super::super::OPERATION_FAILURES;
        registry.add(m, &["x", "non_retryable"], 1.0);
        registry.add(m, &["xnon_", "retryable"], 2.0);
        assert_eq!(registry.value(m, &["x", "non_retryable"]), Some(1.0));
        assert_eq!(registry.value(m, &["xnon_", "retryable"]), Some(2.0));
        let text = registry.render();
        assert!(
            text.contains(
                "agentq_operation_failures_total{kind=\"x\",class=\"non_retryable\"} 1\n"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "agentq_operation_failures_total{kind=\"xnon_\",class=\"retryable\"} 2\n"
            ),
            "{text}"
        );
    }
}
