"""dsv4.server: the OpenAI-compatible HTTP server (``dsv4 serve``).

``build_app(AsyncEngine(LLMEngine(path)), model_name=...)`` gives the FastAPI app;
``dsv4.server.cli`` has the command line.
"""
