"""The HTTP side: an OpenAI-compatible API and vLLM-named Prometheus metrics over the engine service, mounted on the
playground's own server (app.py), so one `python app.py` serves the page, /v1 and /metrics."""
from engine.models.loader import DEFAULT_HUB_ID

from .routes import OpenAIApi


def served_model_name(model: str | None) -> str:
    """The name clients send as "model": the model as given on the command line, as vLLM names it."""
    return model or DEFAULT_HUB_ID


__all__ = ["OpenAIApi", "served_model_name"]
