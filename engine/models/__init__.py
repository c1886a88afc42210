"""Model code: our Llama-family decoder and weight loading."""
from .llama import SUPPORTED_ARCHITECTURES, LlamaFamilyModel
from .loader import load_model

__all__ = ["SUPPORTED_ARCHITECTURES", "LlamaFamilyModel", "load_model"]
