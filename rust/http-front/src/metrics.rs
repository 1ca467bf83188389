//! The bridge contract's Prometheus families, with the Python server's names, labels and buckets
//! (`cosyvoice/server/metrics.py`), so a dashboard reads every server alike.

use prometheus::{
    Encoder, HistogramOpts, HistogramVec, IntCounterVec, Opts, Registry, TextEncoder,
};

// the Python server's histogram buckets (cosyvoice/server/metrics.py)
const SECONDS: [f64; 13] = [
    0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 30.0, 60.0,
];
const RTF: [f64; 10] = [0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0];

/// The server's Prometheus families: counted here, from each answer of `/synthesize`.
pub struct Metrics {
    registry: Registry,
    requests: IntCounterVec,
    success: IntCounterVec,
    error: IntCounterVec,
    duration: HistogramVec,
    rtf: HistogramVec,
}

impl Metrics {
    pub fn new() -> Metrics {
        let registry = Registry::new();
        let requests = IntCounterVec::new(
            Opts::new("tts_requests_total", "Synthesis requests received"),
            &["mode"],
        )
        .unwrap();
        let success = IntCounterVec::new(
            Opts::new("tts_requests_success", "Synthesis requests completed"),
            &["mode"],
        )
        .unwrap();
        let error = IntCounterVec::new(
            Opts::new(
                "tts_requests_error",
                "Synthesis requests failed or cancelled",
            ),
            &["mode", "reason"],
        )
        .unwrap();
        let duration = HistogramVec::new(
            HistogramOpts::new(
                "tts_synthesis_duration_seconds",
                "Wall time of a completed request",
            )
            .buckets(SECONDS.to_vec()),
            &["mode"],
        )
        .unwrap();
        let rtf = HistogramVec::new(
            HistogramOpts::new(
                "tts_rtf",
                "Real-time factor (wall seconds per audio second) of a completed request",
            )
            .buckets(RTF.to_vec()),
            &["mode"],
        )
        .unwrap();
        for collector in [&requests, &success, &error] {
            registry.register(Box::new(collector.clone())).unwrap();
        }
        registry.register(Box::new(duration.clone())).unwrap();
        registry.register(Box::new(rtf.clone())).unwrap();
        Metrics {
            registry,
            requests,
            success,
            error,
            duration,
            rtf,
        }
    }

    pub fn observe(&self, mode: &str, reason: Option<&str>, seconds: f64, audio_seconds: f64) {
        self.requests.with_label_values(&[mode]).inc();
        match reason {
            Some(reason) => self.error.with_label_values(&[mode, reason]).inc(),
            None => {
                self.success.with_label_values(&[mode]).inc();
                self.duration.with_label_values(&[mode]).observe(seconds);
                if audio_seconds > 0.0 {
                    self.rtf
                        .with_label_values(&[mode])
                        .observe(seconds / audio_seconds);
                }
            }
        }
    }

    pub fn exposition(&self) -> (Vec<u8>, String) {
        let encoder = TextEncoder::new();
        let mut out = Vec::new();
        encoder
            .encode(&self.registry.gather(), &mut out)
            .expect("text encoding");
        (out, encoder.format_type().to_string())
    }
}

impl Default for Metrics {
    fn default() -> Metrics {
        Metrics::new()
    }
}
