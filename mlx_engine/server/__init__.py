"""The HTTP server: OpenAI- and ollama-compatible routes over one device thread, continuous batching and a prefix
cache (:mod:`.scheduler`), models under one memory budget (:mod:`.pool`)."""

from mlx_engine.server.app import ServerConfig, api_key_from_env, create_app, serve

__all__ = ["ServerConfig", "create_app", "serve", "api_key_from_env"]
