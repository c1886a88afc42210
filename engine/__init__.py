"""An LLM inference engine you can watch: paged KV cache, continuous batching, prefix caching."""
from .config import EngineConfig
from .engine import LLMEngine
from .llm import LLM
from .request import RequestOutput
from .sampling_params import SamplingParams
from .snapshot import EngineSnapshot

__all__ = ["LLM", "LLMEngine", "EngineConfig", "EngineSnapshot", "RequestOutput", "SamplingParams"]
