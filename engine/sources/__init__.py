"""Where rounds come from besides the local engine: a served engine (an OpenAI-compatible server)."""
