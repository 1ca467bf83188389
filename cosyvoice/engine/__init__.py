"""The engine: LLM scheduler, token-to-wave worker and sessions on one device (docs/architecture.md)."""

from cosyvoice.engine.engine import Engine, Strategy
from cosyvoice.engine.scheduler import LLMScheduler, Ticket
from cosyvoice.engine.session import AudioChunk, CancelToken, ChunkPolicy, Session

__all__ = ["AudioChunk", "CancelToken", "ChunkPolicy", "Engine", "LLMScheduler", "Session", "Strategy", "Ticket"]
