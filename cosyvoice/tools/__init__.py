"""Command-line tools: tiny bundle generator, golden parity checker."""
