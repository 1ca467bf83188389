"""Helpers under the official module paths (``cosyvoice.utils.*``), so official scripts import unchanged."""
