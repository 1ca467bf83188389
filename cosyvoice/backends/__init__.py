"""Accelerated backends for the flow estimator and the vocoder: torch, onnxruntime, tensorrt."""
