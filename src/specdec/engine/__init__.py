"""The decode loop lives only here."""

from specdec.engine.engine import GenerationError, GenerationResult, SpecEngine, StreamChunk
from specdec.engine.metrics import RequestStats

__all__ = ["GenerationError", "GenerationResult", "RequestStats", "SpecEngine", "StreamChunk"]
