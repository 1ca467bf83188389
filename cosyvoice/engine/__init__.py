"""The engine: LLM scheduler, token-to-wave worker and sessions on one device (docs/architecture.md)."""

from cosyvoice.engine.engine import Engine
from cosyvoice.engine.scheduler import LLMScheduler, Ticket
from cosyvoice.engine.session import AudioChunk, CancelToken, ChunkPolicy, ChunkSchedule, Session
from cosyvoice.engine.t2w import T2WState, Token2Wav

__all__ = ["AudioChunk", "CancelToken", "ChunkPolicy", "ChunkSchedule", "Engine", "LLMScheduler", "Session",
           "T2WState", "Ticket", "Token2Wav"]
