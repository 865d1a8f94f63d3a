"""The decode loop lives only here."""

from specdec.engine.engine import GenerationResult, SpecEngine, StreamChunk
from specdec.engine.metrics import RequestStats

__all__ = ["GenerationResult", "RequestStats", "SpecEngine", "StreamChunk"]
