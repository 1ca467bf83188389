"""The official-compatible API: ``from cosyvoice.cli.cosyvoice import CosyVoice3, AutoModel``."""
