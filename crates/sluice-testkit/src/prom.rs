//! A strict reader of the Prometheus text exposition format (0.0.4), for tests.
//!
//! Owns: parsing a `/metrics` body into families and samples, and the checks that make
//! `promtool check metrics` fail, reported per family so a failing test names the family to
//! fix. Does not own: scraping (tests fetch the body themselves).
//!
//! What [`check`] enforces:
//! - every line parses: `# HELP name text`, `# TYPE name kind`, other `#` comments, or
//!   `name{label="value",…} value [timestamp]`; names and label names are valid;
//! - one group per family: all lines of a family (its HELP, TYPE and samples — for a histogram
//!   `_bucket`, `_sum`, `_count`) are consecutive, HELP and TYPE appear at most once and before
//!   the samples;
//! - no series twice (same name and label set);
//! - histograms: every `_bucket` has `le`, buckets are cumulative, `+Inf` equals `_count`;
//! - the lint rules promtool applies to names: counters end in `_total`, no `_total`/
//!   `_count`/`_sum`/`_bucket` on other kinds, base units (no `milliseconds`, `microseconds`,
//!   `kilobytes`…), every family has HELP text.

use std::collections::{BTreeMap, HashMap, HashSet};

/// One sample line.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// The sample's own name (`x_bucket` for a histogram bucket of family `x`).
    pub name: String,
    pub labels: Vec<(String, String)>,
    pub value: f64,
}

