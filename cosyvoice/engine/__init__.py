"""The engine: LLM scheduler and runner, token-to-wave worker and sessions on one device (docs/architecture.md)."""

from cosyvoice.engine.engine import Engine
from cosyvoice.engine.plan import SchedulePlan, Status, Ticket
from cosyvoice.engine.runner import LLMRunner
from cosyvoice.engine.scheduler import LLMScheduler
from cosyvoice.engine.session import AudioChunk, CancelToken, ChunkPolicy, ChunkSchedule, Session
from cosyvoice.engine.t2w import T2WState, Token2Wav

__all__ = ["AudioChunk", "CancelToken", "ChunkPolicy", "ChunkSchedule", "Engine", "LLMRunner", "LLMScheduler",
           "SchedulePlan", "Session", "Status", "T2WState", "Ticket", "Token2Wav"]
