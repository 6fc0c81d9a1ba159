"""The OpenAI-compatible HTTP front (front.py is the process, app.py the FastAPI application)."""