impl Sample {
    pub fn label(&self, name: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// One metric family: its description and samples.
#[derive(Debug, Clone, Default)]
pub struct Family {
    pub name: String,
    /// `counter`, `gauge`, `histogram`, `summary` or `untyped`.
    pub kind: String,
    pub help: Option<String>,
    pub samples: Vec<Sample>,
}

/// A parsed and checked exposition.
#[derive(Debug, Clone, Default)]
pub struct Exposition {
    pub families: BTreeMap<String, Family>,
}

impl Exposition {
    pub fn family(&self, name: &str) -> Option<&Family> {
        self.families.get(name)
    }

    /// Whether `name` is a family or a sample name of one (`x_bucket`, `x_sum`, `x_count`).
    pub fn has_metric(&self, name: &str) -> bool {
        self.families.contains_key(name)
            || self
                .families
                .values()
                .any(|f| f.samples.iter().any(|s| s.name == name))
            || ["_bucket", "_sum", "_count"].iter().any(|suffix| {
                name.strip_suffix(suffix).is_some_and(|base| {
                    self.families
                        .get(base)
                        .is_some_and(|f| f.kind == "histogram" || f.kind == "summary")
                })
            })
    }

    /// Sum of the values of every sample named `name` whose labels include all of `labels`.
    pub fn sum(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.families
            .values()
            .flat_map(|f| f.samples.iter())
            .filter(|s| s.name == name)
            .filter(|s| labels.iter().all(|(k, v)| s.label(k) == Some(*v)))
            .map(|s| s.value)
            .sum()
    }
}

/// Parses `text` and applies every check; the error lists each problem as
/// `family NAME: what` (or `line N: what` for a line that does not parse), one a line.
pub fn check(text: &str) -> Result<Exposition, String> {
    let mut problems: Vec<String> = Vec::new();
    let mut exp = Exposition::default();
    // Families whose group has ended (another family's line came after theirs).
    let mut closed: HashSet<String> = HashSet::new();
    let mut current: Option<String> = None;
    let mut series: HashSet<String> = HashSet::new();
    let mut help_seen: HashSet<String> = HashSet::new();
    let mut type_seen: HashSet<String> = HashSet::new();

    for (n, line) in text.lines().enumerate() {
        let n = n + 1;
        if line.trim().is_empty() {
            continue;
        }
        let (family, what) = if let Some(rest) = line.strip_prefix('#') {
            let rest = rest.trim_start();
            let mut parts = rest.splitn(3, ' ');
            match (parts.next(), parts.next(), parts.next()) {
                (Some("HELP"), Some(name), help) => {
                    if !help_seen.insert(name.to_string()) {
                        problems.push(format!("family {name}: HELP twice (line {n})"));
                    }
                    let f = exp.families.entry(name.to_string()).or_default();
                    f.name = name.to_string();
                    f.help = Some(help.unwrap_or("").to_string());
                    (name.to_string(), "HELP")
                }
                (Some("TYPE"), Some(name), Some(kind)) => {
                    let kind = kind.trim();
                    if !["counter", "gauge", "histogram", "summary", "untyped"].contains(&kind) {
                        problems.push(format!("family {name}: unknown TYPE {kind:?} (line {n})"));
                    }
                    if !type_seen.insert(name.to_string()) {
                        problems.push(format!("family {name}: TYPE twice (line {n})"));
                    }
                    let f = exp.families.entry(name.to_string()).or_default();
                    f.name = name.to_string();
                    if !f.samples.is_empty() {
                        problems.push(format!("family {name}: TYPE after its samples (line {n})"));
                    }
                    f.kind = kind.to_string();
                    (name.to_string(), "TYPE")
                }
                (Some("TYPE"), _, _) => {
                    problems.push(format!("line {n}: TYPE without a kind: {line}"));
                    continue;
                }
                _ => continue, // a comment
            }
        } else {
            let sample = match parse_sample(line) {
                Ok(s) => s,
                Err(e) => {
                    problems.push(format!("line {n}: {e}: {line}"));
                    continue;
                }
            };
            let family = family_of(&exp, &sample.name);
            let mut key = sample.name.clone();
            let mut sorted = sample.labels.clone();
            sorted.sort();
            for (k, v) in &sorted {
                key.push_str(&format!("|{k}={v}"));
            }
            if !series.insert(key) {
                problems.push(format!(
                    "family {family}: series {} twice (line {n})",
                    render_series(&sample)
                ));
            }
            let f = exp.families.entry(family.clone()).or_default();
            if f.name.is_empty() {
                f.name = family.clone();
                f.kind = "untyped".into();
            }
            f.samples.push(sample);
            (family, "sample")
        };
        if current.as_deref() != Some(family.as_str()) {
            if closed.contains(&family) {
                problems.push(format!(
                    "family {family}: a second group starts at line {n} ({what}); all its lines must be consecutive"
                ));
            }
            if let Some(previous) = current.take() {
                closed.insert(previous);
            }
            current = Some(family);
        }
    }

    for f in exp.families.values() {
        check_family(f, &mut problems);
    }
    if problems.is_empty() {
        Ok(exp)
    } else {
        // One problem per family and kind is enough to read; keep them all but deduplicate.
        let mut seen = HashSet::new();
        problems.retain(|p| seen.insert(p.clone()));
        Err(problems.join("\n"))
    }
}

/// The family a sample belongs to: itself, or the histogram/summary it is a part of.
fn family_of(exp: &Exposition, sample: &str) -> String {
    for suffix in ["_bucket", "_sum", "_count"] {
        if let Some(base) = sample.strip_suffix(suffix) {
            if let Some(f) = exp.families.get(base) {
                if f.kind == "histogram" || (f.kind == "summary" && suffix != "_bucket") {
                    return base.to_string();
                }
            }
        }
    }
    sample.to_string()
}

fn render_series(s: &Sample) -> String {
    let labels: Vec<String> = s
        .labels
        .iter()
        .map(|(k, v)| format!("{k}=\"{v}\""))
        .collect();
    format!("{}{{{}}}", s.name, labels.join(","))
}

const NON_BASE_UNITS: [&str; 14] = [
    "milliseconds",
    "microseconds",
    "nanoseconds",
    "minutes",
    "hours",
    "days",
    "weeks",
    "kilobytes",
    "megabytes",
    "gigabytes",
    "kibibytes",
    "mebibytes",
    "percent",
    "bits",
];

fn check_family(f: &Family, problems: &mut Vec<String>) {
    let name = &f.name;
    if !valid_name(name) {
        problems.push(format!("family {name}: invalid metric name"));
    }
    match &f.help {
        None => problems.push(format!("family {name}: no HELP")),
        Some(h) if h.trim().is_empty() => problems.push(format!("family {name}: empty HELP")),
        _ => {}
    }
    if f.kind.is_empty() || f.kind == "untyped" {
        problems.push(format!("family {name}: no TYPE"));
    }
    for unit in NON_BASE_UNITS {
        if name.split('_').any(|part| part == unit) {
            problems.push(format!(
                "family {name}: non-base unit {unit:?} (use seconds, bytes, ratio)"
            ));
        }
    }
    match f.kind.as_str() {
        "counter" => {
            if !name.ends_with("_total") {
                problems.push(format!(
                    "family {name}: a counter's name must end in _total"
                ));
            }
            for s in &f.samples {
                if s.name != *name {
                    problems.push(format!("family {name}: sample {} in a counter", s.name));
                }
                if s.value < 0.0 {
                    problems.push(format!(
                        "family {name}: negative counter {}",
                        render_series(s)
                    ));
                }
            }
        }
        "gauge" => {
            for suffix in ["_total", "_count", "_sum", "_bucket"] {
                if name.ends_with(suffix) {
                    problems.push(format!("family {name}: a gauge's name ends in {suffix}"));
                }
            }
        }
        "histogram" => check_histogram(f, problems),
        _ => {}
    }
}

/// A label set, sorted.
type LabelSet = Vec<(String, String)>;

fn check_histogram(f: &Family, problems: &mut Vec<String>) {
    let name = &f.name;
    // Per label set (without `le`): the buckets in order (le, cumulative count), the count.
    let mut buckets: HashMap<LabelSet, Vec<(f64, f64)>> = HashMap::new();
    let mut counts: HashMap<LabelSet, f64> = HashMap::new();
    for s in &f.samples {
        let mut rest: LabelSet = s
            .labels
            .iter()
            .filter(|(k, _)| k != "le")
            .cloned()
            .collect();
        rest.sort();
        if s.name == format!("{name}_bucket") {
            let Some(le) = s.label("le") else {
                problems.push(format!(
                    "family {name}: bucket without le: {}",
                    render_series(s)
                ));
                continue;
            };
            let le = match le {
                "+Inf" => f64::INFINITY,
                v => match v.parse::<f64>() {
                    Ok(v) => v,
                    Err(_) => {
                        problems.push(format!("family {name}: le {le:?} is not a number"));
                        continue;
                    }
                },
            };
            buckets.entry(rest).or_default().push((le, s.value));
        } else if s.name == format!("{name}_count") {
            counts.insert(rest, s.value);
        } else if s.name != format!("{name}_sum") {
            problems.push(format!("family {name}: sample {} in a histogram", s.name));
        }
    }
    for (labels, bs) in &buckets {
        let mut last = (f64::NEG_INFINITY, 0.0);
        for &(le, v) in bs {
            if le <= last.0 {
                problems.push(format!("family {name}: buckets out of order at le={le}"));
            }
            if v < last.1 {
                problems.push(format!("family {name}: buckets not cumulative at le={le}"));
            }
            last = (le, v);
        }
        if last.0 != f64::INFINITY {
            problems.push(format!("family {name}: no +Inf bucket for {labels:?}"));
        } else if counts.get(labels) != Some(&last.1) {
            problems.push(format!(
                "family {name}: _count {:?} differs from the +Inf bucket {} for {labels:?}",
                counts.get(labels),
                last.1
            ));
        }
    }
}

fn valid_name(name: &str) -> bool {
    let mut chars = name.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

fn valid_label_name(name: &str) -> bool {
    let mut chars = name.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// `name{k="v",…} value [timestamp]`.
fn parse_sample(line: &str) -> Result<Sample, String> {
    let name_end = line.find(['{', ' ']).ok_or("no value")?;
    let name = &line[..name_end];
    if !valid_name(name) {
        return Err(format!("invalid metric name {name:?}"));
    }
    let mut rest = &line[name_end..];
    let mut labels = Vec::new();
    if let Some(after) = rest.strip_prefix('{') {
        let mut chars = after.char_indices().peekable();
        let mut consumed = None;
        loop {
            // Skip separators.
            while let Some(&(_, c)) = chars.peek() {
                if c == ',' || c == ' ' {
                    chars.next();
                } else {
                    break;
                }
            }
            match chars.peek() {
                Some(&(i, '}')) => {
                    consumed = Some(i + 1);
                    break;
                }
                None => break,
                _ => {}
            }
            let mut key = String::new();
            for (_, c) in chars.by_ref() {
                if c == '=' {
                    break;
                }
                key.push(c);
            }
            if !valid_label_name(&key) {
                return Err(format!("invalid label name {key:?}"));
            }
            if chars.next().map(|(_, c)| c) != Some('"') {
                return Err(format!("label {key} without a quoted value"));
            }
            let mut value = String::new();
            let mut closed = false;
            while let Some((_, c)) = chars.next() {
                match c {
                    '\\' => match chars.next().map(|(_, c)| c) {
                        Some('n') => value.push('\n'),
                        Some('\\') => value.push('\\'),
                        Some('"') => value.push('"'),
                        other => return Err(format!("bad escape {other:?} in label {key}")),
                    },
                    '"' => {
                        closed = true;
                        break;
                    }
                    c => value.push(c),
                }
            }
            if !closed {
                return Err(format!("label {key}: unterminated value"));
            }
            if labels.iter().any(|(k, _): &(String, String)| *k == key) {
                return Err(format!("label {key} twice"));
            }
            labels.push((key, value));
        }
        let consumed = consumed.ok_or("unterminated label set")?;
        rest = &after[consumed..];
    }
    let mut fields = rest.split_whitespace();
    let value = fields.next().ok_or("no value")?;
    let value = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        "NaN" => f64::NAN,
        v => v
            .parse::<f64>()
            .map_err(|_| format!("value {v:?} is not a number"))?,
    };
    if let Some(ts) = fields.next() {
        ts.parse::<i64>()
            .map_err(|_| format!("timestamp {ts:?} is not an integer"))?;
    }
    if fields.next().is_some() {
        return Err("trailing fields".into());
    }
    Ok(Sample {
        name: name.to_string(),
        labels,
        value,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_family_split_into_two_groups_is_named() {
        let text = "# HELP a_total A.\n# TYPE a_total counter\na_total{shard=\"0\"} 1\n\
                    # HELP b B.\n# TYPE b gauge\nb 2\na_total{shard=\"1\"} 3\n";
        let err = check(text).unwrap_err();
        assert!(err.contains("family a_total: a second group"), "{err}");
    }

    #[test]
    fn a_grouped_exposition_with_a_histogram_passes() {
        let text = "# HELP x_seconds X.\n# TYPE x_seconds histogram\n\
                    x_seconds_bucket{le=\"0.1\"} 1\nx_seconds_bucket{le=\"+Inf\"} 2\n\
                    x_seconds_sum 0.3\nx_seconds_count 2\n\
                    # HELP up_state S.\n# TYPE up_state gauge\nup_state{state=\"a b\\\"c\"} 1\n";
        let exp = check(text).unwrap();
        assert_eq!(exp.family("x_seconds").unwrap().samples.len(), 4);
        assert!(exp.has_metric("x_seconds_bucket"));
        assert_eq!(
            exp.family("up_state").unwrap().samples[0].label("state"),
            Some("a b\"c")
        );
    }

    #[test]
    fn lint_rules_name_the_family() {
        let text = "# HELP c C.\n# TYPE c counter\nc 1\n\
                    # HELP d_microseconds D.\n# TYPE d_microseconds gauge\nd_microseconds 1\n\
                    # TYPE e gauge\ne 1\ne 2\n";
        let err = check(text).unwrap_err();
        assert!(
            err.contains("family c: a counter's name must end in _total"),
            "{err}"
        );
        assert!(
            err.contains("family d_microseconds: non-base unit"),
            "{err}"
        );
        assert!(err.contains("family e: no HELP"), "{err}");
        assert!(err.contains("family e: series e{} twice"), "{err}");
    }
}
