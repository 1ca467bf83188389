"""Command-line entry points named as in the official repository (``python -m cosyvoice.bin.export_onnx``)."""
